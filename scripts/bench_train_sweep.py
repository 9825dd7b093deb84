"""Time the 20-head sweep (w_rej in 1,3,6,12 x D in 0..4) with cached draft features against the
draft recomputed at every step (the authors' pipeline), on the same data and machine.

    python scripts/bench_train_sweep.py                       # a random small draft and dataset
    python scripts/bench_train_sweep.py --draft .cache/demo/draft      # a real draft, random data
    python scripts/bench_train_sweep.py --draft .cache/demo/draft --data data/demo/bundled

Each head runs through ``train.run`` exactly as ``python -m train +experiment=NAME`` would
(trainer=cpu, no logger, no callbacks). Writes reports/bench_train_sweep.{json,png} and prints
a table. Timings include the final evaluation of every head on each split.
"""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parents[1]
EXPERIMENTS = [f"wrej{w}_d{d}" for w in (1, 3, 6, 12) for d in range(5)]


def build_draft(directory: Path, vocab: int, hidden: int, layers: int) -> str:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden, num_hidden_layers=layers,
                         num_attention_heads=max(1, hidden // 64), num_key_value_heads=max(1, hidden // 128),
                         max_position_embeddings=1024, tie_word_embeddings=False)
    LlamaForCausalLM(config).save_pretrained(directory)
    return str(directory)


def build_dataset(directory: Path, draft: str, hidden: int, vocab: int, prompts: int, length: int) -> str:
    """Random prompts and responses in the data_gen format (labels random: this is a timing run)."""
    from datasets import DatasetDict

    from specdecpp.data.dataset import rows_to_dataset, write_meta

    rng = np.random.default_rng(0)

    def rows(n: int, offset: int) -> list[dict]:
        out = []
        for j in range(n):
            x = rng.integers(0, vocab, length)
            y = np.where(rng.random(length) < 0.7, x, rng.integers(0, vocab, length))
            out.append({"id": str(offset + j), "prompt": "", "prompt_ids": rng.integers(0, vocab, 32).tolist(),
                        "target_ids": x.tolist(), "draft_ids": y.tolist(),
                        "p_acc": np.where(x == y, 1.0, rng.random(length)).tolist(),
                        "draft_entropy": rng.random(length).tolist()})
        return out

    n_eval = max(1, prompts // 4)
    DatasetDict({"train": rows_to_dataset(rows(prompts, 0)), "dev": rows_to_dataset(rows(n_eval, prompts)),
                 "test": rows_to_dataset(rows(n_eval, prompts + n_eval))}).save_to_disk(str(directory))
    write_meta(directory, {"draft": draft, "target": "none", "draft_hidden_size": hidden, "vocab_size": vocab,
                           "sampling": {"temperature": 1.0, "top_k": 50, "top_p": 1.0}, "seed": 0,
                           "prompts": {"source": "random"}, "max_new_tokens": length, "code_version": "bench",
                           "created": time.strftime("%Y-%m-%dT%H:%M:%S"), "complete": True})
    return str(directory)


def sweep(draft: str, data: str, work: Path, cached: bool, epochs: int, batch_size: int) -> list[float]:
    """Train every head in one process (as Hydra's multirun does); seconds per head."""
    from hydra import compose, initialize_config_dir

    from train import run

    mode = "cached" if cached else "recomputed"
    seconds = []
    with initialize_config_dir(config_dir=str(ROOT / "conf"), version_base="1.3"):
        for name in EXPERIMENTS:
            cfg = compose("train", overrides=[
                f"+experiment={name}", f"pair.draft={draft}", "pair.device=cpu", "pair.dtype=float32",
                f"data.path={data}", f"data.cache_features={str(cached).lower()}", f"data.cache_dir={work / 'cache'}",
                f"data.batch_size={batch_size}", "trainer=cpu", f"trainer.max_epochs={epochs}",
                "trainer.enable_progress_bar=false", "trainer.enable_model_summary=false",
                "logger=none", "callbacks=none", f"out={work / mode / name}"])
            start = time.perf_counter()
            run(cfg)
            seconds.append(time.perf_counter() - start)
            print(f"{mode:>10} {name:>9}: {seconds[-1]:6.1f} s", flush=True)
    return seconds


def report(results: dict, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"20-head sweep, {results['setup']['epochs']} epochs, {torch.get_num_threads()} thread(s)")
    for column in ("mode", "total s", "first head s", "other heads, mean s"):
        table.add_column(column, justify="right")
    for mode in ("cached", "recomputed"):
        s = results[mode]
        table.add_row(mode, f"{sum(s):.1f}", f"{s[0]:.1f}", f"{np.mean(s[1:]):.2f}")
    Console().print(table)
    print(f"speed-up of the sweep with cached features: {sum(results['recomputed']) / sum(results['cached']):.1f}x")

    fig, ax = plt.subplots(figsize=(9, 3.5))
    x = np.arange(len(EXPERIMENTS))
    ax.bar(x - 0.2, results["recomputed"], 0.4,
           label=f"draft recomputed every step ({sum(results['recomputed']):.0f} s)")
    ax.bar(x + 0.2, results["cached"], 0.4,
           label=f"cached features ({sum(results['cached']):.0f} s, cache built in head 1)")
    ax.set_xticks(x, EXPERIMENTS, rotation=60, fontsize=7)
    ax.set_ylabel("seconds per head")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path.with_suffix(".png"), dpi=120)
    path.with_suffix(".json").write_text(json.dumps(results, indent=2) + "\n")
    print(f"wrote {path.with_suffix('.json')} and {path.with_suffix('.png')}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--draft", help="draft model (HF dir, .gguf or hub id); default: a random small Llama")
    parser.add_argument("--data", help="data_gen dataset made with --draft; default: random data for the draft")
    parser.add_argument("--prompts", type=int, default=48, help="training prompts of the random dataset")
    parser.add_argument("--length", type=int, default=128, help="response tokens per random prompt")
    parser.add_argument("--hidden", type=int, default=256, help="hidden size of the random draft")
    parser.add_argument("--layers", type=int, default=4, help="layers of the random draft")
    parser.add_argument("--vocab", type=int, default=2048, help="vocabulary of the random draft")
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--threads", type=int, default=1, help="torch threads (1 on a shared machine)")
    parser.add_argument("--work", default=str(ROOT / "outputs" / "bench_train_sweep"), help="scratch directory")
    parser.add_argument("--report", default=str(ROOT / "reports" / "bench_train_sweep"), help="report path stem")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)

    work = Path(args.work)
    shutil.rmtree(work, ignore_errors=True)  # a fresh cache: its build is part of the timing
    work.mkdir(parents=True)
    if args.data is not None and args.draft is None:
        parser.error("--data needs --draft (the draft that labelled it)")
    draft = args.draft or build_draft(work / "draft", args.vocab, args.hidden, args.layers)
    data = args.data
    if data is None:
        from specdecpp.models.loading import load_model

        config = load_model(draft, "cpu").config
        data = build_dataset(work / "data", draft, config.hidden_size, config.vocab_size, args.prompts, args.length)
    results = {"setup": {**vars(args), "draft": draft, "data": data}}
    for cached in (True, False):
        results["cached" if cached else "recomputed"] = sweep(draft, data, work, cached, args.epochs, args.batch_size)
    Path(args.report).parent.mkdir(parents=True, exist_ok=True)
    report(results, Path(args.report))


if __name__ == "__main__":
    main()
