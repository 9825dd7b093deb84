"""Measured tokens/s of PEARL against target-only and sequential fixed K, interleaved per prompt.

    python scripts/bench_pearl.py                                  # 4 bundled test + 4 HumanEval prompts, 64 tokens
    python scripts/bench_pearl.py --prompts 10 --max-new-tokens 96 --gammas 3 4 5 --out reports/pearl.json

On the demo pair (or --draft/--target), T=1 / top-k 50, for N held-out prompts of the bundled test
split and N of HumanEval, every method decodes a prompt before the next prompt (a change in the
machine's load touches all of them alike): target-only with 1 and 2 torch threads, sequential
fixed K (1 thread), PEARL with Theorem 1's gamma and with fixed gammas (1 intra-op thread per
side), optionally PEARL with SVIP ending a block early. Prompt j gets the same seed in every
method (infer.results.prompt_seed). Printed: pooled tokens/s, the speedup over target-only at 1
thread and over the better of 1 and 2 threads, each with a paired 95% bootstrap interval over
prompts (infer.summary.paired_speedup_ci), PEARL's overlap (share of wall time both models were
busy at once) and rounds, and the load average before and after (the machine may be shared).
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import os
import sys
import threading
import time
from pathlib import Path

import torch

from infer.results import prompt_seed
from infer.summary import paired_speedup_ci
from specdecpp import (
    SVIP,
    FixedK,
    PEARLDecoder,
    SamplingConfig,
    SpeculativeDecoder,
    TargetOnly,
    load_pair,
)
from specdecpp.core.timing import machine_description
from specdecpp.data.prompts import encode_prompt, load_prompts
from specdecpp.models.loading import dtype_name, eos_token_ids
from specdecpp_demo import demo_draft_path, demo_target_path

SAMPLING = SamplingConfig(temperature=1.0, top_k=50)


class Method:
    """A decoder run with ``threads`` torch threads (PEARL sets its own per side)."""

    def __init__(self, name: str, decoder, threads: int | None) -> None:
        self.name, self.decoder, self.threads, self.rows = name, decoder, threads, []

    def run(self, ids, max_new_tokens, seed, eos):
        before = torch.get_num_threads()
        if self.threads:
            torch.set_num_threads(self.threads)
        try:
            return self.decoder.generate(ids, max_new_tokens, torch.Generator().manual_seed(seed), eos_token_id=eos)
        finally:
            torch.set_num_threads(before)


def build_methods(draft, target, ks, gammas, svip_gamma, svip_threshold, sampling=SAMPLING,
                  ks_2threads=()) -> list[Method]:
    methods = [Method("target_only t1", SpeculativeDecoder(draft, target, TargetOnly(), sampling), 1),
               Method("target_only t2", SpeculativeDecoder(draft, target, TargetOnly(), sampling), 2)]
    methods += [Method(f"fixed_k k{k}", SpeculativeDecoder(draft, target, FixedK(k), sampling), 1) for k in ks]
    methods += [Method(f"fixed_k k{k} t2", SpeculativeDecoder(draft, target, FixedK(k), sampling), 2)
                for k in ks_2threads]
    for g in gammas:
        methods.append(Method(f"pearl g{g}", PEARLDecoder(draft, target, g if g == "auto" else int(g), sampling), None))
    if svip_gamma:
        stop = SVIP(svip_threshold, max_candidates=40)
        methods.append(Method(f"pearl g{svip_gamma}+svip h{svip_threshold:g}",
                              PEARLDecoder(draft, target, int(svip_gamma), sampling, policy=stop), None))
    return methods


def _forward_loop(model, context: torch.Tensor, width: int, steps: int, out: list | None = None,
                  stop: threading.Event | None = None) -> list[float]:
    """Seconds of cached forwards over ``width`` tokens after ``context`` (cropped again each time);
    with ``stop`` it loops until the event is set."""
    from specdecpp.core.compat import cache_kwargs
    from specdecpp.core.hooks import crop_to, keep_last, new_cache
    from specdecpp.core.timing import time_forward

    cache, times = new_cache(model), out if out is not None else []
    keep = keep_last(width, 1, context.device)
    with torch.no_grad():
        model(context, use_cache=True, **cache_kwargs(model, cache))
        length = cache.get_seq_length() - width
        crop_to(cache, length)
        timing = time_forward(lambda: model(context[:, -width:], use_cache=True, **cache_kwargs(model, cache),
                                            logits_to_keep=keep),
                              reset=lambda: crop_to(cache, length), repeats=steps, warmup=0,
                              **({"until": stop.is_set} if stop is not None else {}))
    times.extend(timing.times)
    return times


def _median_ms(times) -> float:
    return 1e3 * sorted(times)[len(times) // 2]


def _draft_process(draft_dir, dtype, context, ready, stop, result) -> None:
    from specdecpp.models.loading import load_model

    torch.set_num_threads(1)
    model = load_model(draft_dir, "cpu", dtype)
    _forward_loop(model, context, 1, 5)
    ready.set()
    times = _forward_loop(model, context, 1, 0, stop=stop)
    result.put((_median_ms(times), len(times)))


def measure_overlap(draft, target, draft_dir: str, context: torch.Tensor, steps: int = 20) -> dict:
    """How much the two models slow each other when they run at once, 1 intra-op thread each:
    the median target forward (1 and 4 tokens) and draft forward alone, then with a draft loop
    beside the target in a thread (GIL switch interval 5 ms and 0.1 ms) and in a subprocess."""
    torch.set_num_threads(1)
    res = {"draft_alone_ms": _median_ms(_forward_loop(draft, context, 1, 3 * steps))}
    for width in (1, 4):
        res[f"target{width}_alone_ms"] = _median_ms(_forward_loop(target, context, width, steps))
    if context.device.type != "cpu":  # the timer synchronises the whole device: only the forwards alone
        return res
    if os.cpu_count() and os.cpu_count() >= 2:  # two threads for the target alone
        torch.set_num_threads(2)
        res["target1_alone_2threads_ms"] = _median_ms(_forward_loop(target, context, 1, steps))
        torch.set_num_threads(1)
    interval = sys.getswitchinterval()
    for label, si in (("thread_switch5ms", 0.005), ("thread_switch0.1ms", 1e-4)):
        sys.setswitchinterval(si)
        for width in (1, 4):
            stop, draft_times = threading.Event(), []
            worker = threading.Thread(target=_forward_loop, args=(draft, context, 1, 0, draft_times, stop))
            worker.start()
            res[f"{label}_target{width}_ms"] = _median_ms(_forward_loop(target, context, width, steps))
            stop.set()
            worker.join()
            res[f"{label}_draft_ms_beside_target{width}"] = _median_ms(draft_times)
    sys.setswitchinterval(interval)
    ctx = multiprocessing.get_context("spawn")
    ready, stop, result = ctx.Event(), ctx.Event(), ctx.Queue()
    proc = ctx.Process(target=_draft_process, args=(draft_dir, draft.dtype, context, ready, stop, result))
    proc.start()
    ready.wait(120)
    for width in (1, 4):
        res[f"subprocess_target{width}_ms"] = _median_ms(_forward_loop(target, context, width, steps))
    stop.set()
    res["subprocess_draft_ms"] = result.get(timeout=60)[0]
    proc.join()
    return res


def pooled(rows) -> float:
    return sum(r["n_generated"] for r in rows) / sum(r["wall_time_s"] for r in rows)


def ceiling(rows, overlap: dict) -> float | None:
    """PEARL's speedup over target-only at 1 thread if every round cost only the target's forward
    alone (pre-verify: one token; post-verify: four, the padded width of gamma <= 4) and every
    target-only token one forward alone: what perfect concurrency would give with these counts."""
    if not overlap or max(r["gamma"] for r in rows) > 4:  # wider post-verify rounds: not measured
        return None
    n = sum(r["n_generated"] for r in rows)
    t1, t4 = overlap["target1_alone_ms"], overlap["target4_alone_ms"]
    rounds = sum(r["n_pre_verify_rounds"] * t1 + r["n_post_verify_rounds"] * t4 for r in rows)
    return n * t1 / rounds


def table(methods: list[Method], n_prompts: int, overlap: dict | None = None) -> tuple[str, dict]:
    base1 = next(m for m in methods if m.name == "target_only t1")
    best_base = max((m for m in methods if m.name.startswith("target_only")), key=lambda m: pooled(m.rows))
    lines = [f"| method | tokens/s | speedup vs target-only t1 [95% CI] | speedup vs {best_base.name} (best) [95% CI] "
             "| mean accepted/round | acceptance | gamma | both busy | pre/post rounds | tokens/target call "
             "| perfect-overlap ceiling |", "|---|---|---|---|---|---|---|---|---|---|---|"]
    summary = {}
    for m in methods:
        tps = pooled(m.rows)
        entry = {"tokens_per_s": tps, "n_prompts": len(m.rows)}
        cells = []
        for key, base in (("vs_t1", base1), ("vs_best", best_base)):
            s = tps / pooled(base.rows)
            ci = paired_speedup_ci(m.rows, base.rows)
            entry[key] = {"speedup": s, "ci95": ci}
            cells.append(f"{s:.2f}x [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else f"{s:.2f}x")
        rounds = [a for r in m.rows for a in r["accept_lengths"]]
        accepted = sum(rounds) / len(rounds) if rounds and not m.name.startswith("target_only") else None
        pearl = "overlap_time_s" in m.rows[0]
        if pearl:
            wall = sum(r["wall_time_s"] for r in m.rows)
            entry.update(gamma=sorted({r["gamma"] for r in m.rows}),
                         both_busy=sum(r["overlap_time_s"] for r in m.rows) / wall,
                         draft_busy=sum(r["draft_time_s"] for r in m.rows) / wall,
                         target_busy=sum(r["target_time_s"] for r in m.rows) / wall,
                         pre_rounds=sum(r["n_pre_verify_rounds"] for r in m.rows),
                         post_rounds=sum(r["n_post_verify_rounds"] for r in m.rows))
        tested = sum(sum(r["candidate_lengths"]) for r in m.rows)
        entry["mean_accepted"] = accepted
        entry["acceptance"] = sum(sum(r["accept_lengths"]) for r in m.rows) / tested if tested else None
        entry["tokens_per_target_call"] = (sum(r["n_generated"] for r in m.rows)
                                           / sum(r["n_target_calls"] for r in m.rows))
        entry["ceiling"] = ceiling(m.rows, overlap) if pearl else None
        summary[m.name] = entry
        lines.append("| " + " | ".join([
            m.name, f"{tps:.2f}", *cells, "-" if accepted is None else f"{accepted:.2f}",
            "-" if entry["acceptance"] is None else f"{entry['acceptance']:.2f}",
            ",".join(map(str, entry["gamma"])) if pearl else "-",
            f"{100 * entry['both_busy']:.0f}% (draft {100 * entry['draft_busy']:.0f}%, "
            f"target {100 * entry['target_busy']:.0f}%)"
            if pearl else "-",
            f"{entry['pre_rounds']}/{entry['post_rounds']}" if pearl else "-",
            f"{entry['tokens_per_target_call']:.2f}",
            "-" if entry["ceiling"] is None else f"{entry['ceiling']:.2f}x"]) + " |")
    return "\n".join(lines), summary


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--draft"), parser.add_argument("--target")
    parser.add_argument("--prompts", type=int, default=4, help="per prompt set (bundled test, HumanEval)")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--ks", type=int, nargs="+", default=[1, 2, 3], help="sequential fixed K")
    parser.add_argument("--ks-2threads", type=int, nargs="*", default=[],
                        help="sequential fixed K also with 2 torch threads (the target's best count in bf16)")
    parser.add_argument("--gammas", nargs="+", default=["auto", "3", "4"], help="PEARL block lengths (auto: Theorem 1)")
    parser.add_argument("--svip-gamma", default=None, help="also PEARL at this gamma with SVIP ending blocks early")
    parser.add_argument("--svip-threshold", type=float, default=0.5)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--temperature", type=float, default=1.0, help="0: greedy (top-k 50 otherwise)")
    parser.add_argument("--overlap", action="store_true",
                        help="first measure how much draft and target slow each other when run at once")
    parser.add_argument("--device", default="auto", help="auto (CUDA where present) | cpu | cuda | cuda:N")
    parser.add_argument("--dtype", default="fast", help="precision of both models (default fast, as the demo pair: "
                        "bf16 on CPUs with native bf16, else float32) | auto | float32 | bfloat16")
    parser.add_argument("--out", help="write the rows and the summary as JSON here")
    parser.add_argument("--from-json", help="print the table of a run saved with --out (decodes nothing)")
    args = parser.parse_args(argv)

    if args.from_json:
        saved = json.loads(Path(args.from_json).read_text())
        methods = [Method(name, None, None) for name in saved["rows"]]
        for m in methods:
            m.rows = saved["rows"][m.name]
        print(saved["machine"], "\n")
        print(table(methods, 0, saved.get("overlap"))[0])
        return
    if not (args.draft and args.target):
        args.target = args.target or str(demo_target_path())
        args.draft = args.draft or str(demo_draft_path())
    torch.set_num_threads(1)
    draft, target, tok = load_pair(args.draft, args.target, args.device, args.dtype)
    eos = sorted(eos_token_ids(tok, target))
    prompts = [(f"bundled/{p.id}", p) for p in load_prompts("bundled", split="test", limit=args.prompts)]
    prompts += [(f"humaneval/{p.id}", p) for p in load_prompts("humaneval", split="test", limit=args.prompts)]
    sampling = SamplingConfig(temperature=args.temperature, top_k=50)
    methods = build_methods(draft, target, args.ks, args.gammas, args.svip_gamma, args.svip_threshold, sampling,
                            args.ks_2threads)
    warm = torch.tensor([encode_prompt(tok, prompts[0][1].prompt)], device=target.device)
    overlap = None
    if args.overlap:
        overlap = measure_overlap(draft, target, args.draft, warm)
        print("forward times, ms (1 intra-op thread each unless named):")
        print("\n".join(f"  {k}: {v:.2f}" for k, v in overlap.items()), flush=True)
    load_before = os.getloadavg()
    for m in methods:  # untimed warm-up (and Theorem 1's measurement for gamma=auto)
        m.run(warm, 8, 0, eos)
    t_start = time.time()
    for i, (pid, p) in enumerate(prompts):
        ids = torch.tensor([encode_prompt(tok, p.prompt)], device=target.device)
        for m in methods:
            out = m.run(ids, args.max_new_tokens, prompt_seed(args.seed, pid), eos)
            row = {"prompt_id": pid, "timed": True, **out.stats.to_dict()}
            m.rows.append(row)
        print(f"[{i + 1}/{len(prompts)}] {pid}: " + ", ".join(
            f"{m.name} {m.rows[-1]['n_generated'] / m.rows[-1]['wall_time_s']:.1f}" for m in methods), flush=True)
    load_after = os.getloadavg()
    text, summary = table(methods, len(prompts), overlap)
    auto = next((m.decoder for m in methods
                 if isinstance(m.decoder, PEARLDecoder) and m.decoder.gamma_setting == "auto"), None)
    machine = (f"{machine_description(target.device)}, {dtype_name(target.dtype)}; "
               f"load average (1/5/15 min) before {load_before}, after {load_after}; "
               f"{(time.time() - t_start) / 60:.1f} min")
    print(f"\n{len(prompts)} prompts ({args.prompts} bundled test + {args.prompts} HumanEval), "
          f"{args.max_new_tokens} new tokens, {'greedy' if sampling.greedy else f'T={args.temperature:g}, top-k 50'}, "
          "interleaved per prompt")
    if auto is not None:
        c = auto.costs
        print(f"Theorem 1: t_draft {1e3 * c['t_draft_s']:.2f} ms, t_target {1e3 * c['t_target_s']:.2f} ms "
              f"-> gamma {auto.gamma}")
    print(machine + "\n")
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(json.dumps({
            "settings": vars(args), "machine": machine, "theorem1": auto.costs if auto else None, "overlap": overlap,
            "summary": summary, "rows": {m.name: m.rows for m in methods}}, indent=1) + "\n")


if __name__ == "__main__":
    main()
