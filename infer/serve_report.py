"""The serving benchmark's pure parts (``python -m infer.serve``, docs/vllm.md "Serving benchmark"): the
method names it takes, the interleaved order of a block, the prompts of a block, and from the raw
measurements the summary, the markdown tables and the plot. Nothing here imports vLLM (or torch), so
these run and are tested in the main environment too.

A *block* is one (temperature, concurrency, repeat): every method runs the block's same ``c`` prompts
at once, one method after the other, in an order rotated from repeat to repeat. Per method and
(temperature, concurrency) the summary has, over the repeats: the median output tokens/s with a 95%
percentile-bootstrap interval (``specdecpp.analysis.stats``, repeats resampled), the median of the
per-block ratios to target-only with its interval (paired: a block's ratio compares the two methods on
the same prompts, timed one after the other), and the median and 90th percentile of every request's
time per output token.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdecpp.analysis.stats import bootstrap_interval

TARGET_ONLY = "target_only"
LOAD_AWARE = "+load_aware"
# An interval bootstrapped from fewer values is marked, as infer.report marks one from few prompts.
FEW_VALUES = 10
FEW_MARK = "†"
METHOD_HELP = ("target_only | fixed_kN (vLLM's own draft_model/eagle3 at K=N) | ngram or ngram_kN (vLLM's n-gram "
               "lookup, K=N, default --max-candidates) | svip or svip:THRESHOLD | online or online:THRESHOLD "
               "(vLLM's online acceptance estimator as the stop rule) | head:PATH or head:PATH@THRESHOLD; "
               "svip, online, head and fixed_kN take a +load_aware suffix (fixed_kN+load_aware: the library's "
               "FixedK(N) as the cap of load-aware lengths)")


@dataclass(frozen=True)
class Method:
    """One method of the benchmark, parsed from its name (:func:`parse_method`)."""

    name: str                     # as given: the label of its rows
    kind: str                     # target_only | fixed_k | ngram | svip | online | head
    k: int | None = None          # fixed_k's K, ngram's K (None: --max-candidates)
    threshold: float | None = None  # svip / online / head (None: the command's default)
    head: str | None = None       # head's path
    load_aware: bool = False

    @property
    def ours(self) -> bool:
        """Sent through ``specdecpp.vllm.speculative_config`` (a stop policy of the library's)."""
        return self.kind in ("svip", "online", "head") or (self.kind == "fixed_k" and self.load_aware)


def _threshold(name: str, text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise ValueError(f"method {name!r}: threshold {text!r} is not a number") from None
    if not 0 <= value <= 1:
        raise ValueError(f"method {name!r}: threshold must be in [0, 1], got {value}")
    return value


def parse_method(name: str) -> Method:
    """The :class:`Method` a name stands for; a ValueError naming the accepted forms otherwise."""
    if not isinstance(name, str) or not name.strip():
        raise ValueError(f"empty method name; methods: {METHOD_HELP}")
    base, load_aware = (name[:-len(LOAD_AWARE)], True) if name.endswith(LOAD_AWARE) else (name, False)
    method: Method | None = None
    if base == TARGET_ONLY:
        method = Method(name, "target_only")
    elif m := re.fullmatch(r"fixed_k([1-9][0-9]*)", base):
        method = Method(name, "fixed_k", k=int(m.group(1)))
    elif m := re.fullmatch(r"ngram(?:_k([1-9][0-9]*))?", base):
        method = Method(name, "ngram", k=int(m.group(1)) if m.group(1) else None)
    elif m := re.fullmatch(r"(svip|online)(?::(.+))?", base):
        method = Method(name, m.group(1), threshold=_threshold(name, m.group(2)) if m.group(2) else None)
    elif base.startswith("head:"):
        path, threshold = base[len("head:"):], None
        if "@" in path:
            path, text = path.rsplit("@", 1)
            threshold = _threshold(name, text)
        if not path:
            raise ValueError(f"method {name!r}: head:PATH needs the head's directory (or hub id)")
        method = Method(name, "head", head=path, threshold=threshold)
    if method is None:
        raise ValueError(f"unknown method {name!r}; methods: {METHOD_HELP}")
    if load_aware:
        if method.kind in ("target_only", "ngram"):
            raise ValueError(f"method {name!r}: {LOAD_AWARE} applies to the library's stop policies (fixed_kN, svip, "
                             f"online, head:PATH), not to {method.kind}")
        method = Method(**{**method.__dict__, "load_aware": True})
    return method


def parse_methods(names: list[str]) -> list[Method]:
    """Every name parsed; refused: none, a repeated name, no ``target_only`` (every ratio and the greedy
    check are against it)."""
    if not names:
        raise ValueError(f"no methods given; methods: {METHOD_HELP}")
    repeated = sorted({n for n in names if names.count(n) > 1})
    if repeated:
        raise ValueError(f"methods given twice: {repeated}")
    methods = [parse_method(n) for n in names]
    if not any(m.kind == "target_only" for m in methods):
        raise ValueError("the methods must include target_only: every ratio and the greedy-equality check are "
                         "against it")
    return methods


def check_concurrency(levels: list[int]) -> list[int]:
    """The concurrency levels, each a positive integer, distinct; refused when empty."""
    if not levels:
        raise ValueError("--concurrency needs at least one level, e.g. --concurrency 1 4 16 64")
    if any(isinstance(c, bool) or not isinstance(c, int) or c < 1 for c in levels):
        raise ValueError(f"--concurrency levels must be positive integers, got {levels}")
    if len(set(levels)) < len(levels):
        raise ValueError(f"--concurrency levels given twice: {levels}")
    return list(levels)


def block_order(names: list[str], repeat: int) -> list[str]:
    """The methods' order in repeat ``repeat``'s blocks: the list rotated by ``repeat`` places, so over
    len(names) repeats every method runs once in every position (load drift and a warm cache then touch
    them alike)."""
    if not names:
        return []
    shift = repeat % len(names)
    return list(names[shift:]) + list(names[:shift])


def block_prompts(n_prompts: int, concurrency: int, repeat: int) -> list[int]:
    """Indices of the prompts of block (concurrency, repeat): ``concurrency`` consecutive prompts from
    ``repeat * concurrency``, wrapping around (every method of the block gets the same ones)."""
    if n_prompts < 1:
        raise ValueError("no prompts to send")
    start = repeat * concurrency
    return [(start + i) % n_prompts for i in range(concurrency)]


def greedy_mismatches(outputs: dict[str, list[list[int]]]) -> dict[str, list[int]]:
    """For one greedy block, the requests (indices) whose tokens differ from target-only's, by method;
    methods that match everywhere are left out."""
    reference = outputs[TARGET_ONLY]
    out = {}
    for name, tokens in outputs.items():
        if len(tokens) != len(reference):
            raise ValueError(f"{name}: {len(tokens)} outputs for {len(reference)} requests")
        wrong = [q for q, (a, b) in enumerate(zip(tokens, reference, strict=True)) if list(a) != list(b)]
        if wrong:
            out[name] = wrong
    return out


def interval(values, level: float = 0.95, seed: int = 0) -> tuple[float, float] | None:
    """Percentile-bootstrap interval of the median of ``values`` (repeats resampled); None below 2 values."""
    values = np.asarray(values, dtype=float)
    if len(values) < 2:
        return None
    return bootstrap_interval(np.median, values, level=level, seed=seed)


def _percentile(values, q: float) -> float | None:
    values = [v for v in values if v is not None]
    return float(np.percentile(values, q)) if values else None


def summarize(blocks: list[dict], mismatches: dict | None = None) -> list[dict]:
    """One entry per (temperature, concurrency, method) from the raw blocks (``infer.serve``'s records:
    temperature, concurrency, repeat, method, output_tokens, wall_s, tokens_per_s, requests with tpot_s,
    spec counters), in the order the methods were given. ``mismatches``: {(temperature, concurrency,
    method): [repeat, request] pairs whose greedy output differs from target-only's}."""
    mismatches = mismatches or {}
    names = list(dict.fromkeys(b["method"] for b in blocks))
    cells = sorted({(b["temperature"], b["concurrency"]) for b in blocks})
    out = []
    for temperature, concurrency in cells:
        here = [b for b in blocks if (b["temperature"], b["concurrency"]) == (temperature, concurrency)]
        base = {b["repeat"]: b for b in here if b["method"] == TARGET_ONLY}
        for name in names:
            mine = sorted((b for b in here if b["method"] == name), key=lambda b: b["repeat"])
            if not mine:
                continue
            tps = [b["tokens_per_s"] for b in mine]
            ratios = [b["tokens_per_s"] / base[b["repeat"]]["tokens_per_s"] for b in mine if b["repeat"] in base]
            tpots = [r["tpot_s"] for b in mine for r in b["requests"] if r.get("tpot_s") is not None]
            drafted = sum(b.get("spec", {}).get("num_draft_tokens", 0) for b in mine)
            accepted = sum(b.get("spec", {}).get("num_accepted_tokens", 0) for b in mine)
            drafts = sum(b.get("spec", {}).get("num_drafts", 0) for b in mine)
            # decode steps: each commits its accepted candidates + 1 token; the first token comes from the prefill
            steps = sum(b["output_tokens"] - len(b["requests"]) for b in mine) - accepted
            wrong = mismatches.get((temperature, concurrency, name), [])
            out.append({
                "temperature": temperature, "concurrency": concurrency, "method": name, "repeats": len(mine),
                "tokens_per_s": float(np.median(tps)), "tokens_per_s_ci95": interval(tps),
                "ratio": float(np.median(ratios)) if ratios else None,
                "ratio_ci95": interval(ratios) if name != TARGET_ONLY else None,
                "tpot_median_s": _percentile(tpots, 50), "tpot_p90_s": _percentile(tpots, 90),
                "requests": sum(len(b["requests"]) for b in mine),
                "output_tokens": sum(b["output_tokens"] for b in mine),
                "acceptance": accepted / drafted if drafted else None,
                "accepted_per_draft": accepted / drafts if drafts else None,
                "drafted_per_step": drafted / steps if drafted and steps > 0 else None,
                "greedy_checked": temperature == 0 and name != TARGET_ONLY,
                "greedy_mismatches": [list(w) for w in wrong],
            })
    return out


def overview(entries: list[dict], top_k: int | None = None) -> str:
    """One table per temperature: each method's ratio to target-only (paired 95% interval) at every
    concurrency, target-only's tokens/s in its own row; a method whose greedy output differed reads
    "not reported", and the best method of each column is in bold (by median, target-only included)."""
    out = []
    for temperature in sorted({e["temperature"] for e in entries}):
        mine = [e for e in entries if e["temperature"] == temperature]
        levels = sorted({e["concurrency"] for e in mine})
        names = list(dict.fromkeys(e["method"] for e in mine))
        cell = {(e["method"], e["concurrency"]): e for e in mine}
        best = {}
        for c in levels:
            ok = [e for e in mine if e["concurrency"] == c and not e["greedy_mismatches"] and e["ratio"] is not None]
            if ok:
                best[c] = max(ok, key=lambda e: e["ratio"])["method"]
        rows = [f"### {sampling_label(temperature, top_k)}: ratio to target-only", "",
                "| method | " + " | ".join(f"c={c}" for c in levels) + " |", "|---" * (len(levels) + 1) + "|"]
        for name in names:
            cells = []
            for c in levels:
                e = cell.get((name, c))
                if e is None:
                    text = "-"
                elif e["greedy_mismatches"]:
                    text = "not reported"
                elif name == TARGET_ONLY:
                    text = f"1 ({e['tokens_per_s']:.1f} tok/s)"
                else:
                    text = "-" if e["ratio"] is None else f"{e['ratio']:.2f}x{_ci(e['ratio_ci95'], e['repeats'], 2)}"
                cells.append(f"**{text}**" if best.get(c) == name else text)
            rows.append(f"| {name} | " + " | ".join(cells) + " |")
        out.append("\n".join(rows))
    return "\n\n".join(out)


def _ci(ci, n: int, digits: int) -> str:
    if not ci:
        return ""
    return f" [{ci[0]:.{digits}f}, {ci[1]:.{digits}f}]" + (FEW_MARK if n < FEW_VALUES else "")


def _ms(seconds: float | None) -> str:
    return "-" if seconds is None else f"{seconds * 1e3:.1f}"


def sampling_label(temperature: float, top_k: int | None) -> str:
    return "greedy (T=0)" if temperature == 0 else f"T={temperature:g}" + (f", top-k {top_k}" if top_k else "")


def table(entries: list[dict]) -> str:
    """The markdown table of one (temperature, concurrency): a method whose greedy output differs from
    target-only's gets no figures, only what differed (a speed of a wrong output is not reported)."""
    rows = ["| method | output tok/s (median, 95% CI) | ratio to target-only (paired 95% CI) | TPOT median (ms) | "
            "TPOT p90 (ms) | acceptance | accepted per draft | drafted per step | greedy output |",
            "|---|---|---|---|---|---|---|---|---|"]
    for e in entries:
        check = ("differs from target-only: " + ", ".join(f"repeat {r} request {q}" for r, q in
                                                            e["greedy_mismatches"][:4])
                 + (" ..." if len(e["greedy_mismatches"]) > 4 else "")) if e["greedy_mismatches"] else \
            ("= target-only" if e["greedy_checked"] else "-")
        if e["greedy_mismatches"]:
            rows.append(f"| {e['method']} | not reported | not reported | - | - | - | - | - | {check} |")
            continue
        ratio = "1" if e["method"] == TARGET_ONLY else \
            ("-" if e["ratio"] is None else f"{e['ratio']:.3f}x{_ci(e['ratio_ci95'], e['repeats'], 3)}")
        acc = "-" if e["acceptance"] is None else f"{e['acceptance']:.3f}"
        per = "-" if e["accepted_per_draft"] is None else f"{e['accepted_per_draft']:.2f}"
        length = "-" if e.get("drafted_per_step") is None else f"{e['drafted_per_step']:.2f}"
        rows.append(f"| {e['method']} | {e['tokens_per_s']:.1f}{_ci(e['tokens_per_s_ci95'], e['repeats'], 1)} | "
                    f"{ratio} | {_ms(e['tpot_median_s'])} | {_ms(e['tpot_p90_s'])} | {acc} | {per} | {length} | "
                    f"{check} |")
    return "\n".join(rows)


ONE_AT_A_TIME = ("one engine at a time: within a repeat each method's engine runs all its blocks, then the next "
                 "method's, their order rotated from repeat to repeat")
HELD_AT_ONCE = ("one engine per method, all held at once: the methods interleaved within each (temperature, "
                "concurrency, repeat) block, their order rotated from repeat to repeat")


def report(result: dict) -> str:
    """The markdown report of a run: what was run, on which machine, then one table per (temperature,
    concurrency)."""
    s = result["settings"]
    unfinished = ("" if result.get("complete", True) else
                  f" (**unfinished: {result.get('repeats_done', 0)} done**; rerun the command to go on)")
    one_at_a_time = str(s["engine"].get("engines", "")).startswith("one")
    lines = ["# Serving benchmark (`python -m infer.serve`)", "",
             f"- machine: {result['machine']}",
             f"- date: {result['date']}; vLLM {result.get('vllm_version', '?')}",
             f"- command: `{result['command']}`",
             f"- pair: draft `{s['draft']}`, target `{s['target']}`" + (" (feature draft, vLLM's eagle3)"
                                                                       if s.get("feature_draft") else ""),
             f"- prompts: {s['prompts']} (test split, {s['n_prompts']} prompts, target's chat template); "
             f"up to {s['max_new_tokens']} new tokens" + (", EOS ignored" if s.get("ignore_eos") else ""),
             f"- repeats: {s['repeats']}{unfinished}; " + (ONE_AT_A_TIME if one_at_a_time else HELD_AT_ONCE),
             "- engines: " + ", ".join(f"{k}={v}" for k, v in s["engine"].items()),
             "", "Columns: output tok/s is a block's output tokens over the wall time of its one "
             "`llm.generate` call of `c` prompts (median over repeats, 95% percentile bootstrap over repeats); "
             "the ratio is the median of the per-block ratios to target-only (paired: same prompts, same block); "
             "TPOT is vLLM's time per output token of each request, (last token - first token) / (tokens - 1), "
             "over all requests of all repeats; acceptance is vLLM's accepted / drafted tokens; drafted per step is "
             "drafted tokens / decode steps (output tokens - accepted - 1 per request: steps that drafted nothing "
             "count, so load-aware lengths shrinking toward 0 show here). "
             f"{FEW_MARK}: bootstrapped from fewer than {FEW_VALUES} repeats, a rough interval. At T=0 every "
             "request's tokens are compared with target-only's in the same block; a method that differs gets "
             "no figures."]
    for note in result.get("notes", []):
        lines += ["", note]
    summary = result["summary"]
    lines += ["", "## Overview", "", overview(summary, s.get("top_k"))]
    for temperature, concurrency in sorted({(e["temperature"], e["concurrency"]) for e in summary}):
        entries = [e for e in summary if (e["temperature"], e["concurrency"]) == (temperature, concurrency)]
        lines += ["", f"## {sampling_label(temperature, s.get('top_k'))}, concurrency {concurrency}", "",
                  table(entries)]
    if result.get("plot"):
        lines += ["", f"![output tokens/s against concurrency]({result['plot']})"]
    return "\n".join(lines) + "\n"


def plot(summary: list[dict], path: Path, title: str = "", top_k: int | None = None) -> Path:
    """Output tokens/s against concurrency (log axis), one line per method with its 95% interval as
    error bars, one panel per temperature; methods whose greedy output differs are left out."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    temperatures = sorted({e["temperature"] for e in summary})
    fig, axes = plt.subplots(1, len(temperatures), figsize=(6 * len(temperatures), 4.2), squeeze=False)
    for ax, temperature in zip(axes[0], temperatures, strict=True):
        here = [e for e in summary if e["temperature"] == temperature]
        for name in dict.fromkeys(e["method"] for e in here):
            points = sorted((e for e in here if e["method"] == name and not e["greedy_mismatches"]),
                            key=lambda e: e["concurrency"])
            if not points:
                continue
            xs = [e["concurrency"] for e in points]
            ys = [e["tokens_per_s"] for e in points]
            lo = [y - (e["tokens_per_s_ci95"] or (y, y))[0] for y, e in zip(ys, points, strict=True)]
            hi = [(e["tokens_per_s_ci95"] or (y, y))[1] - y for y, e in zip(ys, points, strict=True)]
            style = {"color": "black", "linestyle": "--"} if name == TARGET_ONLY else {}
            ax.errorbar(xs, ys, yerr=[lo, hi], marker="o", capsize=3, label=name, **style)
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted({e["concurrency"] for e in here}), [str(c) for c in sorted({e["concurrency"]
                                                                                          for e in here})])
        ax.set_xlabel("concurrent requests")
        ax.set_ylabel("output tokens/s")
        ax.set_title(sampling_label(temperature, top_k))
        ax.grid(True, alpha=0.3)
        ax.legend(fontsize=7)
    if title:
        fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
