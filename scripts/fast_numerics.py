"""Why bf16 greedy tokens differ between the eager and the fast path, measured against float32 (issue 33).

    python scripts/fast_numerics.py                         # demo target, 8 bundled test prompts, 48 tokens
    python scripts/fast_numerics.py --prompts 4 --variants eager,static,default,freezing

For each held-out prompt (the bundled test split, chat template) and each bf16 (``--dtype``) variant (the eager
:class:`~specdecpp.models.runner.ModelRunner`; the :class:`~specdecpp.fast.runners.StaticRunner`
uncompiled, ``static``; compiled with the inductor settings of ``bench_compile.VARIANTS``), and the
same target in float32 (eager, the reference):

1. **Greedy decoding**, target-only, through the runners as the decoders drive them (the prompt
   in one forward, then one token per forward; stop at EOS or ``--max-new-tokens``). Printed: the
   first position where a variant's tokens leave the bf16 eager run's and the float32 run's; at
   the first split from eager, each run's top-2 logit margin there (top-1 minus top-2) and the
   float32 logits of the two tokens after the same prefix: which token float32 prefers, by how much.
2. **Teacher-forced logits** along the float32 greedy continuation (every variant reads the same
   tokens): per variant, the share of positions whose argmax equals float32's and eager bf16's,
   also with the output layer applied in float32 to the variant's own final hidden state (does a
   float32 output layer remove the splits?), and the distance of its logits to float32's per
   position (the largest absolute difference over the vocabulary, and the root mean square),
   medians over positions; and how often float32's own top-2 margin is below 0.125 and 0.25 (a
   near-tie at bf16's resolution). This says which bf16 variant is closer to float32, away from
   the compounding of a split.

Every variant runs on a prompt before the next prompt. Cache size: what the decoders use for such
a call (``CallRunners``, buckets 1). Writes JSON with ``--out``.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_compile import DEMO, VARIANTS  # noqa: E402

from specdecpp.core.timing import machine_description  # noqa: E402
from specdecpp.data.prompts import encode_prompt, load_prompts  # noqa: E402
from specdecpp.fast.calls import CallRunners  # noqa: E402
from specdecpp.fast.step import ModelSteps  # noqa: E402
from specdecpp.models.loading import eos_token_ids, load_model, load_pair  # noqa: E402


class Variant:
    """One way to run a model: ``fast`` None / "static" / "compile" with inductor ``options``; the
    compiled steps are its own (kept across prompts)."""

    def __init__(self, name: str, model) -> None:
        self.name, self.model = name, model
        self.fast = None if name in ("eager", "float32") else "static" if name == "static" else "compile"
        self.options, self.steps = dict(VARIANTS.get(name) or {}), ModelSteps(warned_wide=True)

    def runner(self, tokens: int, want_hidden: bool = False):
        make = CallRunners(self.fast, [self.model])(tokens, (1,))
        runner = make(self.model, self.model.config.vocab_size, want_hidden)
        if self.fast == "compile":
            runner.steps, runner.compile_options = self.steps, self.options
        return runner


def greedy(variant: Variant, prompt: list[int], n: int, eos: set[int]) -> tuple[list[int], list[torch.Tensor]]:
    """Greedy tokens (stopping after an EOS) and the float32 logits that chose each."""
    runner = variant.runner(len(prompt) + n + 1)
    logits = runner.feed(torch.tensor(prompt))[0][-1].float()
    tokens, seen = [], []
    while True:
        seen.append(logits)
        tokens.append(int(logits.argmax()))
        if tokens[-1] in eos or len(tokens) == n:
            return tokens, seen
        logits = runner.feed(torch.tensor(tokens[-1:]))[0][-1].float()


def forced(variant: Variant, prompt: list[int], cont: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
    """Logits [len(cont), V] after prompt + cont[:i], for each i, one token per forward, as the
    model gives them and as a float32 output layer gives them from the same final hidden states
    (both as float32)."""
    runner = variant.runner(len(prompt) + len(cont) + 1, want_hidden=True)
    with runner:
        steps = [runner.feed(torch.tensor(prompt))] + [runner.feed(torch.tensor([t])) for t in cont[:-1]]
    logits = torch.stack([lg[-1] for lg, _ in steps]).float()
    hidden = torch.stack([h[-1] for _, h in steps]).float()
    head = variant.model.get_output_embeddings().weight.float()
    return logits, (hidden @ head.T)[:, : logits.shape[1]]


def split(a: list[int], b: list[int]) -> int | None:
    """The first position where a and b differ (None if one is a prefix of the other)."""
    return next((i for i, (x, y) in enumerate(zip(a, b, strict=False)) if x != y), None)


def margin(logits: torch.Tensor) -> float:
    top = logits.topk(2).values
    return float(top[0] - top[1])


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--variants", default="eager,static,default,freezing",
                    help="bf16 variants: eager, static or names of bench_compile.VARIANTS; eager first")
    ap.add_argument("--draft", default=str(DEMO / "draft"))
    ap.add_argument("--target", default=str(DEMO / "target"))
    ap.add_argument("--dtype", default="bfloat16", help="the runs' dtype (float32: every runner should agree)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--max-new-tokens", type=int, default=48)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args(argv)
    names = args.variants.split(",")
    if names[0] != "eager" or any(n not in VARIANTS for n in names):
        ap.error(f"--variants must start with eager and name variants of {', '.join(VARIANTS)}")
    torch.set_num_threads(args.threads)
    _, target, tokenizer = load_pair(args.draft, args.target, device="cpu", dtype=args.dtype)
    reference = load_model(args.target, "cpu", "float32")
    eos = set(eos_token_ids(tokenizer, target))
    variants = {"float32": Variant("float32", reference), **{n: Variant(n, target) for n in names}}
    prompts = [encode_prompt(tokenizer, p.prompt) for p in load_prompts("bundled", split="test", limit=args.prompts)]
    print(f"{machine_description()}; target {args.target}; {len(prompts)} prompts x {args.max_new_tokens} tokens",
          flush=True)

    rows = []
    with torch.no_grad():
        for j, prompt in enumerate(prompts):
            runs = {name: greedy(v, prompt, args.max_new_tokens, eos) for name, v in variants.items()}
            ref_tokens = runs["float32"][0]
            logits = {name: forced(v, prompt, ref_tokens) for name, v in variants.items()}
            row = {"prompt": j, "prompt_len": len(prompt), "float32_tokens": len(ref_tokens), "variants": {}}
            for name in names:
                tokens, seen = runs[name]
                at = split(tokens, runs["eager"][0])
                out = {"tokens": len(tokens), "split_from_eager": at, "split_from_float32": split(tokens, ref_tokens)}
                if at is not None:  # both runs share tokens[:at]: float32's view of that prefix
                    ref = forced(variants["float32"], prompt, tokens[:at] + [tokens[at]])[0][at]
                    mine, eager_token = tokens[at], runs["eager"][0][at]
                    out.update({"margin": margin(seen[at]), "eager_margin": margin(runs["eager"][1][at]),
                                "float32_prefers": "this" if ref[mine] > ref[eager_token] else "eager",
                                "float32_gap": float(abs(ref[mine] - ref[eager_token])),
                                "float32_margin": margin(ref)})
                (mine, mine32), (ref, _), (eager, eager32) = logits[name], logits["float32"], logits["eager"]
                diff, same = mine - ref, mine.argmax(-1) == ref.argmax(-1)
                out["forced"] = {
                    "argmax_equal": float(same.float().mean()),
                    "argmax_equal_float32_head": float((mine32.argmax(-1) == ref.argmax(-1)).float().mean()),
                    "argmax_equal_eager": float((mine.argmax(-1) == eager.argmax(-1)).float().mean()),
                    "argmax_equal_eager_float32_head": float((mine32.argmax(-1) == eager32.argmax(-1)).float().mean()),
                    "max_abs": statistics.median(diff.abs().amax(-1).tolist()),
                    "rms": statistics.median(diff.pow(2).mean(-1).sqrt().tolist()),
                    "float32_margins_where_unequal": [margin(x) for x in ref[~same]]}
                row["variants"][name] = out
            margins = [margin(x) for x in logits["float32"][0]]
            row["float32_margins_below"] = {str(m): sum(x < m for x in margins) / len(margins) for m in (0.125, 0.25)}
            rows.append(row)
            print(json.dumps(row), flush=True)

    def mean(key: str, vs) -> str:
        return f"{statistics.fmean(v['forced'][key] for v in vs):.3f}"

    below = {m: statistics.fmean(r["float32_margins_below"][m] for r in rows) for m in ("0.125", "0.25")}
    print(f"\nfloat32 top-2 margin (teacher-forced positions): below 0.125 at {below['0.125']:.1%}, below 0.25 at "
          f"{below['0.25']:.1%}")
    print("\n| variant | prompts split from eager | split at (token) | margin there: this / eager | float32 prefers "
          "(gap) | split from float32 | argmax = float32 (forced) | same, float32 output layer | argmax = eager "
          "(forced) | same, float32 output layers | max abs / rms logit error vs float32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for name in names:
        vs = [r["variants"][name] for r in rows]
        splits = [v for v in vs if v["split_from_eager"] is not None]
        print(f"| {name} | {len(splits)}/{len(vs)} | {', '.join(str(v['split_from_eager']) for v in splits) or '-'} | "
              + (", ".join(f"{v['margin']:.3f}/{v['eager_margin']:.3f}" for v in splits) or "-") + " | "
              + (", ".join(f"{v['float32_prefers']} ({v['float32_gap']:.3f})" for v in splits) or "-") + " | "
              f"{sum(v['split_from_float32'] is not None for v in vs)}/{len(vs)} | {mean('argmax_equal', vs)} | "
              f"{mean('argmax_equal_float32_head', vs)} | {mean('argmax_equal_eager', vs)} | "
              f"{mean('argmax_equal_eager_float32_head', vs)} | "
              f"{statistics.median(v['forced']['max_abs'] for v in vs):.3f} / "
              f"{statistics.median(v['forced']['rms'] for v in vs):.4f} |")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps({"machine": machine_description(), "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
