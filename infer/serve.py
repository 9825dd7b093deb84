"""python -m infer.serve: the serving benchmark in vLLM (docs/vllm.md, "Serving benchmark"), run in vLLM's
environment (make vllm-env).

    python -m infer.serve --pair demo --concurrency 1 4 16 64 --repeats 5 --out reports/serve \\
        --methods target_only fixed_k1 fixed_k2 fixed_k3 fixed_k4 ngram svip svip+load_aware \\
                  head:demo/heads/next_wrej1_d1 head:demo/heads/next_wrej1_d1+load_aware

What it measures: for each method, output tokens per second of ``c`` concurrent requests from the
held-out (test) prompts, and each request's time per output token, at every concurrency ``c`` and
temperature (0, and 1 with top-k 50), over ``--repeats`` repeats. Methods (``serve_report.METHOD_HELP``):
target-only (no speculative config), vLLM's own fixed K (``draft_model``, or ``eagle3`` for a feature
draft, ``{"method": ..., "num_speculative_tokens": K}``), vLLM's n-gram lookup, and the library's stop
policies through ``specdecpp.vllm.speculative_config`` (SVIP, vLLM's online estimator as a stop rule,
a head), each with or without load-aware lengths (``+load_aware``: step costs measured at start-up).
Every draft method samples its drafts the same way (``--draft-sample-method``, default ``probabilistic``,
the library's default; vLLM's own default is ``greedy``).

How: one engine per method (vLLM fixes the speculative config when the engine is built), all built
first and held at once (in this process: ``VLLM_ENABLE_V1_MULTIPROCESSING=0``). Holding several works on
a CPU; each engine of the demo pair (135M target, float32) takes about 1 GB plus its KV cache
(``--kv-cache-gib``), measured on the first engine (its KV cache counted whole): if the rest would leave less than 2 GiB
of the machine's available memory the run stops before starting them and says so. ``--one-engine-at-a-time``
then builds each method's engine once per repeat, runs all of that repeat's blocks on it and closes it
(the methods alternate between repeats only, each repeat's order rotated). A *block* is one (repeat,
temperature, concurrency ``c``): the block's ``c`` prompts are sent to each method in turn, the order
of the methods rotated from repeat to repeat (``serve_report.block_order``), so a load change on a
shared machine touches every method alike. A method runs a block as one ``llm.generate`` call of the
``c`` prompts: vLLM's scheduler takes all ``c`` requests into its running batch at once (``max_num_seqs``
is the largest concurrency, the KV cache holds them all), which is ``c`` clients that each send a request
at the same moment and wait for it; the async engine would add arrival times (an open-loop load), not
more concurrency, and on a small CPU its event loop competes with the engine for the cores. Per request
vLLM's own timestamps (``RequestOutput.metrics``) give the time per output token, (last token - first
token) / (tokens - 1), and the request's latency; per block, output tokens / the call's wall time.
Before measuring, each engine runs one untimed warm-up call per temperature.

Exactness: at temperature 0 every method's tokens are compared, request by request, with target-only's
in the same block; a method that differs gets no figures in the tables (``serve_report.table``) and the
command exits with status 1 after writing everything.

Everything is checked before the first engine starts: the method names, the concurrency levels, the
pair, the prompts and each of the library's speculative configs (a head for another draft, a head with
a feature draft, ...). Writes ``--out``/serve.json (every block and request, the summary, the settings,
the machine and the command), serve.md (one table per temperature and concurrency) and serve.png.
"""

from __future__ import annotations

import argparse
import datetime
import gc
import json
import os
import shlex
import sys
import time
from pathlib import Path

from .pairs import command_pair
from .serve_report import (
    Method,
    block_order,
    block_prompts,
    check_concurrency,
    greedy_mismatches,
    parse_methods,
    plot,
    report,
    summarize,
)

