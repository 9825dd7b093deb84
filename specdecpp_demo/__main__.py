"""``python -m specdecpp_demo [--gguf FILE]``: materialise the demo pair and print its directories."""

from __future__ import annotations

import argparse

from .pair import FEATURE_ARTIFACT_DIR, demo_draft_path, demo_feature_draft_path, demo_target_path


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m specdecpp_demo", description=__doc__)
    parser.add_argument("--gguf", help="a local SmolLM2-135M-Instruct.Q4_1.gguf instead of the PyPI wheel's")
    args = parser.parse_args()
    print(f"target: {demo_target_path(args.gguf)}")
    print(f"draft:  {demo_draft_path()}")
    if (FEATURE_ARTIFACT_DIR / "model.safetensors").is_file():  # pair=demo_feature (docs/feature_draft.md)
        print(f"feature draft: {demo_feature_draft_path()}")


if __name__ == "__main__":
    main()
