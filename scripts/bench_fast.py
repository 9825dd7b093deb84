"""Eager decoding against the fast path (docs/engine.md, "The fast path"), interleaved in one process.

    python scripts/bench_fast.py --fast compile                        # the demo pair (make demo-pair), 8 prompts
    python scripts/bench_fast.py --random --device cuda --fast compile # the demo configs, random weights
    python scripts/bench_fast.py --configs DIR --fast static           # DIR/draft.json, DIR/target.json, random weights
    python scripts/bench_fast.py --head demo/heads/next_wrej1_d1 --out reports/fast/bench.json
    python scripts/bench_fast.py --batch 4 8 --fast static compile --prompts 16 --max-new-tokens 32  # batches

What it measures, on one device, greedy decoding (``--sampling paper``: temperature 1, top-k 50),
with ``--threads`` torch threads on a CPU:

1. Forwards: t_target(n) for n = 1, 2, 4, 8 and t_draft(1), n tokens after a cached context of
   ``--context`` tokens, eager (the engine's ModelRunner) and fast (the static runner, n padded to
   its bucket), every (model, n, backend) in turn in each step (``infer.measure.step_times``:
   ``specdecpp.core.timing``, torch.utils.benchmark), medians.
2. The weight-read floor of a one-token target forward: the bytes of the weights it reads (every
   parameter but an untied input embedding) over the memory bandwidth, measured here by copying a
   tensor of ``--bandwidth-mb`` MB (bytes read + written / seconds, median of ``--repeats``). The
   copy is timed after the forwards, not beside them. On a shared machine whose speed drifts, the
   ratio can be off by a third: on an Intel Xeon the copy swung from 10 to 14 GB/s within ten
   minutes (docs/results/fast.md). ``scripts/bench_compile.py`` sets each forward against a copy
   timed in the same round, which is the figure to judge the floor by.
3. Decoding: target-only, fixed K 1-3, SVIP and, with ``--head DIR``, SpecDec++ with that head,
   each eager and fast; every method and backend on a prompt before the next prompt (the order of
   the backends rotates from prompt to prompt). Held-out prompts of the bundled test split with the
   pair's EOS, or random prompts of ``--prompt-len`` tokens with random weights (no EOS). Per
   method: tokens/s pooled over prompts, fast over eager and each backend over its own target-only
   with a paired 95% bootstrap interval over prompts (``infer.summary.paired_speedup_ci``:
   ``specdecpp.analysis.stats``), ms per round, and whether eager and fast produced the same
   tokens on every prompt (checked and printed; in bf16 a near-tie may flip, so a mismatch
   is reported, and fails the run only with ``--require-equal``).
4. ``--breakdown``: where a round's time goes, per method and backend, timed from outside the
   runners (``infer.meters.FeedMeters`` wraps each decoder's runner factory: CPU timers around each
   ``feed`` and, inside a static runner's feed, around its forward step and its mask): the draft's
   and the target's forwards (eager: the whole feed; fast: the step, compiled or not), the mask and
   padding around a fast step, and the rest of the loop (sampling, the acceptance rule, the commit,
   the policy, rollbacks) as a share of the round. The prefill (each runner's first feed of a
   call) is left out of the rounds. On CUDA each meter synchronises the stream, so the host can no
   longer queue a round's work ahead of the GPU: there the timed pass (tokens/s, ms per round, the
   ratios) runs without meters, and a second pass with the same seeds gives the breakdown, whose
   ms per round is then that pass's own (``--breakdown-pass``). ``--profile-outside N`` then runs
   each method once more on the
   fast path under cProfile (prompt 0, untimed otherwise) and lists its N functions of most own
   time, the forward steps among them: where the loop's time goes (cProfile slows Python code more
   than the forwards, so read its list as a ranking, the breakdown for the shares).

5. The rounds after each call's first (which holds the eager prefill), from the timed pass: ms per
   round against what their forwards take as measured in 1. (K draft forwards and one target forward
   of the verification's bucket): "outside the forwards (est.)". On CUDA that estimate runs low,
   since a timed forward pays its own launch and synchronisation and the forwards inside a captured
   round do not (docs/results/gpu.md). ``--round-graphs`` (graph backends) measures it instead: each
   captured round graph (specdecpp/decoders/captured.py) replayed back to back against a graph of
   its forwards alone, in 8 blocks of alternating order (the device part with a 95% interval over
   the blocks), device time by CUDA events, beside the decoding ms per round; the share
   outside the forwards splits into the device's (the round graph beyond its forwards: warps, draws,
   the rule) and the host's (the decoding round beyond its graph). ``--no-capture-rounds`` replays
   each forward but not whole rounds.
6. ``--also-per-forward`` (graph backends): each method decodes a third time in the same
   interleaved pass, on the same backend with rounds not captured, so captured rounds are compared
   with per-forward graphs in one run: tokens/s, captured over per-forward with a paired 95%
   interval, ms per round (all and after the first) and, greedy, whether the tokens are the same.
   ``--also-unfused`` (with ``--fused-rounds``): a fourth decoder per method, rounds captured with
   their work between forwards left as it is, so fused and plain captured rounds share one
   interleaved pass: fused over unfused with a paired interval; ``--round-graphs`` then times both
   kinds of round graph.

Compiling (``--fast compile``) happens before anything is timed (the decoders' ``warm_up`` and the
forward loop's warm-up) and is printed separately, per model, width and cache size. Writes a JSON
(``--out``) and prints a markdown table.

``--batch B [B ...]`` measures batches instead (``generate_batch`` on the static batch runner,
docs/batch.md): for each B the prompts in groups of B, each group one call with ``batch_size=B``
(``--batch-repeats`` times), of target-only, fixed K = 2 and data_gen's target sampling
(``specdecpp.data.labels.sample_responses``, greedy), eager and every ``--fast`` backend (one or
more: ``--fast static compile``), every (method, backend) on a group before the next group, the
order rotating from group to group. Per B and method: tokens/s pooled over calls, each backend
over eager with a paired 95% bootstrap interval over calls, fast fixed K over fast target-only, and
whether every row's greedy tokens equal eager's. ``--batch-methods`` narrows the methods (``sample``
alone: data_gen's sampling, which compiles only the target's one-token batch buckets). Compiling
every (batch, width) bucket (the decoders' ``warm_up(..., batch_size)``, and for ``sample`` the
target's batch buckets at width 1) comes first, untimed, with one untimed call per (method,
backend, B); the seconds per bucket are printed.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import math
import pstats
import time
from collections import Counter
from pathlib import Path

import numpy as np
import torch

from infer.measure import step_times
from infer.meters import FeedMeters
from infer.results import prompt_seed
from infer.summary import paired_speedup_ci
from specdecpp import (
    SVIP,
    FixedK,
    SamplingConfig,
    SpecDecPP,
    SpeculativeDecoder,
    TargetOnly,
    load_head,
    load_pair,
)
from specdecpp.analysis.stats import bootstrap_interval, pooled_ratio
from specdecpp.core.timing import Clock, machine_description, time_forward
from specdecpp.data.labels import sample_responses
from specdecpp.fast.calls import CallRunners
from specdecpp.fast.step import every_model_steps
from specdecpp.models.loading import dtype_name, eos_token_ids, resolve_device, resolve_dtype

SAMPLINGS = {"greedy": SamplingConfig(temperature=0), "paper": SamplingConfig(temperature=1.0, top_k=50)}
WIDTHS = (1, 2, 4, 8)
PER_FORWARD = "per-forward"  # --also-per-forward: the fast backend with rounds not captured
UNFUSED = "unfused"  # --also-unfused (with --fused-rounds): rounds captured without their glue compiled
# The demo target's config (SmolLM2-135M-Instruct, conf/pair/demo.yaml), for --random where the pair
# is not materialised (a GPU machine without the GGUF); the materialised target's config.json wins.
DEMO_TARGET_CONFIG = {
    "hidden_size": 576, "intermediate_size": 1536, "num_hidden_layers": 30, "num_attention_heads": 9,
    "num_key_value_heads": 3, "head_dim": 64, "max_position_embeddings": 8192, "rms_norm_eps": 1e-5,
    "rope_theta": 100000.0, "tie_word_embeddings": True, "vocab_size": 49152, "bos_token_id": 1, "eos_token_id": 2,
    "pad_token_id": 2,
}


def demo_configs() -> tuple[dict, dict]:
    """The demo pair's (draft, target) Llama configs: the draft's from the shipped artifact, the
    target's from the materialised pair if there, else :data:`DEMO_TARGET_CONFIG`."""
    from specdecpp_demo import draft_config
    from specdecpp_demo.pair import cache_dir

    path = cache_dir() / "target" / "config.json"
    target = json.loads(path.read_text()) if path.is_file() else dict(DEMO_TARGET_CONFIG)
    draft = {**draft_config()["llama_config"], "vocab_size": target["vocab_size"], "tie_word_embeddings": False}
    return draft, target