# vLLM in this process on a shared CPU (the tests' settings, docs/vllm.md "Running vLLM on this kind of machine")
VLLM_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "nobind", "VLLM_ENABLE_V1_MULTIPROCESSING": "0"}
NGRAM_LOOKUP = (2, 4)  # vLLM's prompt_lookup_min / prompt_lookup_max for ngram


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m infer.serve", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--pair", default="demo", help="a conf/pair/ config naming the draft and target (demo, "
                   "demo_feature; default demo); --draft and --target win over it")
    p.add_argument("--draft", help="draft model directory (a plain draft, or a feature draft: vLLM's eagle3)")
    p.add_argument("--target", help="target model directory")
    p.add_argument("--prompts", default="bundled", choices=["bundled", "humaneval"],
                   help="held-out prompts: the source's test split (default bundled)")
    p.add_argument("--concurrency", type=int, nargs="*", default=[1, 4, 16, 64], metavar="C",
                   help="concurrent requests per block (default 1 4 16 64)")
    p.add_argument("--methods", nargs="*", default=["target_only", "fixed_k1", "fixed_k2", "fixed_k3", "fixed_k4",
                                                    "ngram", "svip", "svip+load_aware"],
                   help="methods, each one engine (default: target_only fixed_k1..4 ngram svip svip+load_aware)")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--ignore-eos", action="store_true", help="always generate --max-new-tokens tokens")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--temperature", type=float, nargs="+", default=[0.0, 1.0],
                   help="temperatures (default 0 1); above 0 with --top-k")
    p.add_argument("--top-k", type=int, default=50)
    p.add_argument("--max-candidates", type=int, default=4,
                   help="K of ngram and the most candidates of svip, online and a head (default 4)")
    p.add_argument("--svip-threshold", type=float, default=0.3, help="svip's threshold without svip:T (default 0.3)")
    p.add_argument("--online-threshold", type=float, default=0.7,
                   help="online's threshold without online:T (default 0.7)")
    p.add_argument("--head-threshold", type=float, default=0.5,
                   help="a head's threshold without head:PATH@T (default 0.5)")
    p.add_argument("--draft-sample-method", default="probabilistic", choices=["probabilistic", "greedy"],
                   help="how every draft method samples its drafts (default probabilistic)")
    p.add_argument("--dtype", default="float32")
    p.add_argument("--kv-cache-gib", type=float, default=1.0,
                   help="each engine's KV cache (vLLM's kv_cache_memory_bytes; default 1; VLLM_CPU_KVCACHE_SPACE, "
                   "if set, wins on a CPU)")
    p.add_argument("--one-engine-at-a-time", action="store_true",
                   help="build each method's engine once per repeat instead of holding all (less memory; the "
                   "methods then alternate between repeats, not within a block)")
    p.add_argument("--max-model-len", type=int,
                   help="default: the longest prompt + --max-new-tokens + --max-candidates + 8")
    p.add_argument("--cache-dir", help="where the library's policy bundles go (default: specdecpp's cache)")
    p.add_argument("--out", type=Path, required=True, help="directory for serve.json, serve.md and serve.png")
    p.add_argument("--plot-name", default="serve.png", help="the plot's file name in --out (default serve.png)")
    return p


def check_numbers(args) -> None:
    """The numeric options: a ValueError naming the first that is out of range."""
    for name in ("max_new_tokens", "repeats", "max_candidates", "top_k"):
        value = getattr(args, name)
        if value < 1:
            raise ValueError(f"--{name.replace('_', '-')} must be >= 1, got {value}")
    if any(t < 0 for t in args.temperature) or len(set(args.temperature)) < len(args.temperature):
        raise ValueError(f"--temperature values must be distinct and >= 0, got {args.temperature}")
    if args.kv_cache_gib <= 0:
        raise ValueError(f"--kv-cache-gib must be > 0, got {args.kv_cache_gib}")


def library_spec(method: Method, draft: str, args) -> dict:
    """The speculative config of one of the library's policies (``specdecpp.vllm.speculative_config``:
    it checks the policy against the draft and writes the bundle; nothing of vLLM starts)."""
    from specdecpp import SVIP, FixedK
    from specdecpp.vllm import OnlineAcceptance, speculative_config

    common = {"cache_dir": args.cache_dir, "load_aware": method.load_aware,
              "draft_sample_method": args.draft_sample_method}
    k = args.max_candidates
    if method.kind == "head":
        threshold = args.head_threshold if method.threshold is None else method.threshold
        return speculative_config(draft, head=method.head, threshold=threshold, max_candidates=k, **common)
    if method.kind == "svip":
        policy = SVIP(args.svip_threshold if method.threshold is None else method.threshold, max_candidates=k)
    elif method.kind == "online":
        policy = OnlineAcceptance(args.online_threshold if method.threshold is None else method.threshold,
                                  max_candidates=k)
    else:  # fixed_kN+load_aware
        policy = FixedK(method.k)
    return speculative_config(draft, stop_policy=policy, **common)


