"""Where a round's time goes, per stop policy, on any device: the engine's rounds with policies that
do the same work but synchronise differently (docs/gpu.md, "Fixed K on CUDA").

    mkdir cfg && cp DRAFT/config.json cfg/draft.json && cp TARGET/config.json cfg/target.json
    python scripts/profile_rounds.py --device cuda --configs cfg                 # random weights
    python scripts/profile_rounds.py --device cuda --draft PATH --target PATH    # a real pair
    python scripts/profile_rounds.py --device cuda --configs cfg --phases --sync-debug --trace
    SPECDECPP_SDPA=default python scripts/profile_rounds.py ...   # PyTorch's own attention kernels

Each method decodes ``--new`` tokens from one prompt, ``--repeats`` times, interleaved with the
others (so a drift in the machine hits every method alike); the table gives the median wall time
per round and per token. With random weights every round is one token under greedy decoding, which
is what the comparison wants: the same forwards per round for every K-1 method. ``--phases``: the
host time per round inside each engine call (the forwards, warp, the draft's draw, verify, commit), with no
sync added, so a wait shows where the host waits. ``--sync-debug`` (CUDA): torch.cuda's sync debug
mode counts each implicit synchronisation by its engine line. ``--trace``: torch.profiler over one
decode per method, its busiest host ops and its device time (``--chrome DIR``: and a Chrome trace).

Variants, all with the same forwards per round:
- ``fixed_kK``: FixedK(K) as shipped (``reads_values=False``).
- ``fixed_kK_values``: FixedK(K) declaring ``reads_values=True``. With an EOS the drafter would
  then check every candidate on the host; this script gives none, so it runs the very same code as
  ``fixed_kK``: two methods that must take the same time.
- ``svip_kK``: SVIP with ``max_candidates=K`` and c = 1e-9 and threshold 1, so it drafts K (and
  reads the entropy on the host: one sync per candidate).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from pathlib import Path

import torch

from specdecpp import SVIP, FixedK, SamplingConfig, SpeculativeDecoder, TargetOnly
from specdecpp.core.attention import SDPA_CHOICES, SDPA_ENV


class ValuesFixedK(FixedK):
    """FixedK that says it reads values: the drafter then checks EOS per candidate (a host sync)."""

    name = "fixed_k_values"
    reads_values = True


def random_model(config_path: Path, device, dtype, seed: int):
    from transformers import AutoConfig, AutoModelForCausalLM

    torch.manual_seed(seed)
    cfg = AutoConfig.from_pretrained(config_path)
    return AutoModelForCausalLM.from_config(cfg).to(device=device, dtype=dtype).eval().requires_grad_(False)


def load(args, device, dtype):
    if args.configs:
        d = Path(args.configs)
        return random_model(d / "draft.json", device, dtype, 0), random_model(d / "target.json", device, dtype, 1)
    from transformers import AutoModelForCausalLM

    return tuple(AutoModelForCausalLM.from_pretrained(p, dtype=dtype).to(device).eval().requires_grad_(False)
                 for p in (args.draft, args.target))


def methods(ks):
    out = {"target_only": TargetOnly()}
    for k in ks:
        out[f"fixed_k{k}"] = FixedK(k)
        out[f"fixed_k{k}_values"] = ValuesFixedK(k)
        out[f"svip_k{k}"] = SVIP(threshold=1.0, c=1e-9, max_candidates=k)
    return out


def decode(dec, prompt, new, seed, device):
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    out = dec.generate(prompt, max_new_tokens=new, generator=torch.Generator().manual_seed(seed))
    if device.type == "cuda":
        torch.cuda.synchronize()
    return time.perf_counter() - t0, out.stats


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float32", "float16"])
    ap.add_argument("--configs", help="folder with draft.json and target.json (random weights)")
    ap.add_argument("--draft")
    ap.add_argument("--target")
    ap.add_argument("--ks", default="1,3", help="candidate lengths to compare")
    ap.add_argument("--temperature", type=float, default=1.0, help="0 = greedy")
    ap.add_argument("--prompt-len", type=int, default=64)
    ap.add_argument("--new", type=int, default=48)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--trace", action="store_true", help="profile one decode per method: busiest ops")
    ap.add_argument("--chrome", help="with --trace: write a Chrome trace per method to this folder")
    ap.add_argument("--phases", action="store_true",
                    help="host time per round in each engine call (no sync added): where the host waits")
    ap.add_argument("--sync-debug", action="store_true",
                    help="CUDA: list the operations that synchronise implicitly, per method")
    ap.add_argument("--json", help="write the table as JSON here")
    args = ap.parse_args()
    if not args.configs and not (args.draft and args.target):
        ap.error("give --configs DIR (random weights) or --draft and --target")
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    draft, target = load(args, device, dtype)
    sampling = SamplingConfig(temperature=args.temperature)
    vocab = min(draft.config.vocab_size, target.config.vocab_size)
    prompt = torch.randint(3, vocab, (1, args.prompt_len), generator=torch.Generator().manual_seed(0)).to(device)
    decs = {name: SpeculativeDecoder(draft, target, pol, sampling) for name, pol in
            methods([int(k) for k in args.ks.split(",")]).items()}
    name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    print(f"device {name}, {args.dtype}, T={args.temperature}, prompt {args.prompt_len}, new {args.new}, "
          f"torch {torch.__version__}, {SDPA_ENV}={os.environ.get(SDPA_ENV, SDPA_CHOICES[0])}")

    for dec in decs.values():  # warm-up: every shape once
        decode(dec, prompt, args.new, 0, device)
    per_round = {n: [] for n in decs}
    per_token = {n: [] for n in decs}
    rounds = {}
    for r in range(args.repeats):
        for n, dec in decs.items():
            wall, s = decode(dec, prompt, args.new, r, device)
            per_round[n].append(wall / s.n_target_calls)
            per_token[n].append(wall / s.n_generated)
            rounds[n] = (s.n_target_calls, s.n_generated, sum(s.candidate_lengths))
    rows = []
    print(f"{'method':<20}{'ms/round':>10}{'ms/token':>10}{'rounds':>8}{'tokens':>8}{'drafted':>9}")
    for n in decs:
        row = {"method": n, "ms_per_round": 1e3 * statistics.median(per_round[n]),
               "ms_per_token": 1e3 * statistics.median(per_token[n]), "rounds": rounds[n][0],
               "tokens": rounds[n][1], "drafted": rounds[n][2]}
        rows.append(row)
        print(f"{n:<20}{row['ms_per_round']:>10.2f}{row['ms_per_token']:>10.2f}{row['rounds']:>8}{row['tokens']:>8}"
              f"{row['drafted']:>9}")
    if args.json:
        Path(args.json).write_text(json.dumps({"device": name, "args": vars(args), "rows": rows}, indent=1))
    if args.phases:
        phases(decs, prompt, args, device)
    if args.sync_debug and device.type == "cuda":
        sync_sites(decs, prompt, args, device)
    if args.trace:
        trace(decs, prompt, args, device)


def phases(decs, prompt, args, device) -> None:
    """Host time spent inside each engine call, per round (medians over ``--repeats`` decodes)."""
    from specdecpp.decoders import rounds

    spent: dict[str, float] = {}

    def timed(label, fn):
        def run(*a, **kw):
            t0 = time.perf_counter()
            try:
                return fn(*a, **kw)
            finally:
                spent[label(a)] = spent.get(label(a), 0.0) + time.perf_counter() - t0
        return run

    draft = next(iter(decs.values())).draft
    labels = {"warp": "warp", "warp_kept": "warp", "sample": "draw", "verify": "verify", "verify_rows": "verify",
              "verify_kept": "verify"}
    saved = {n: getattr(rounds, n) for n in labels}
    feed, commit = rounds.ModelRunner.feed, rounds.TokenBuffer.commit
    for n, label in labels.items():
        setattr(rounds, n, timed(lambda a, label=label: label, saved[n]))
    rounds.ModelRunner.feed = timed(lambda a: "draft_feed" if a[0].model is draft else "target_feed", feed)
    rounds.TokenBuffer.commit = timed(lambda a: "commit", commit)
    try:
        table = {}
        for n, dec in decs.items():
            runs = []
            for r in range(args.repeats):
                spent.clear()
                wall, s = decode(dec, prompt, args.new, r, device)
                runs.append({k: 1e3 * v / s.n_target_calls for k, v in {**spent, "wall": wall}.items()})
            table[n] = {k: statistics.median(x.get(k, 0.0) for x in runs) for k in runs[0]}
    finally:
        for n, fn in saved.items():
            setattr(rounds, n, fn)
        rounds.ModelRunner.feed, rounds.TokenBuffer.commit = feed, commit
    cols = ["wall", "draft_feed", "warp", "draw", "target_feed", "verify", "commit"]
    print("\nhost ms per round inside each call (no added sync; warp: every row warped, the drafter's and (on a "
          "CPU) those verify warps itself, also counted under verify; draw: the drafter's draw from a dense row)")
    print(f"{'method':<20}" + "".join(f"{c:>12}" for c in cols))
    for n, row in table.items():
        print(f"{n:<20}" + "".join(f"{row.get(c, 0.0):>12.2f}" for c in cols))


def sync_sites(decs, prompt, args, device) -> None:
    """torch.cuda's sync debug mode: each implicit synchronisation, counted by the engine line."""
    import traceback
    import warnings

    for n, dec in decs.items():
        sites: dict[str, int] = {}

        def note(message, category, filename, lineno, file=None, line=None, sites=sites):
            frames = [f for f in traceback.extract_stack()
                      if "/specdecpp/" in f.filename or "/transformers/" in f.filename]
            key = (" <- ".join(f"{Path(f.filename).name}:{f.lineno}" for f in frames[-2:][::-1])
                   or f"{filename}:{lineno}")
            sites[key] = sites.get(key, 0) + 1

        with warnings.catch_warnings():
            warnings.simplefilter("always")
            warnings.showwarning = note
            torch.cuda.set_sync_debug_mode("warn")
            try:
                _, s = decode(dec, prompt, args.new, 0, device)
            finally:
                torch.cuda.set_sync_debug_mode("default")
        print(f"\n== {n}: implicit syncs per round ({s.n_target_calls} rounds)")
        for key, c in sorted(sites.items(), key=lambda kv: -kv[1]):
            print(f"  {c / s.n_target_calls:6.2f}  {key}")


def trace(decs, prompt, args, device) -> None:
    from torch.profiler import ProfilerActivity, profile

    cuda = device.type == "cuda"
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if cuda else [])
    for n, dec in decs.items():
        with profile(activities=acts) as prof:
            wall, s = decode(dec, prompt, args.new, 0, device)
        avg = prof.key_averages()
        dev_us = sum(e.self_device_time_total for e in avg) if cuda else 0.0
        print(f"\n== {n}: wall {1e3 * wall:.1f} ms, {s.n_target_calls} rounds, device busy {dev_us / 1e3:.1f} ms")
        print(avg.table(sort_by="self_cpu_time_total", row_limit=14, max_name_column_width=40))
        if cuda:
            print(avg.table(sort_by="self_device_time_total", row_limit=6, max_name_column_width=40))
        if args.chrome:
            Path(args.chrome).mkdir(parents=True, exist_ok=True)
            prof.export_chrome_trace(str(Path(args.chrome) / f"{n}.json"))


if __name__ == "__main__":
    main()