def random_model(config: dict, device, dtype, seed: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(seed)
    keep = {k: v for k, v in config.items()
            if not k.startswith("_") and k not in ("architectures", "dtype", "torch_dtype", "transformers_version")}
    model = LlamaForCausalLM(LlamaConfig(**keep, attn_implementation="sdpa"))
    return model.to(device=device, dtype=dtype).eval().requires_grad_(False)


def load(args, device):
    """(draft, target, tokenizer or None, a description of the pair)."""
    if args.random or args.configs:
        if args.configs:
            configs = [json.loads((Path(args.configs) / f"{role}.json").read_text()) for role in ("draft", "target")]
        else:
            configs = demo_configs()
        dtype = resolve_dtype(args.dtype, device)
        draft, target = (random_model(c, device, dtype, seed) for c, seed in zip(configs, (0, 1), strict=True))
        return draft, target, None, f"random weights, {'configs ' + args.configs if args.configs else 'demo configs'}"
    if args.draft and args.target:
        paths = (args.draft, args.target)
    else:
        from specdecpp_demo import demo_draft_path, demo_target_path

        paths = (str(demo_draft_path()), str(demo_target_path()))
    draft, target, tokenizer = load_pair(*paths, device=str(device), dtype=args.dtype)
    return draft, target, tokenizer, f"draft {paths[0]}, target {paths[1]}"


def prompts(args, tokenizer, vocab: int, device) -> list[torch.Tensor]:
    if tokenizer is None:
        g = torch.Generator().manual_seed(args.seed)
        return [torch.randint(3, vocab, (1, args.prompt_len), generator=g).to(device) for _ in range(args.prompts)]
    from specdecpp.data.prompts import encode_prompt, load_prompts

    return [torch.tensor([encode_prompt(tokenizer, p.prompt)], device=device)
            for p in load_prompts("bundled", split="test", limit=args.prompts)]


def weight_bytes(model) -> int:
    """Bytes of the weights a one-token forward reads: each parameter once, an input embedding
    only where it is the output layer too (a lookup reads one row of it)."""
    seen, total = set(), 0
    skip = None if model.config.tie_word_embeddings else model.get_input_embeddings().weight.data_ptr()
    for p in model.parameters():
        if p.data_ptr() not in seen and p.data_ptr() != skip:
            seen.add(p.data_ptr())
            total += p.numel() * p.element_size()
    return total


def bandwidth(device, mb: int, repeats: int) -> float:
    """Bytes per second of a large tensor copy (bytes read + bytes written / seconds)."""
    src = torch.rand(mb * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    seconds = time_forward(lambda: dst.copy_(src), repeats=repeats, warmup=2).median
    return 2 * src.numel() * src.element_size() / seconds


def methods(args, draft) -> dict:
    out = {"target_only": TargetOnly(), **{f"fixed_k{k}": FixedK(k) for k in (1, 2, 3)},
           "svip": SVIP(args.svip_threshold, max_candidates=args.svip_max)}
    if args.head:
        out["head"] = SpecDecPP(load_head(args.head), args.head_threshold, max_candidates=args.head_max)
    return out


def compile_record(models: dict) -> dict:
    """Seconds per compiled step: "ROLE wWIDTH sSIZE" (one row) or "... bBATCH" (a batch bucket);
    per captured step (--fast graphs / compile-graphs: warm-up and capture, less the step's compile,
    which is listed on its own: ``capture_seconds``) the same, prefixed with the backend; per captured
    round "round ROLE K w s" ("steps ...": an adaptive policy's graphs, K the most candidates)."""
    out = {}
    for role, m in models.items():
        for key, sec in ((k, v) for steps in every_model_steps(m)  # a feature pair's target: its feature steps too
                         for k, v in (*steps.compile_seconds.items(), *steps.capture_seconds.items())):
            if key[0] in ("round", "steps"):  # captured rounds (specdecpp/decoders/captured.py): K, target width, size
                out[f"{key[0]} {role} K{key[1]} w{key[2]} s{key[3]}"] = sec
                continue
            tag, key = (f"{key[0]} ", key[1:]) if isinstance(key[0], str) else ("", key)
            out[f"{tag}{role} w{key[0]} s{key[1]}" + (f" b{key[2]}" if len(key) > 2 else "")] = sec
    return out


def decode_all(decoders: dict, ids: list[torch.Tensor], args, eos) -> dict:
    """Every (method, backend) on prompt j before prompt j + 1; rows per (method, backend)."""
    rows = {key: [] for key in decoders}
    groups: dict = {}
    for key in decoders:  # a method's backends, in turn
        groups.setdefault(key[0], []).append(key)
    for j, prompt in enumerate(ids):
        # rotate each method's backends from prompt to prompt (two backends: eager first on even prompts)
        keys = [k for group in groups.values() for k in group[j % len(group):] + group[:j % len(group)]]
        for key in keys:
            meters = getattr(decoders[key], "runners", None)
            meters = meters if isinstance(meters, FeedMeters) else None
            before = dict(meters.seconds) if meters is not None else None
            out = decoders[key].generate(prompt, args.max_new_tokens, torch.Generator().manual_seed(
                prompt_seed(args.seed, str(j))), eos_token_id=eos)
            s = out.stats
            rows[key].append({"prompt_id": str(j), "timed": True, "n_generated": s.n_generated,
                              "wall_time_s": s.wall_time_s, "rounds": len(s.accept_lengths),
                              "first_round_s": s.first_round_s, "candidate_lengths": s.candidate_lengths,
                              "draft_forwards": s.n_draft_calls, "replayed_rounds": s.replayed_rounds,
                              "tokens": out.tokens[0, prompt.shape[1]:].tolist(),
                              **(metered_split(meters, before) if meters is not None else {})})
    return rows


def metered_split(meters: FeedMeters, before: dict) -> dict:
    """One call's metered seconds (``meters``' totals now less ``before``): its prefill feeds and its
    rounds' forwards, as :func:`breakdown` splits the pooled totals."""
    delta = {k: v - before.get(k, 0.0) for k, v in meters.seconds.items()}
    return {"prefill_s": meters.total("prefill", seconds=delta),
            "round_forwards_s": sum(meters.forwards(role, seconds=delta) for role in ("draft", "target"))}


def pooled(rows) -> float:
    return sum(r["n_generated"] for r in rows) / sum(r["wall_time_s"] for r in rows)


def ratio(rows, base) -> dict:
    ci = paired_speedup_ci(rows, base)
    return {"ratio": pooled(rows) / pooled(base), "ci95": list(ci) if ci else None}


def breakdown_apart(args, device: torch.device) -> bool:
    """Whether ``--breakdown`` meters a decoding pass of its own (``--breakdown-pass``; ``auto``: on
    CUDA, where each meter synchronises the stream, so the timed pass runs without them)."""
    return args.breakdown and (args.breakdown_pass == "separate" or (args.breakdown_pass == "auto"
                                                                     and device.type == "cuda"))


def after_first(rows: list[dict], times: dict) -> dict:
    """The rounds after each call's first (the first holds the prefill): ms per round, what the
    forwards alone take per round by ``times`` ({"target": {width: s}, "draft": {width: s}}, as
    measured: a round of K candidates costs t_target at the smallest measured width >= K + 1 (the
    widest measured beyond it) and K draft forwards of one token, a replayed round's first of two
    tokens), and the share of the rounds' time outside the forwards (``outside_share_est``)."""
    target = {int(w): t for w, t in times["target"].items()}
    draft = {int(w): t for w, t in times["draft"].items()}
    t_target = [target[w] for w in sorted(target)]
    wall = forwards = 0.0
    rounds = 0
    for r in rows:
        later = r["candidate_lengths"][1:]
        rounds += len(later)
        wall += r["wall_time_s"] - r["first_round_s"]
        forwards += sum(next((target[w] for w in sorted(target) if w >= k + 1), t_target[-1]) for k in later)
        drafted = r["draft_forwards"] - r["candidate_lengths"][0] if r["candidate_lengths"] else 0
        replayed_drafting = r["replayed_rounds"] if r["draft_forwards"] else 0  # target-only replays draft nothing
        forwards += drafted * draft[1] + replayed_drafting * (draft.get(2, draft[1]) - draft[1])
    if not rounds:
        return {}
    ks = Counter(k for r in rows for k in r["candidate_lengths"][1:])
    return {"ms_per_round": 1e3 * wall / rounds, "forwards_ms_per_round_est": 1e3 * forwards / rounds,
            "k": ks.most_common(1)[0][0],  # the K of most rounds (fixed K: all but the last few)
            "outside_share_est": 1 - forwards / wall if wall > 0 else None,
            "replayed_rounds": sum(r["replayed_rounds"] for r in rows)}


ROUND_GRAPH_BLOCKS = 8  # --round-graphs: alternating blocks of replays per round graph and its forwards' graph


def time_round_graphs(target, device: torch.device, repeats: int, blocks: int = ROUND_GRAPH_BLOCKS) -> list[dict]:
    """Each round graph captured over ``target`` (``specdecpp.decoders.captured``) against a graph of
    its forwards alone (``RoundGraph.forwards``, captured here): ``blocks`` blocks of ``repeats``
    back-to-back replays of each, in alternating order (round first in even blocks, forwards first in
    odd ones, so that a clock or cache state that drifts across the run falls on both alike), device
    time per replay of each block (CUDA events; on a CPU the wall time), ``n`` put back before each
    replay. What lies between the two is the round's work on the device outside the forwards (the
    warps, draws and the rule), given with a 95% interval over the blocks (paired bootstrap of the
    mean difference); a decoding round's time beyond the round graph's is the host's."""
    from specdecpp.decoders.captured import round_graphs
    from specdecpp.fast import graphs as fast_graphs

    def block(graph, replay, start: int) -> float:
        """ms per replay of ``repeats`` replays of ``replay`` back to back."""
        begin = end = None
        if device.type == "cuda":
            begin, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            torch.cuda.synchronize(device)
            begin.record()
        t0 = time.perf_counter()
        for _ in range(repeats):
            graph.n.fill_(start)
            replay()
        if device.type == "cuda":
            end.record()
            torch.cuda.synchronize(device)
            return begin.elapsed_time(end) / repeats
        return 1e3 * (time.perf_counter() - t0) / repeats

    out = []
    for graph in round_graphs(target):
        start = int(graph.n)
        pool = torch.cuda.graph_pool_handle() if device.type == "cuda" else None
        with torch.no_grad():
            forwards_replay, _ = fast_graphs.capture_graph(graph.forwards, pool)
        replays = {"round": graph.replay, "forwards": forwards_replay}
        timed = {"round": [], "forwards": []}
        for replay in replays.values():  # once each, untimed
            graph.n.fill_(start)
            replay()
        for b in range(blocks):
            for name in ("round", "forwards") if b % 2 == 0 else ("forwards", "round"):
                timed[name].append(block(graph, replays[name], start))
        graph.n.fill_(start)
        rounds, forwards = np.array(timed["round"]), np.array(timed["forwards"])
        low, high = bootstrap_interval(lambda r, f, axis=-1: np.mean(r, axis) - np.mean(f, axis), rounds, forwards)
        out.append({"k": graph.k, "width": graph.width, "greedy": graph.greedy, "fused": graph.fused,
                    "blocks": blocks, "repeats": repeats,
                    "round_graph_ms": float(np.median(rounds)), "forwards_graph_ms": float(np.median(forwards)),
                    "outside_ms": float(np.mean(rounds - forwards)), "outside_ms_ci": [low, high],
                    "round_graph_ms_blocks": timed["round"], "forwards_graph_ms_blocks": timed["forwards"]})
    return out


def round_graphs_table(result: dict) -> str:
    """The round graphs against their forwards, beside each captured method's ms per decoding round."""
    by_k = {m["fast"]["after_first"]["k"]: (name, m) for name, m in result["methods"].items()  # whole-round graphs:
            if (name == "target_only" or name.startswith("fixed_k"))  # fixed K and target-only (SVIP's are steps)
            and m["fast"].get("after_first", {}).get("replayed_rounds")}
    blocks = result["round_graphs"][0].get("blocks", 1) if result["round_graphs"] else 0
    lines = ["## Captured rounds against their forwards (device time per replay, median of "
             f"{blocks} alternating blocks; decoding: rounds after each call's first)", "",
             "| method | K | target width | round graph ms | its forwards alone ms | decoding ms/round | "
             "outside the forwards | of it on the device [95% CI] | of it on the host |",
             "|---|---|---|---|---|---|---|---|---|"]
    for r in result["round_graphs"]:
        name, m = by_k.get(r["k"], (f"K={r['k']}", None))
        backend = "unfused" if m and r.get("fused") is False and "unfused" in m else "fast"
        wall = m[backend]["after_first"]["ms_per_round"] if m else float("nan")
        if r.get("fused"):
            name += " (fused)"
        elif m and "unfused" in m:
            name += " (unfused)"
        fwd, graph = r["forwards_graph_ms"], r["round_graph_ms"]
        outside = r.get("outside_ms", graph - fwd)
        low, high = r.get("outside_ms_ci", (float("nan"), float("nan")))
        lines.append(f"| {name} | {r['k']} | {r['width']} | {graph:.3f} | {fwd:.3f} | {wall:.3f} | "
                     f"{100 * (1 - fwd / wall):.1f}% | {100 * outside / wall:.1f}% [{100 * low / wall:.1f}, "
                     f"{100 * high / wall:.1f}] | {100 * (wall - graph) / wall:.1f}% |")
    return "\n".join(lines)


def summarize(rows: dict, names, fast: str, meters: dict | None = None, metered: dict | None = None,
              forwards: dict | None = None) -> dict:
    """Per method: tokens/s and ms per round of ``rows`` (the timed pass), the ratios with their
    intervals, whether eager and fast gave the same tokens, and, where ``meters`` has the method, the
    breakdown of ``metered`` (the pass the meters timed: ``rows`` unless the breakdown ran apart);
    with ``forwards`` (the measured forwards by backend), the rounds after the first against what
    their forwards alone take (:func:`after_first`)."""
    out, meters, metered = {}, meters or {}, metered or rows
    for name in names:
        eager, quick = rows[(name, None)], rows[(name, fast)]
        per_forward = rows.get((name, PER_FORWARD))
        unequal = [r["prompt_id"] for r, q in zip(eager, quick, strict=True) if r["tokens"] != q["tokens"]]
        runs = [("eager", None, eager, "eager"), ("fast", fast, quick, "fast")]
        unfused = rows.get((name, UNFUSED))
        if per_forward is not None:  # --also-per-forward: the fast backend's forwards measured once for both
            runs.append(("per_forward", PER_FORWARD, per_forward, "fast"))
        if unfused is not None:  # --also-unfused: rounds captured, their glue not compiled
            runs.append(("unfused", UNFUSED, unfused, "fast"))
        out[name] = {
            **{backend: {"tokens_per_s": pooled(rs), "ms_per_round": 1e3 * sum(r["wall_time_s"] for r in rs)
                         / max(1, sum(r["rounds"] for r in rs)), "n_generated": sum(r["n_generated"] for r in rs),
                         **({"breakdown": breakdown(meters[(name, b)], metered[(name, b)])}
                            if (name, b) in meters else {}),
                         **({"after_first": after_first(rs, forwards[measured])} if forwards else {})}
               for backend, b, rs, measured in runs},
            "fast_over_eager": ratio(quick, eager),
            "eager_over_target_only": ratio(eager, rows[("target_only", None)]),
            "fast_over_fast_target_only": ratio(quick, rows[("target_only", fast)]),
            "greedy_equal": not unequal, "unequal_prompts": unequal}
        if per_forward is not None:
            out[name]["captured_over_per_forward"] = ratio(quick, per_forward)
            out[name]["per_forward_unequal_prompts"] = [r["prompt_id"] for r, q in zip(per_forward, quick, strict=True)
                                                        if r["tokens"] != q["tokens"]]
        if unfused is not None:
            out[name]["fused_over_unfused"] = ratio(quick, unfused)
            out[name]["unfused_unequal_prompts"] = [r["prompt_id"] for r, q in zip(unfused, quick, strict=True)
                                                    if r["tokens"] != q["tokens"]]
    return out


def breakdown(meters: FeedMeters, rows: list[dict]) -> dict:
    """Seconds per round, and shares of the rounds' time, of one (method, backend)'s timed calls:
    the rounds' time is the calls' wall time less their prefill feeds (:class:`FeedMeters`). A
    model's forwards are its steps where the runner has them (fast), else its whole feeds (eager);
    ``in_feed`` is the rest of the fast feeds (the mask, the padding), ``loop`` everything outside
    the feeds; ``outside`` the two together."""
    rounds = sum(r["rounds"] for r in rows)
    wall = sum(r["wall_time_s"] for r in rows) - meters.total("prefill")
    forward = {role: meters.forwards(role) for role in ("draft", "target")}
    feeds = meters.total("round")
    parts = {"draft_forward": forward["draft"], "target_forward": forward["target"],
             "in_feed": feeds - sum(forward.values()), "mask": meters.total("round", "mask"), "loop": wall - feeds}
    parts["outside"] = parts["in_feed"] + parts["loop"]
    ci = None
    if all("round_forwards_s" in r for r in rows):  # per call (decode_all): the share's interval over prompts
        spans = np.array([r["wall_time_s"] - r["prefill_s"] for r in rows])
        outside = spans - np.array([r["round_forwards_s"] for r in rows])
        ci = bootstrap_interval(pooled_ratio, outside, spans)
        ci = None if any(map(math.isnan, ci)) else list(ci)
    return {"rounds": rounds, "ms_per_round": 1e3 * wall / max(rounds, 1), "outside_share_ci95": ci,
            **{f"{k}_ms_per_round": 1e3 * v / max(rounds, 1) for k, v in parts.items()},
            **{f"{k}_share": v / wall if wall > 0 else None for k, v in parts.items()}}


def outside_own_times(stats: pstats.Stats) -> tuple[dict, float]:
    """Each function's own seconds outside the forward steps, and the steps' cumulative seconds.
    The steps are what :func:`infer.meters.run_forward_step` calls; a function called by one of
    their callees (transitively) is inside, unless it is called from outside too: then only its
    own time on the calls from outside callers counts (cProfile splits own time per caller)."""
    roots = [f for f in stats.stats if f[2] == "run_forward_step"]
    callees: dict = {}
    for f, (_, _, _, _, callers) in stats.stats.items():
        for c in callers:
            callees.setdefault(c, set()).add(f)
    inside, todo = set(), [g for r in roots for g in callees.get(r, ())]
    while todo:
        f = todo.pop()
        if f not in inside:
            inside.add(f)
            todo += callees.get(f, ())
    steps = sum(stats.stats[r][3] for r in roots)
    own = {}
    for f, (_, _, tt, _, callers) in stats.stats.items():
        if f in roots:
            continue
        if f not in inside:
            own[f] = tt
        else:  # the calls from callers outside the forwards (edge: (cc, nc, tt, ct))
            own[f] = sum(edge[2] for c, edge in callers.items() if c not in inside and c not in roots)
    return own, steps


def profile_outside(decoder, prompt, args, eos, top: int) -> dict:
    """One call of ``decoder`` under cProfile: the forward steps' time and the ``top`` functions by
    own time outside them (ms per round; shares of the profiled time)."""
    profiler = cProfile.Profile()
    profiler.enable()
    out = decoder.generate(prompt, args.max_new_tokens, torch.Generator().manual_seed(0), eos_token_id=eos)
    profiler.disable()
    stats = pstats.Stats(profiler)
    rounds, total = max(1, len(out.stats.accept_lengths)), stats.total_tt
    own, steps = outside_own_times(stats)
    ranked = sorted(own.items(), key=lambda kv: kv[1], reverse=True)[:top]
    return {"rounds": rounds, "profiled_s": total, "steps_share": steps / total if total else None,
            "outside_share": sum(own.values()) / total if total else None, "top": [
                {"function": f"{Path(file).name}:{line}({name})" if line else name,
                 "calls": stats.stats[(file, line, name)][1],
                 "own_ms_per_round": 1e3 * tt / rounds, "own_share": tt / total if total else None}
                for (file, line, name), tt in ranked]}


def breakdown_table(result: dict) -> str:
    lines = ["## Where a round's time goes (ms per round; share of the round, prefill left out)", "",
             "| method | backend | ms/round | draft forwards | target forwards | mask + padding (in feed) | "
             "rest of the loop | outside the forwards [95% CI over prompts] |", "|---|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        for backend in ("eager", "fast"):
            b = m[backend].get("breakdown")
            if not b:
                continue
            cells = [f"{b[f'{k}_ms_per_round']:.2f} ({100 * b[f'{k}_share']:.1f}%)"
                     for k in ("draft_forward", "target_forward", "in_feed", "loop", "outside")]
            if b.get("outside_share_ci95"):  # the share's 95% interval over prompts
                cells[-1] += " [{:.1f}%, {:.1f}%]".format(*(100 * x for x in b["outside_share_ci95"]))
            lines.append(f"| {name} | {backend} | {b['ms_per_round']:.2f} | " + " | ".join(cells) + " |")
    for name, p in (result.get("profile_outside") or {}).items():
        lines += ["", f"cProfile, {name} fast, one call ({p['rounds']} rounds, {p['profiled_s']:.2f} s profiled; "
                  f"forward steps {100 * p['steps_share']:.1f}%, outside them {100 * p['outside_share']:.1f}%): "
                  "own time outside the steps", "", "| function | calls | ms/round | share |", "|---|---|---|---|"]
        lines += [f"| `{f['function']}` | {f['calls']} | {f['own_ms_per_round']:.3f} | {100 * f['own_share']:.1f}% |"
                  for f in p["top"]]
    return "\n".join(lines)


def _x(r: dict) -> str:
    ci = r["ci95"]
    return f"{r['ratio']:.2f}x" + (f" [{ci[0]:.2f}, {ci[1]:.2f}]" if ci else "")


def forwards_table(result: dict) -> str:
    """The forwards and the weight-read floor (printed as soon as they are measured, and in the report)."""
    fwd, fast = result["forwards"], result["fast"]
    lines = [f"## Forwards ({result['device']}, {result['dtype']}, fast={fast}; medians)", "",
             "| forward | eager ms | fast ms | gain |", "|---|---|---|---|"]
    for role, widths in (("target", WIDTHS), ("draft", (1,))):
        for n in widths:
            e, f = fwd["eager"][role][str(n)], fwd["fast"][role][str(n)]
            lines.append(f"| {role}, {n} token{'s' if n > 1 else ''} | {1e3 * e:.2f} | {1e3 * f:.2f} | {e / f:.2f}x |")
    floor = result["floor"]
    lines += ["", f"Memory bandwidth (a {result['bandwidth_mb']} MB copy, read + written bytes / s): "
              f"{floor['bandwidth_gb_s']:.1f} GB/s; the target reads {floor['weight_mb']:.1f} MB of weights per "
              f"forward: floor {floor['floor_ms']:.2f} ms; one-token forward eager {floor['eager_over_floor']:.2f}x, "
              f"fast {floor['fast_over_floor']:.2f}x the floor (the copy timed after the forwards; "
              "scripts/bench_compile.py sets each forward beside a copy)."]
    return "\n".join(lines)


def table(result: dict) -> str:
    lines = [forwards_table(result), "",
             f"## Decoding ({result['prompts']} prompts, {result['max_new_tokens']} new tokens, "
              f"{result.get('sampling', 'greedy')})", "",
              "| method | eager tok/s | fast tok/s | fast / eager [95% CI] | eager / eager target-only | "
              "fast / fast target-only | ms/round eager | ms/round fast | same tokens |",
              "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        lines.append(f"| {name} | {m['eager']['tokens_per_s']:.2f} | {m['fast']['tokens_per_s']:.2f} | "
                     f"{_x(m['fast_over_eager'])} | {_x(m['eager_over_target_only'])} | "
                     f"{_x(m['fast_over_fast_target_only'])} | {m['eager']['ms_per_round']:.2f} | "
                     f"{m['fast']['ms_per_round']:.2f} | "
                     f"{'yes' if m['greedy_equal'] else 'NO: prompts ' + ', '.join(m['unequal_prompts'])} |")
    comp = result["compile_seconds"]
    lines += ["", f"Compile time (not in any timing above): {sum(comp.values()):.1f} s" + (
        " (" + ", ".join(f"{k}: {v:.1f} s" for k, v in comp.items()) + ")" if comp else "")]
    if any("after_first" in m["fast"] for m in result["methods"].values()):
        lines += ["", after_first_table(result)]
    if any("per_forward" in m for m in result["methods"].values()):
        lines += ["", per_forward_table(result)]
    if any("unfused" in m for m in result["methods"].values()):
        lines += ["", unfused_table(result)]
    if result.get("round_graphs"):
        lines += ["", round_graphs_table(result)]
    if any("breakdown" in m["fast"] for m in result["methods"].values()):
        lines += ["", breakdown_table(result)]
    return "\n".join(lines)


def per_forward_table(result: dict) -> str:
    """--also-per-forward: rounds captured against the same backend replaying each forward, one
    interleaved pass (greedy: the same tokens expected; sampled: a captured round draws its own
    uniforms, so the samples differ while both follow the target's distribution)."""
    greedy = result.get("sampling", "greedy") == "greedy"
    lines = ["## Rounds captured against per-forward graphs (one interleaved pass; paired 95% CI over prompts)", "",
             "| method | captured tok/s | per-forward tok/s | captured / per-forward [95% CI] | ms/round captured | "
             "ms/round per-forward | ms/round after the first, captured | per-forward | same tokens |",
             "|---|---|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        c, p = m["fast"], m["per_forward"]
        later = [x.get("after_first", {}).get("ms_per_round") for x in (c, p)]
        same = ("yes" if not m["per_forward_unequal_prompts"] else
                "NO: prompts " + ", ".join(m["per_forward_unequal_prompts"])) if greedy else "n/a (sampled)"
        lines.append(f"| {name} | {c['tokens_per_s']:.2f} | {p['tokens_per_s']:.2f} | "
                     f"{_x(m['captured_over_per_forward'])} | "
                     f"{c['ms_per_round']:.3f} | {p['ms_per_round']:.3f} | "
                     + " | ".join("n/a" if v is None else f"{v:.3f}" for v in later) + f" | {same} |")
    return "\n".join(lines)


def unfused_table(result: dict) -> str:
    """--also-unfused: fused rounds (their glue compiled) against plain captured rounds, one interleaved
    pass (greedy: the same tokens expected; sampled: how many prompts' samples differ, which both
    rounds' exactness tests allow)."""
    greedy = result.get("sampling", "greedy") == "greedy"
    lines = ["## Fused rounds against plain captured rounds (one interleaved pass; paired 95% CI over prompts)", "",
             "| method | fused tok/s | unfused tok/s | fused / unfused [95% CI] | ms/round after the first, fused | "
             "unfused | same tokens |", "|---|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        f, u = m["fast"], m["unfused"]
        later = [x.get("after_first", {}).get("ms_per_round") for x in (f, u)]
        same = ("yes" if not m["unfused_unequal_prompts"] else
                "NO: prompts " + ", ".join(m["unfused_unequal_prompts"])) if greedy else (
                f"{len(m['unfused_unequal_prompts'])} of {result['prompts']} differ (sampled)")
        lines.append(f"| {name} | {f['tokens_per_s']:.2f} | {u['tokens_per_s']:.2f} | {_x(m['fused_over_unfused'])} | "
                     + " | ".join("n/a" if v is None else f"{v:.3f}" for v in later) + f" | {same} |")
    return "\n".join(lines)


def after_first_table(result: dict) -> str:
    """The rounds after each call's first, unmetered, against the forwards alone (:func:`after_first`)."""
    lines = [f"## Outside the forwards (timed pass; rounds after each call's first; capture_rounds="
             f"{result.get('capture_rounds', True)})", "",
             "| method | backend | ms/round | forwards alone (est.) ms | outside the forwards | rounds replayed |",
             "|---|---|---|---|---|---|"]
    for name, m in result["methods"].items():
        for backend in ("eager", "fast", "per_forward", "unfused"):
            a = m.get(backend, {}).get("after_first")
            if a:
                share = a["outside_share_est"]
                lines.append(f"| {name} | {backend} | {a['ms_per_round']:.3f} | {a['forwards_ms_per_round_est']:.3f} | "
                             f"{'n/a' if share is None else f'{100 * share:.1f}%'} | {a['replayed_rounds']} |")
    return "\n".join(lines)


BATCH_METHODS = ("target_only", "fixed_k2", "sample")  # sample: data_gen's target sampling


def batch_call(name: str, decoders: dict, backend, group: list[torch.Tensor], max_new_tokens: int, eos, target
               ) -> tuple[list, float]:
    """One timed call over ``group`` (1-D prompts) with ``batch_size=len(group)``: each row's new
    tokens and the call's wall time."""
    t0 = time.perf_counter()
    if name == "sample":
        tokens = sample_responses(target, [p.tolist() for p in group], SAMPLINGS["greedy"], max_new_tokens,
                                  [torch.Generator() for _ in group], eos_token_id=eos, batch_size=len(group),
                                  fast=backend)
    else:
        outs = decoders[(name, backend)].generate_batch(group, max_new_tokens, eos_token_id=eos,
                                                        batch_size=len(group))
        tokens = [o.tokens[0, p.shape[0]:].tolist() for o, p in zip(outs, group, strict=True)]
    return tokens, time.perf_counter() - t0


def batch_run(args, draft, target, ids: list[torch.Tensor], eos) -> dict:
    """``--batch``: rows per (B, method, backend), one per call (module docstring)."""
    backends, methods = [None, *args.fast], [m for m in BATCH_METHODS if m in args.batch_methods]
    policies = {"target_only": TargetOnly(), "fixed_k2": FixedK(2)}
    decoders = {(name, b): SpeculativeDecoder(draft, target, policy, SAMPLINGS["greedy"], fast=b)
                for name, policy in policies.items() if name in methods for b in backends}
    prompts = [p[0] for p in ids]
    longest, widest = max(p.shape[0] for p in prompts), max(args.batch)
    t0 = time.perf_counter()
    for decoder in decoders.values():
        decoder.warm_up(longest, args.max_new_tokens, widest, progress=True)
    if "sample" in methods:  # sample_responses' runner: the same cache size, one-token forwards, every batch bucket
        for b in args.fast:
            CallRunners(b, (target,)).warm_up(longest + args.max_new_tokens + 1, [(target, (1,))], rows=widest,
                                              progress=True)
    for size in args.batch:  # one untimed call of each (method, backend) per batch size
        for name in methods:
            for backend in backends:
                batch_call(name, decoders, backend, prompts[:size], min(8, args.max_new_tokens), eos, target)
    compiled = compile_record({"target": target, "draft": draft})
    print(f"warmed up (compiled) in {time.perf_counter() - t0:.0f} s", flush=True)
    rows: dict = {(size, name, b): [] for size in args.batch for name in methods for b in backends}
    t0 = time.perf_counter()
    step = 0
    for size in args.batch:
        groups = [prompts[i : i + size] for i in range(0, len(prompts) - size + 1, size)]
        for rep in range(args.batch_repeats):
            for g, group in enumerate(groups):
                keys = [(name, b) for name in methods for b in backends]
                keys = keys[step % len(keys):] + keys[: step % len(keys)]
                step += 1
                for name, backend in keys:
                    tokens, wall = batch_call(name, decoders, backend, group, args.max_new_tokens, eos, target)
                    rows[(size, name, backend)].append({"prompt_id": f"g{g}r{rep}", "timed": True, "wall_time_s": wall,
                                                        "n_generated": sum(len(t) for t in tokens), "tokens": tokens})
    print(f"decoded in {time.perf_counter() - t0:.0f} s", flush=True)
    late = set(compile_record({"target": target, "draft": draft})) - set(compiled)
    if late:
        print(f"WARNING: compiled while timing (not warmed up): {sorted(late)}", flush=True)
    out = {}
    for size in args.batch:
        for name in methods:
            eager = rows[(size, name, None)]
            entry = {"eager": {"tokens_per_s": pooled(eager), "n_generated": sum(r["n_generated"] for r in eager)}}
            for b in args.fast:
                mine = rows[(size, name, b)]
                unequal = sorted({f"{r['prompt_id']} row {i}" for r, e in zip(mine, eager, strict=True)
                                  for i, (t, u) in enumerate(zip(r["tokens"], e["tokens"], strict=True)) if t != u})
                entry[b] = {"tokens_per_s": pooled(mine), "n_generated": sum(r["n_generated"] for r in mine),
                            "over_eager": ratio(mine, eager), "greedy_equal": not unequal, "unequal_rows": unequal}
                if name == "fixed_k2" and "target_only" in methods:
                    entry[b]["over_target_only"] = ratio(mine, rows[(size, "target_only", b)])
            if name == "fixed_k2" and "target_only" in methods:
                entry["eager"]["over_target_only"] = ratio(eager, rows[(size, "target_only", None)])
            out.setdefault(str(size), {})[name] = entry
    return {"batches": out, "units": {str(size): len(rows[(size, methods[0], None)]) for size in args.batch},
            "compile_seconds": compile_record({"target": target, "draft": draft})}


def batch_table(result: dict) -> str:
    fast = result["fast"]
    lines = [f"## Batches ({result['device']}, {result['dtype']}, {result['prompts']} prompts, "
             f"{result['max_new_tokens']} new tokens, greedy; tokens/s pooled over calls)", "",
             "| B | method | eager tok/s | " + " | ".join(f"{b} tok/s | {b} / eager [95% CI]" for b in fast)
             + " | K=2 / target-only (eager, " + ", ".join(fast) + ") | greedy equal |",
             "|---|---|---|" + "---|---|" * len(fast) + "---|---|"]
    for size, methods in result["batches"].items():
        for name, m in methods.items():
            cells = [f"{m[b]['tokens_per_s']:.2f} | {_x(m[b]['over_eager'])}" for b in fast]
            versus = (", ".join(_x(m[b]["over_target_only"]) for b in ["eager", *fast])
                      if "over_target_only" in m["eager"] else "")
            equal = [b for b in fast if not m[b]["greedy_equal"]]
            lines.append(f"| {size} | {name} | {m['eager']['tokens_per_s']:.2f} | " + " | ".join(cells)
                         + f" | {versus} | " + ("yes" if not equal else "NO: " + "; ".join(
                             f"{b}: {', '.join(m[b]['unequal_rows'])}" for b in equal)) + " |")
    comp = result["compile_seconds"]
    lines += ["", f"Calls per batch size: {result['units']}. Compile time (not in any timing above): "
              f"{sum(comp.values()):.1f} s" + (" (" + ", ".join(f"{k}: {v:.1f} s" for k, v in comp.items()) + ")"
                                               if comp else "")]
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--fast", choices=["static", "compile", "graphs", "compile-graphs"], nargs="+", default=["compile"],
                    help="the fast backend (default compile); with --batch one or more")
    ap.add_argument("--batch", type=int, nargs="+", help="measure generate_batch and data_gen's sampling at these "
                    "batch sizes instead (module docstring)")
    ap.add_argument("--batch-repeats", type=int, default=1, help="with --batch: calls per group of prompts")
    ap.add_argument("--batch-methods", nargs="+", choices=BATCH_METHODS, default=list(BATCH_METHODS),
                    help="with --batch: these methods only (sample: data_gen's target sampling)")
    ap.add_argument("--device", default="auto", help="auto | cpu | cuda | cuda:N")
    ap.add_argument("--dtype", default="fast", help="fast (bf16 on CUDA and CPUs with native bf16) | auto | float32 | "
                    "bfloat16 | float16")
    ap.add_argument("--draft", help="draft model (default: the demo pair's)")
    ap.add_argument("--target", help="target model (default: the demo pair's)")
    ap.add_argument("--random", action="store_true", help="the demo pair's configs with random weights")
    ap.add_argument("--configs", help="a folder with draft.json and target.json (Llama configs), random weights")
    ap.add_argument("--head", help="also SpecDec++ with this head directory")
    ap.add_argument("--head-threshold", type=float, default=0.5)
    ap.add_argument("--head-max", type=int, default=8, help="the head's max_candidates (default 8)")
    ap.add_argument("--svip-threshold", type=float, default=0.3)
    ap.add_argument("--svip-max", type=int, default=8, help="SVIP's max_candidates (default 8: buckets up to 16)")
    ap.add_argument("--prompts", type=int, default=8)
    ap.add_argument("--prompt-len", type=int, default=64, help="random prompts' length (random weights)")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument("--context", type=int, default=64, help="cached tokens before a timed forward")
    ap.add_argument("--repeats", type=int, default=30, help="timed calls per forward and bandwidth copy")
    ap.add_argument("--bandwidth-mb", type=int, default=0, help="size of the copied tensor (default: 256 MB on a CPU, "
                    "1024 MB on CUDA)")
    ap.add_argument("--threads", type=int, default=1, help="torch CPU threads (default 1)")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sampling", choices=sorted(SAMPLINGS), default="greedy",
                    help="greedy (default) or paper (temperature 1, top-k 50; the same seeds on both backends)")
    ap.add_argument("--breakdown", action="store_true", help="time the draft's and the target's forwards, the "
                    "mask and the rest of each round from outside the runners (docstring, 4.)")
    ap.add_argument("--breakdown-pass", choices=("auto", "same", "separate"), default="auto",
                    help="with --breakdown: meter the timed pass (same) or a second pass with the same seeds "
                    "(separate); auto: separate on CUDA, where the meters synchronise, else same")
    ap.add_argument("--profile-outside", type=int, default=0, metavar="N",
                    help="with --breakdown: one more fast call per method under cProfile, its N functions of "
                    "most own time")
    ap.add_argument("--no-capture-rounds", action="store_true", help="on the graph backends, replay each forward "
                    "but not whole rounds (specdecpp/decoders/captured.py)")
    ap.add_argument("--also-per-forward", action="store_true", help="on a graph backend, each method also decodes "
                    "with rounds not captured (each forward replayed), in the same interleaved pass: captured over "
                    "per-forward with a paired interval (docstring, 6.)")
    ap.add_argument("--fused-rounds", action="store_true", help="with --fast compile-graphs: captured rounds with "
                    "their work between forwards compiled too (capture_rounds='fused', specdecpp/decoders/captured.py)")
    ap.add_argument("--also-unfused", action="store_true", help="with --fused-rounds: each method also decodes with "
                    "rounds captured but their glue not compiled, in the same interleaved pass (docstring, 6.)")
    ap.add_argument("--round-graphs", action="store_true", help="after decoding on a graph backend, time each "
                    "captured round graph against a graph of its forwards alone (docstring, 5.)")
    ap.add_argument("--require-equal", action="store_true", help="exit 1 if eager and fast tokens differ")
    ap.add_argument("--out", type=Path, help="write everything measured as JSON here")
    args = ap.parse_args(argv)
    if args.random and args.configs:
        ap.error("give --random (the demo configs) or --configs DIR, not both")
    if (args.random or args.configs) and (args.draft or args.target or args.head):
        ap.error("--draft, --target and --head need real weights: leave out --random/--configs")
    if bool(args.draft) != bool(args.target):
        ap.error("give both --draft and --target (or neither: the demo pair)")
    for name in ("prompts", "max_new_tokens", "context", "repeats", "threads", "prompt_len"):
        if getattr(args, name) < 1:
            ap.error(f"--{name.replace('_', '-')} must be >= 1, got {getattr(args, name)}")
    if args.profile_outside and not args.breakdown:
        ap.error("--profile-outside needs --breakdown")
    if args.round_graphs and (args.no_capture_rounds or args.batch
                              or not set(args.fast) & {"graphs", "compile-graphs"}):
        ap.error("--round-graphs needs --fast graphs or compile-graphs, rounds captured, and no --batch")
    if args.also_per_forward and (args.no_capture_rounds or args.batch or
                                  not set(args.fast) & {"graphs", "compile-graphs"}):
        ap.error("--also-per-forward needs --fast graphs or compile-graphs, rounds captured, and no --batch")
    if args.fused_rounds and (args.fast != ["compile-graphs"] or args.no_capture_rounds or args.batch):
        ap.error("--fused-rounds needs --fast compile-graphs, rounds captured, and no --batch")
    if args.also_unfused and not args.fused_rounds:
        ap.error("--also-unfused needs --fused-rounds")
    if args.context <= max(WIDTHS) + 1:
        ap.error(f"--context must be > {max(WIDTHS) + 1}, got {args.context}")
    if len(set(args.fast)) != len(args.fast) or (len(args.fast) > 1 and not args.batch):
        ap.error(f"--fast takes one backend (several, once each, only with --batch), got {' '.join(args.fast)}")
    if args.batch and (min(args.batch) < 1 or max(args.batch) > args.prompts or args.batch_repeats < 1):
        ap.error(f"--batch sizes must lie in [1, --prompts={args.prompts}] and --batch-repeats be >= 1")
    if args.batch and (args.breakdown or args.sampling != "greedy"):
        ap.error("--batch decodes greedily and has no --breakdown")
    torch.set_num_threads(args.threads)
    device = resolve_device(args.device)
    draft, target, tokenizer, pair = load(args, device)
    vocab = min(draft.config.vocab_size, target.config.vocab_size)
    eos = sorted(eos_token_ids(tokenizer, target)) if tokenizer is not None else None
    ids = prompts(args, tokenizer, vocab, device)
    print(f"{machine_description(device)}; {pair}; {dtype_name(target.dtype)}; fast={' '.join(args.fast)}", flush=True)
    if args.batch:
        result = {"machine": machine_description(device), "device": str(device), "dtype": dtype_name(target.dtype),
                  "fast": args.fast, "threads": torch.get_num_threads(), "pair": pair, "prompts": len(ids),
                  "max_new_tokens": args.max_new_tokens, **batch_run(args, draft, target, ids, eos)}
        return report(result, batch_table(result), args, all(
            m[b]["greedy_equal"] for methods in result["batches"].values() for m in methods.values()
            for b in args.fast))
    args.fast = args.fast[0]

    t0 = time.perf_counter()
    context = torch.cat([ids[0][0], torch.randint(3, vocab, (args.context,), generator=torch.Generator().manual_seed(1))
                         .to(device)])[: args.context][None]
    models = {"target": target, "draft": draft, "target+fast": target, "draft+fast": draft}
    timed = step_times(models, context, args.repeats, {"target": list(WIDTHS), "target+fast": list(WIDTHS),
                                                       "draft": [2], "draft+fast": [2]},
                       {"target+fast": args.fast, "draft+fast": args.fast})
    forwards = {backend: {role: {str(n): t for n, t in timed[role + suffix].items()} for role in ("target", "draft")}
                for backend, suffix in (("eager", ""), ("fast", "+fast"))}
    mb = args.bandwidth_mb or (1024 if device.type == "cuda" else 256)
    bw = bandwidth(device, mb, args.repeats)
    floor_s = weight_bytes(target) / bw
    floor = {"bandwidth_gb_s": bw / 1e9, "weight_mb": weight_bytes(target) / 1e6, "floor_ms": 1e3 * floor_s,
             "eager_over_floor": forwards["eager"]["target"]["1"] / floor_s,
             "fast_over_floor": forwards["fast"]["target"]["1"] / floor_s}
    print(f"forwards and bandwidth measured in {time.perf_counter() - t0:.0f} s", flush=True)
    print(forwards_table({"forwards": forwards, "fast": args.fast, "device": str(device),  # kept if a timeout
                          "dtype": dtype_name(target.dtype), "floor": floor, "bandwidth_mb": mb}), flush=True)

    policies = methods(args, draft)
    sampling = SAMPLINGS[args.sampling]
    captured = "fused" if args.fused_rounds else not args.no_capture_rounds
    backends = {None: (None, True), args.fast: (args.fast, captured)}
    if args.also_per_forward:  # each method's third decoder, interleaved with the other two
        backends[PER_FORWARD] = (args.fast, False)
    if args.also_unfused:  # and a fourth: rounds captured, their glue not compiled
        backends[UNFUSED] = (args.fast, True)
    # each decoder a policy object of its own: captured step graphs keep a policy's round state (captured.py)
    own = {key: methods(args, draft) for key in backends}
    decoders = {(name, key): SpeculativeDecoder(draft, target, own[key][name], sampling, fast=fast,
                                                capture_rounds=capture)
                for name in policies for key, (fast, capture) in backends.items()}
    longest = max(p.shape[1] for p in ids)
    for decoder in decoders.values():  # compile every bucket at the calls' cache size, then one untimed call
        decoder.warm_up(longest, args.max_new_tokens, progress=True)
        decoder.generate(ids[0], min(8, args.max_new_tokens), torch.Generator().manual_seed(0), eos_token_id=eos)
    meters, apart = {}, breakdown_apart(args, device)

    def metered() -> None:  # from here on, every runner's feeds are timed from outside
        roles = {id(draft): "draft", id(target): "target"}
        for key, decoder in decoders.items():
            decoder.runners = meters[key] = FeedMeters(decoder.runners, roles, Clock(device))

    if args.breakdown and not apart:
        metered()
    t0 = time.perf_counter()
    rows = metered_rows = decode_all(decoders, ids, args, eos)
    print(f"decoded in {time.perf_counter() - t0:.0f} s", flush=True)
    if apart:  # the meters' synchronisations would stall the host's run-ahead: a pass of their own, same seeds
        metered()
        t0 = time.perf_counter()
        metered_rows = decode_all(decoders, ids, args, eos)
        print(f"decoded again under the breakdown's meters in {time.perf_counter() - t0:.0f} s", flush=True)
    summary = summarize(rows, policies, args.fast, meters, metered_rows,  # before the profiled calls add to the meters
                        forwards)
    rounds = time_round_graphs(target, device, args.repeats) if args.round_graphs else None
    profiled = {name: profile_outside(decoders[(name, args.fast)], ids[0], args, eos, args.profile_outside)
                for name in policies} if args.profile_outside else None

    result = {"machine": machine_description(device), "device": str(device), "dtype": dtype_name(target.dtype),
              "fast": args.fast, "threads": torch.get_num_threads(), "pair": pair, "prompts": len(ids),
              "max_new_tokens": args.max_new_tokens, "sampling": args.sampling, "context": args.context,
              "bandwidth_mb": mb, "forwards": forwards, "floor": floor,
              "methods": summary, "profile_outside": profiled,
              "breakdown_pass": ("separate" if apart else "same") if args.breakdown else None,
              "capture_rounds": captured, "round_graphs": rounds,
              "compile_seconds": compile_record({"target": target, "draft": draft})}
    return report(result, table(result), args, all(  # greedy: per-forward's and unfused's tokens too
        m["greedy_equal"] and (args.sampling != "greedy" or not (m.get("per_forward_unequal_prompts")
                                                                 or m.get("unfused_unequal_prompts")))
        for m in result["methods"].values()))


def report(result: dict, text: str, args, equal: bool) -> int:
    """Print ``text``, write ``result`` to ``--out``; the exit status (1: unequal tokens with
    ``--require-equal``)."""
    print(text)
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
        print(f"written to {args.out}")
    return 1 if args.require_equal and not equal else 0


if __name__ == "__main__":
    raise SystemExit(main())