def engine_spec(method: Method, draft: str, feature: bool, args) -> dict | None:
    """What ``vllm.LLM(speculative_config=...)`` gets for ``method`` (None: target-only)."""
    if method.kind == "target_only":
        return None
    if method.kind == "ngram":
        lo, hi = NGRAM_LOOKUP
        return {"method": "ngram", "num_speculative_tokens": method.k or args.max_candidates,
                "prompt_lookup_min": lo, "prompt_lookup_max": hi}
    if method.kind == "fixed_k" and not method.load_aware:
        return {"method": "eagle3" if feature else "draft_model", "model": draft, "num_speculative_tokens": method.k,
                "draft_sample_method": args.draft_sample_method}
    return library_spec(method, draft, args)


def load_encoded_prompts(source: str, target: str) -> list[list[int]]:
    """The source's test prompts as token ids, the target tokenizer's chat template applied."""
    from transformers import AutoTokenizer

    from specdecpp.data.prompts import encode_prompt, load_prompts

    tokenizer = AutoTokenizer.from_pretrained(target)
    return [encode_prompt(tokenizer, p.prompt) for p in load_prompts(source, split="test")]


def plan(args) -> dict:
    """Every check before an engine starts; what the run needs (methods, their speculative configs,
    prompts, engine settings). A ValueError (or ImportError: no supported vLLM) says what is wrong."""
    from specdecpp.models.feature_draft import is_feature_draft

    methods = parse_methods(args.methods)
    levels = check_concurrency(args.concurrency)
    check_numbers(args)
    pair = command_pair(args.pair, args.draft, args.target)
    draft, target = pair["draft"], pair["target"]
    for which, path in (("draft", draft), ("target", target)):
        if not (Path(path) / "config.json").is_file():
            raise ValueError(f"{which} {path!r} is not a local model directory (no config.json)")
    draft = str(Path(draft).resolve())
    feature = is_feature_draft(draft)
    if args.one_engine_at_a_time and any(m.kind == "ngram" for m in methods) and args.repeats > 1:
        raise ValueError("--one-engine-at-a-time rebuilds the engines every repeat, and vLLM 0.32 on a CPU starts no "
                         "engine after an n-gram one in the same process (infer.serve.build_order): drop ngram or "
                         "hold the engines at once")
    specs = {}
    for m in methods:
        try:
            specs[m.name] = engine_spec(m, draft, feature, args)
        except (ValueError, TypeError, OSError) as exc:
            raise ValueError(f"method {m.name!r}: {exc}") from None
    prompts = load_encoded_prompts(args.prompts, target)
    max_len = args.max_model_len or max(map(len, prompts)) + args.max_new_tokens + args.max_candidates + 8
    engine = {"dtype": args.dtype, "max_model_len": max_len, "max_num_seqs": max(levels), "enforce_eager": True,
              "seed": 0, "disable_log_stats": False, "kv_cache_memory_bytes": int(args.kv_cache_gib * (1 << 30))}
    return {"methods": methods, "levels": levels, "draft": draft, "target": target, "feature": feature,
            "specs": specs, "prompts": prompts, "engine": engine}


def start_engine(target: str, spec: dict | None, engine: dict):
    from vllm import LLM

    extra = {"per_request_spec_decode_metrics": "summary"} if spec is not None else {}
    return LLM(model=target, speculative_config=spec, **engine, **extra)


def close_engine(llm) -> None:
    llm.llm_engine.engine_core.shutdown()
    del llm
    gc.collect()


def sampling(temperature: float, args, max_tokens: int | None = None):
    from vllm import SamplingParams

    extra = {"top_k": args.top_k} if temperature > 0 else {}
    return SamplingParams(temperature=temperature, max_tokens=max_tokens or args.max_new_tokens,
                          ignore_eos=args.ignore_eos, **extra)


def run_block(llm, prompts: list[list[int]], params) -> tuple[dict, list[list[int]]]:
    """One method's block: the prompts sent at once; its record and each request's output tokens."""
    inputs = [{"prompt_token_ids": ids} for ids in prompts]
    began = time.perf_counter()
    outputs = llm.generate(inputs, params, use_tqdm=False)
    wall = time.perf_counter() - began
    requests, tokens, spec = [], [], {"num_drafts": 0, "num_draft_tokens": 0, "num_accepted_tokens": 0}
    for out in outputs:
        ids = list(out.outputs[0].token_ids)
        m = out.metrics
        if m is None:
            raise RuntimeError("vLLM returned no request metrics: the engine needs disable_log_stats=False")
        n = len(ids)
        requests.append({"output_tokens": n, "latency_s": m.last_token_ts - m.queued_ts,
                         "ttft_s": m.first_token_ts - m.queued_ts,
                         "tpot_s": (m.last_token_ts - m.first_token_ts) / (n - 1) if n > 1 else None})
        sd = out.outputs[0].spec_decode_metrics
        if sd is not None:
            spec["num_drafts"] += sum(sd.histogram)
            spec["num_draft_tokens"] += sd.num_draft_tokens
            spec["num_accepted_tokens"] += sum(j * c for j, c in enumerate(sd.histogram))
        tokens.append(ids)
    total = sum(r["output_tokens"] for r in requests)
    return {"wall_s": wall, "output_tokens": total, "tokens_per_s": total / wall, "requests": requests,
            "spec": spec}, tokens


def mem_available() -> int | None:
    """MemAvailable of /proc/meminfo in bytes (None where there is none)."""
    try:
        with open("/proc/meminfo") as f:
            line = next(line for line in f if line.startswith("MemAvailable:"))
    except (OSError, StopIteration):
        return None
    return int(line.split()[1]) * 1024


def check_memory(first_cost: int | None, remaining: int, available: int | None, margin: int = 2 << 30) -> None:
    """Refuse to start ``remaining`` more engines when, at the first one's cost, they would leave less
    than ``margin`` of the machine's available memory (a shared machine's other jobs need it)."""
    if first_cost is None or available is None or remaining <= 0:
        return
    need = first_cost * remaining + margin
    if need > available:
        gib = 1 << 30
        raise MemoryError(f"holding {remaining} more engines needs about {need / gib:.1f} GiB (the first took "
                          f"{first_cost / gib:.1f} GiB), {available / gib:.1f} GiB available: pass "
                          "--one-engine-at-a-time, fewer methods or a smaller --kv-cache-gib")


def build_order(methods: list[Method]) -> list[str]:
    """The order engines are built in: n-gram engines last. vLLM 0.32's CPU platform rebinds its Triton
    stand-ins at every engine's start by scanning every module (``triton_utils.dispatcher._rebind_kernels``),
    and the scan raises once the n-gram proposer has imported numba (``vars()`` of llvmlite's ``ffi.lib``
    is not a dict): no engine can start in a process after an n-gram one."""
    return [m.name for m in methods if m.kind != "ngram"] + [m.name for m in methods if m.kind == "ngram"]


def warm_up(llm, args, prompts) -> None:
    """One untimed call per temperature (first-call costs: the n-gram matcher's compile, allocations)."""
    for t in args.temperature:
        llm.generate([{"prompt_token_ids": ids} for ids in prompts[:2]], sampling(t, args, 8), use_tqdm=False)


def measure(args, run: dict, log=print, done: dict | None = None, checkpoint=None) -> dict:
    """Run every block, the methods interleaved (module docstring); the raw blocks and the greedy
    mismatches. All engines are built and warmed first and held at once, or with
    ``--one-engine-at-a-time`` each method's engine is built for one repeat, runs every (temperature,
    concurrency) block of it and is closed, the methods in the repeat's rotated order.

    ``done``: what an interrupted run of the same settings measured (:func:`load_done`): its complete
    repeats are kept and the run goes on from the next. ``checkpoint(measured)`` is called after each
    repeat with everything so far (a repeat cut short is measured again on resuming, never twice)."""
    names = [m.name for m in run["methods"]]
    cells = [(t, c) for t in args.temperature for c in run["levels"]]
    done = done or {"blocks": [], "mismatches": {}, "repeats_done": 0}
    blocks, mismatches, engines = list(done["blocks"]), dict(done["mismatches"]), {}
    first = done["repeats_done"]
    if first >= args.repeats:
        return {"blocks": blocks, "mismatches": mismatches, "repeats_done": first}
    if first:
        log(f"resuming after {first} complete repeat(s) of {args.repeats} ({len(blocks)} blocks kept)")

    def finished(repeat):
        if checkpoint is not None:
            checkpoint({"blocks": blocks, "mismatches": mismatches, "repeats_done": repeat + 1})

    def build(name):
        began = time.perf_counter()
        llm = start_engine(run["target"], run["specs"][name], run["engine"])
        warm_up(llm, args, run["prompts"])
        log(f"engine {name}: {time.perf_counter() - began:.1f} s")
        return llm

    def one(llm, name, repeat, position, temperature, c, outputs):
        ids = block_prompts(len(run["prompts"]), c, repeat)
        record, outputs.setdefault((temperature, c), {})[name] = run_block(
            llm, [run["prompts"][i] for i in ids], sampling(temperature, args))
        blocks.append({"temperature": temperature, "concurrency": c, "repeat": repeat, "method": name,
                       "position": position, "prompt_indices": ids, **record})
        log(f"repeat {repeat} T={temperature:g} c={c} {name}: {record['tokens_per_s']:.1f} tok/s")

    def check(repeat, outputs):
        for (temperature, c), by_method in outputs.items():
            if temperature != 0:
                continue
            for name, wrong in greedy_mismatches(by_method).items():
                mismatches.setdefault((temperature, c, name), []).extend((repeat, q) for q in wrong)
                log(f"WARNING {name} at c={c}, repeat {repeat}: greedy output differs from target-only's on "
                    f"{len(wrong)} of {c} requests")

    try:
        if args.one_engine_at_a_time:
            for repeat in range(first, args.repeats):
                outputs = {}
                for position, name in enumerate(block_order(names, repeat)):
                    llm = engines[name] = build(name)
                    for temperature, c in cells:
                        one(llm, name, repeat, position, temperature, c, outputs)
                    close_engine(engines.pop(name))
                check(repeat, outputs)
                finished(repeat)
        else:
            for i, name in enumerate(build_order(run["methods"])):
                before = mem_available()
                engines[name] = build(name)
                after = mem_available()
                if i == 0 and before is not None and after is not None:
                    # the KV cache is allocated but mostly untouched yet: count it whole
                    check_memory(max(before - after, 0) + run["engine"]["kv_cache_memory_bytes"], len(names) - 1,
                                 after)
            for repeat in range(first, args.repeats):
                outputs = {}
                order = block_order(names, repeat)
                for temperature, c in cells:
                    for position, name in enumerate(order):
                        one(engines[name], name, repeat, position, temperature, c, outputs)
                check(repeat, outputs)
                finished(repeat)
    finally:
        for llm in engines.values():
            close_engine(llm)
    return {"blocks": blocks, "mismatches": mismatches, "repeats_done": args.repeats}


def machine() -> str:
    from specdecpp.core.timing import machine_description

    threads = os.environ.get("OMP_NUM_THREADS")
    return machine_description("cpu") + (f"; OMP_NUM_THREADS={threads}" if threads else "")


def vllm_version() -> str:
    from specdecpp.vllm import check_version

    return check_version()


def settings(args, run: dict) -> dict:
    """What a run measures under (serve.json's ``settings``): a resumed run must have the same."""
    kv = os.environ.get("VLLM_CPU_KVCACHE_SPACE")
    engine = {**run["engine"], **({"VLLM_CPU_KVCACHE_SPACE": kv} if kv else {}),
              "engines": "one at a time, per repeat" if args.one_engine_at_a_time else "all held at once",
              "draft_sample_method": args.draft_sample_method, "ngram_lookup": list(NGRAM_LOOKUP)}
    return {"draft": run["draft"], "target": run["target"], "feature_draft": run["feature"],
            "prompts": args.prompts, "n_prompts": len(run["prompts"]), "max_new_tokens": args.max_new_tokens,
            "ignore_eos": args.ignore_eos, "repeats": args.repeats, "temperatures": args.temperature,
            "top_k": args.top_k, "concurrency": run["levels"], "methods": [m.name for m in run["methods"]],
            "speculative_configs": run["specs"], "engine": engine}


def load_done(args, run: dict) -> dict | None:
    """What an earlier, interrupted run under ``--out`` measured (its complete repeats), or None when there
    is none. A ValueError when ``--out``/serve.json holds another run's settings (nothing is overwritten)."""
    path = args.out / "serve.json"
    if not path.is_file():
        return None
    try:
        old = json.loads(path.read_text())
        old_settings, blocks = old["settings"], old["blocks"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"{path} is not a serve.json of python -m infer.serve ({exc}): pass another --out") from None
    new = json.loads(json.dumps(settings(args, run)))
    differ = sorted(k for k in set(old_settings) | set(new) if k != "repeats" and old_settings.get(k) != new.get(k))
    if differ:  # more --repeats than before: the run goes on from the repeats it has
        raise ValueError(f"{path} holds a run with other settings ({', '.join(differ)} differ): pass another --out, "
                         "or remove it to start over")
    repeats_done = min(old.get("repeats_done", old_settings["repeats"]), args.repeats)
    mismatches = {(m["temperature"], m["concurrency"], m["method"]): [tuple(w) for w in m["requests"]]
                  for m in old.get("mismatches", [])}
    return {"blocks": [b for b in blocks if b["repeat"] < repeats_done],
            "mismatches": {k: [w for w in v if w[0] < repeats_done] for k, v in mismatches.items()},
            "repeats_done": repeats_done}


def write(args, run: dict, measured: dict, argv: list[str]) -> dict:
    """serve.json, serve.md and the plot under ``--out``; the result. ``measured["repeats_done"]`` below
    ``--repeats``: a checkpoint of an unfinished run (serve.json's ``complete`` is false)."""
    summary = summarize(measured["blocks"], measured["mismatches"])
    out = args.out
    out.mkdir(parents=True, exist_ok=True)
    plot_path = plot(summary, out / args.plot_name, title=f"{Path(run['target']).name} + {Path(run['draft']).name}",
                     top_k=args.top_k)
    repeats_done = measured.get("repeats_done", args.repeats)
    result = {
        "machine": machine(), "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
        "command": "python -m infer.serve " + shlex.join(argv), "vllm_version": vllm_version(),
        "complete": repeats_done >= args.repeats, "repeats_done": repeats_done,
        "settings": settings(args, run),
        "plot": plot_path.name,
        "summary": summary,
        "mismatches": [{"temperature": t, "concurrency": c, "method": n, "requests": [list(w) for w in wrong]}
                       for (t, c, n), wrong in measured["mismatches"].items()],
        "blocks": measured["blocks"],
    }
    tmp = out / "serve.json.tmp"  # replaced whole: an interruption never leaves half a file
    tmp.write_text(json.dumps(result, indent=1) + "\n")
    tmp.replace(out / "serve.json")
    (out / "serve.md").write_text(report(result))
    return result


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    for key, value in VLLM_ENV.items():
        os.environ.setdefault(key, value)
    try:
        run = plan(args)
        done = load_done(args, run)
    except (ValueError, ImportError) as exc:
        parser.error(str(exc))
    try:
        measured = measure(args, run, done=done, checkpoint=lambda m: write(args, run, m, argv))
    except MemoryError as exc:
        parser.exit(3, f"python -m infer.serve: {exc}\n")
    result = write(args, run, measured, argv)
    print(report(result))
    print(f"written to {args.out / 'serve.json'}, {args.out / 'serve.md'}, {args.out / result['plot']}")
    if measured["mismatches"]:
        print("greedy output differs from target-only's for: "
              + ", ".join(sorted({n for _, _, n in measured["mismatches"]})), file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
