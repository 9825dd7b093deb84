"""python -m infer.potential DATA_DIR [--cost-ratio R | --costs FILE] [--head DIR ...] [--out DIR]
   python -m infer.potential DATA_DIR [--cost-ratio R | --costs FILE] --whatif-gammas G ... [--whatif-ratios C ...]

"Can a learned stop predictor pay off on my pair?", answered from a data_gen dataset alone, before
any decoding: replays speculative rounds along each labelled response with Bernoulli(P_i)
acceptances (``specdecpp.analysis.potential``) for fixed K 1..10, the informed Algorithm 2 (a perfect head
with the real head's one-candidate lag), the same perfect head without the lag, trained heads
(``--head``, run on the draft's features
of the same data), SVIP from the stored draft entropy and the hindsight oracle. Speedups by
Eq. 2.3 at the cost ratio, with 95% bootstrap intervals over prompts, and with the measured
width-dependent target cost when ``--costs`` has one. Writes potential.md, potential.json and
potential.png to ``--out`` (default: DATA_DIR/potential) and prints the table.

``--costs FILE``: the pair's ``costs.json`` (``specdecpp.analysis.costmodel``: ``t_draft`` and ``t_target``,
seconds per forward, and optionally ``target_by_width``, the target scoring n tokens after a cached
prefix), as written by ``python -m infer.costs --costs-out FILE``; a ``summary.json`` of
``infer.report`` also works (its first fitted group's t_draft and t_target).

``--whatif-gammas G ...``: instead, the what-if grid (``infer.whatif``): how much more would the
draft have to accept for learned stopping to pay off? Every label P_i raised to each gamma, at the
cost ratio of ``--costs`` / ``--cost-ratio`` and each of ``--whatif-ratios``; writes whatif.md,
whatif.json and whatif.png to ``--out`` (default: DATA_DIR/whatif).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from specdecpp.analysis import potential as pt
from specdecpp.analysis.costmodel import Costs, load_costs

from . import whatif

DEFAULT_THRESHOLDS = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
DEFAULT_SVIP = (0.2, 0.3, 0.4, 0.5, 0.6, 0.7)
WHATIF_BELOW = 0.05  # an informed margin under this gets a verdict line pointing to the what-if grid


def dataset_rows(data_dir: str | Path, split: str, limit: int | None = None) -> tuple[list[dict], dict, list]:
    """Rows of one split (or every split with ``all``) as numpy arrays, the meta, the raw rows."""
    from specdecpp.data.dataset import load_labelled

    splits, meta = load_labelled(data_dir)
    names = list(splits) if split == "all" else [split]
    missing = [n for n in names if n not in splits]
    if missing:
        raise ValueError(f"dataset {str(data_dir)!r} has no split {missing[0]!r}; it has {sorted(splits)}")
    raw = []
    for name in names:
        ds = splits[name]
        raw += [dict(ds[i], row=i, split=name) for i in range(len(ds))]
    if limit:
        raw = raw[:limit]
    # a feature draft's labels by depth ([N, D]: a round's j-th candidate reads depth j; analysis.potential)
    by_depth = bool(raw) and "depth_p_acc" in raw[0]
    rows = [{"p_acc": np.asarray(r["depth_p_acc" if by_depth else "p_acc"], dtype=np.float64),
             "draft_entropy": np.asarray(r["depth_draft_entropy" if by_depth else "draft_entropy"], dtype=np.float64)}
            for r in raw if len(r["p_acc"])]
    return rows, meta, [r for r in raw if len(r["p_acc"])]


def mean_p(rows: list[dict]) -> dict:
    """mean P over the labelled positions (a feature draft's: at depth 1, the first candidate of a
    round, and ``mean_p_acc_by_depth`` at each depth 1..D)."""
    p = np.concatenate([r["p_acc"] for r in rows])
    if p.ndim == 1:
        return {"mean_p_acc": float(p.mean())}
    by_depth = [float(np.nanmean(p[:, d])) for d in range(p.shape[1])]
    return {"mean_p_acc": by_depth[0], "mean_p_acc_by_depth": by_depth}


HEAD_CONTEXTS = ("mixed", "target")


def head_labels(heads) -> list[str]:
    """Each head directory's name in the tables: its last path component, or as many trailing
    components as it takes to tell heads of the same name apart (heads/a/next_wrej1_d1 and
    heads/b/next_wrej1_d1 -> a/next_wrej1_d1, b/next_wrej1_d1)."""
    parts = [Path(h).resolve().parts for h in heads]
    if len(set(parts)) != len(parts):
        raise ValueError(f"--head lists one head directory twice: {[str(h) for h in heads]}")
    labels = []
    for p in parts:
        n = 1
        while sum(q[-n:] == p[-n:] for q in parts) > 1:
            n += 1
        labels.append("/".join(p[-n:]))
    return labels


def heads_predictions(head_dirs: list[str], raw_rows: list[dict], meta: dict, draft_ref: str | None = None,
                      mix_ratio: float = 0.15, mix_seed: int = 0, batch_size: int = 8,
                      context: str = "mixed") -> list[list[np.ndarray]]:
    """Each head's P_hat at every position, from the draft's features of the same data; the draft
    is loaded and run once for all heads.

    ``context="mixed"`` (default): features follow train's token mixing (Z_i = X_i with probability
    ``mix_ratio``); a position whose mixing took X_i gets its feature from the next mixing draw
    (epoch 1, 2, ...), so every position is scored from a context like the one train and validation
    use. ``context="target"``: a lag-free head scores Y_i from the draft state after x, X_<i, the
    context the label was made in and the one the replayed rounds assume (``data.feature_context=
    target``); the paper's head, which needs the state at Y_i, keeps the mixed context.
    """
    import torch

    from specdecpp.models.loading import load_model
    from specdecpp.stopping.head import load_head
    from specdecpp.training.mixing import (
        draft_features,
        lag_free_features,
        mixed_example,
        mixing_mask,
        target_context_features,
    )

    if context not in HEAD_CONTEXTS:
        raise ValueError(f"--head-context must be one of {list(HEAD_CONTEXTS)}, got {context!r}")
    heads = [load_head(h) for h in head_dirs]
    if meta.get("feature_depths"):
        return feature_heads_predictions(heads, raw_rows, meta, draft_ref, batch_size)
    draft_ref = draft_ref or meta.get("draft")
    if not draft_ref:
        raise ValueError("--head needs the draft: the dataset's meta names none; pass --draft PATH")
    # the precision that labelled the data
    draft = load_model(draft_ref, device="cpu", dtype=meta.get("dtype", "float32"))
    for head in heads:
        head.attach(draft)
    preds = [[np.full(len(r["p_acc"]), np.nan) for r in raw_rows] for _ in heads]
    in_target = [context == "target" and head.lag == 0 for head in heads]
    if any(in_target):
        for a in range(0, len(raw_rows), batch_size):
            chunk = [{**raw_rows[j], **{c: torch.as_tensor(raw_rows[j][c]) for c in
                                        ("prompt_ids", "target_ids", "draft_ids", "p_acc")}}
                     for j in range(a, min(a + batch_size, len(raw_rows)))]
            for head, out, use in zip(heads, preds, in_target, strict=True):
                if use:
                    feats, _ = target_context_features(draft, chunk, head.feature_spec())
                    with torch.no_grad():
                        for j, f in enumerate(feats, start=a):
                            out[j][:] = torch.sigmoid(head(f.float())).reshape(-1).double().numpy()
        if all(in_target):
            return preds
    filled = [np.zeros(len(r["p_acc"]), dtype=bool) for r in raw_rows]
    for epoch in range(8):
        todo = [j for j, f in enumerate(filled) if not f.all()]
        if not todo:
            break
        ratio = mix_ratio if epoch < 7 else 0.0  # the last pass feeds the draft tokens everywhere
        for a in range(0, len(todo), batch_size):
            chunk = todo[a : a + batch_size]
            examples = []
            for j in chunk:
                r = raw_rows[j]
                mask = mixing_mask(len(r["target_ids"]), ratio, mix_seed, epoch, int(r["row"]))
                examples.append((mixed_example(r["prompt_ids"], r["target_ids"], r["draft_ids"], r["p_acc"], mask),
                                 mask))
            # the states at each candidate (the paper's head) and one earlier (the lag-free head's)
            both = draft_features(draft, [e[0][0] for e in examples],
                                  [torch.cat([e[0][1], e[0][1] - 1]) for e in examples])
            with torch.no_grad():
                for j, h, ((seq, pos, _), mask) in zip(chunk, both, examples, strict=True):
                    at, before = h[: len(pos)], h[len(pos) :]
                    keep = (~mask).nonzero().squeeze(-1).numpy()
                    new = keep[~filled[j][keep]]
                    fill = ~filled[j][keep]
                    for head, out, done in zip(heads, preds, in_target, strict=True):
                        if done:
                            continue
                        x = at if head.lag else lag_free_features(draft, before, seq[pos], head.feature_spec(),
                                                                   pos - len(raw_rows[j]["prompt_ids"]))
                        out[j][new] = torch.sigmoid(head(x.float())).reshape(-1).double().numpy()[fill]
                    filled[j][new] = True
    return preds


def feature_heads_predictions(heads, raw_rows: list[dict], meta: dict, draft_ref: str | None,
                              batch_size: int) -> list[list[np.ndarray]]:
    """A feature draft's labels: each head's P_hat at every (position, depth) [N, D] (NaN where there
    is no label; the paper's head from the state after each candidate), from the features train
    computes (the labels' own context, specdecpp.training.mixing.feature_draft_head_features)."""
    import torch

    from specdecpp.models.feature_draft import FeatureDraft
    from specdecpp.models.identity import resolve_model
    from specdecpp.models.loading import load_model
    from specdecpp.training.mixing import feature_draft_head_features

    draft_ref = draft_ref or meta.get("draft")
    if not draft_ref or not meta.get("target"):
        raise ValueError("--head on a feature draft's labels needs its draft and target (the dataset's meta, or "
                         "--draft)")
    dtype = meta.get("dtype", "float32")
    target = load_model(str(meta["target"]), device="cpu", dtype=dtype)
    draft = FeatureDraft.from_pretrained(resolve_model(str(draft_ref)), target=target)
    for head in heads:
        head.attach(draft)
    preds = [[] for _ in heads]
    for a in range(0, len(raw_rows), batch_size):
        chunk = raw_rows[a:a + batch_size]
        for head, out in zip(heads, preds, strict=True):
            feats, _ = feature_draft_head_features(draft, target, chunk, {**head.feature_spec(), "context": "target"})
            for r, f in zip(chunk, feats, strict=True):
                p_acc = np.asarray(r["depth_p_acc"], dtype=np.float64)
                pred = np.full(p_acc.shape, np.nan)
                if len(f):
                    with torch.no_grad():
                        pred[~np.isnan(p_acc)] = torch.sigmoid(head(f.float())).reshape(-1).double().numpy()
                out.append(pred)
    return preds


def head_predictions(head_dir: str, raw_rows: list[dict], meta: dict, draft_ref: str | None = None,
                     **kwargs) -> list[np.ndarray]:
    """One head's P_hat at every position (see :func:`heads_predictions`)."""
    return heads_predictions([head_dir], raw_rows, meta, draft_ref, **kwargs)[0]


def policies(max_k: int, thresholds, svip_thresholds, heads: list[str],
             lags: dict[str, int] | None = None) -> list[pt.Policy]:
    """The compared policies; ``lags[name]`` is each head's lag (1, the paper's head, by default)."""
    out = [pt.fixed_k(k) for k in range(1, max_k + 1)]
    out += [pt.informed(h) for h in thresholds]
    out += [pt.informed_lag_free(h) for h in thresholds]
    for name in heads:
        out += [pt.head_rule(name, h, lag=(lags or {}).get(name, 1)) for h in thresholds]
    out += [pt.svip(h) for h in svip_thresholds]
    out.append(pt.oracle())
    return out


def _ci(lo_hi) -> str:
    return f"[{lo_hi[0]:.3f}, {lo_hi[1]:.3f}]"


def report_markdown(records: list[dict], context: dict) -> str:
    width = any("speedup_by_width" in r for r in records)
    cols = ["policy", "settings", "verification rate", "discard rate", "tokens/round",
            f"Eq. 2.3 speedup (c = {context['cost_ratio']:.3f})", "95% CI"]
    if width:
        cols += ["speedup, t_target(n)", "95% CI"]
    lines = [f"# Stop potential: {context['data']}", "",
             f"Split `{context['split']}`: {context['prompts']} prompts, {context['positions']} labelled positions, "
             f"mean P = {context['mean_p_acc']:.3f}"
             + (" (a feature draft's, at depths 1..{}: {})".format(len(context["mean_p_acc_by_depth"]), ", ".join(
                 f"{v:.3f}" for v in context["mean_p_acc_by_depth"])) if "mean_p_acc_by_depth" in context else "")
             + f"; {context['seeds']} seeds of Bernoulli(P_i) acceptances per prompt "
             f"(every policy sees the same draws). Cost ratio t_draft / t_target = {context['cost_ratio']:.4f} "
             f"({context['cost_source']}). Intervals: 95% bootstrap over prompts."
             + (f" Lag-free heads' features in the {context['head_context']} context."
                if context.get("head_context", "mixed") != "mixed" else ""),
             "",
             "| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    for r in records:
        settings = ", ".join(f"{k}={v}" for k, v in r["settings"].items()) or "-"
        cells = [r["name"], settings, f"{r['verification_rate']:.3f}", f"{r['discard_rate']:.3f}",
                 f"{r['tokens_per_round']:.2f}", f"{r['speedup']:.3f}x", _ci(r["speedup_ci95"])]
        if width:
            cells += [f"{r['speedup_by_width']:.3f}x", _ci(r["speedup_by_width_ci95"])]
        lines.append("| " + " | ".join(cells) + " |")
    lines += ["", "## Best of each policy", ""]
    for line in context["best_lines"]:
        lines.append(f"- {line}")
    return "\n".join(lines) + "\n"


def plot(records: list[dict], path: Path, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(12, 4.8))
    families: dict[str, list[dict]] = {}
    for r in records:
        families.setdefault(r["name"], []).append(r)
    colors = {"fixed_k": "tab:blue", "informed": "black", "informed_lag_free": "tab:gray", "svip": "tab:green",
              "oracle": "gold"}
    for i, (name, recs) in enumerate(families.items()):
        color = colors.get(name, plt.cm.tab10((i + 3) % 10))
        xs, ys = [r["discard_rate"] for r in recs], [r["verification_rate"] for r in recs]
        ax.plot(xs, ys, marker="*" if name == "oracle" else "o", color=color, label=name, ms=5,
                ls="-" if len(recs) > 1 else "none")
    ax.set_xlabel("discard rate N_discarded / N")
    ax.set_ylabel("verification rate N_target / N")
    ax.set_title("Pareto plane (lower left is better)")
    ax.legend(fontsize=8)
    names = list(families)
    bests = [max(families[n], key=lambda r: r["speedup"]) for n in names]
    vals = [b["speedup"] for b in bests]
    err = np.array([[b["speedup"] - b["speedup_ci95"][0], b["speedup_ci95"][1] - b["speedup"]] for b in bests]).T
    bx.bar(range(len(names)), vals, yerr=err, color=[colors.get(n, "tab:red") for n in names], capsize=4)
    bx.axhline(1.0, color="gray", lw=0.8)
    bx.set_xticks(range(len(names)), [f"{n}\n{b['label'][len(n):].strip()}" for n, b in zip(names, bests, strict=True)],
                  fontsize=7)
    bx.set_ylabel("Eq. 2.3 speedup over target-only (best setting, 95% CI)")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    fig.savefig(path, dpi=120)
    plt.close(fig)


@dataclass(frozen=True)
class PotentialConfig:
    """How :func:`run` replays the stop policies on a dataset: its command-line settings (built
    from them in :func:`main`)."""

    split: str = "test"                 # train, dev, test or all
    cost_ratio: float | None = None     # t_draft / t_target for Eq. 2.3 (or run's costs_file)
    seeds: int = 5                      # Bernoulli replays of every response
    max_k: int = 10                     # fixed K 1..max_k
    thresholds: tuple[float, ...] = DEFAULT_THRESHOLDS      # the informed policy's and each head's
    svip_thresholds: tuple[float, ...] = DEFAULT_SVIP
    limit: int | None = None            # only the first N prompts
    n_boot: int = 1000                  # bootstrap resamples of the 95% intervals
    head_context: str = "mixed"         # where a lag-free head's features come from (HEAD_CONTEXTS)
    quiet: bool = False                 # print nothing


def run(data_dir: str, config: PotentialConfig = PotentialConfig(), *, costs_file: str | None = None,
        heads: list[str] = (), draft: str | None = None, out: str | None = None) -> dict:
    """The replay of ``data_dir``'s labels under every policy (and each trained head of ``heads``,
    run on ``draft``, default the dataset's), priced by ``config.cost_ratio`` or the measured
    ``costs_file``; writes potential.md, .json and .png to ``out`` (default DATA_DIR/potential)."""
    c = config
    split, seeds, head_context = c.split, c.seeds, c.head_context
    if (c.cost_ratio is None) == (costs_file is None):
        raise ValueError("give exactly one of --cost-ratio R or --costs FILE")
    costs = Costs.from_ratio(c.cost_ratio) if costs_file is None else load_costs(costs_file)
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    from specdecpp.stopping.head import load_head

    head_names = head_labels(heads)  # each head loads (and a broken one is named) before the data and the draft
    lags = {name: load_head(h).lag for name, h in zip(head_names, heads, strict=True)}  # paper's head 1, lag-free 0
    rows, meta, raw = dataset_rows(data_dir, split, c.limit)
    if not rows:
        raise ValueError(f"dataset {str(data_dir)!r}, split {split!r}: no labelled positions")
    for name, preds in zip(head_names, heads_predictions(list(heads), raw, meta, draft, context=head_context)
                           if heads else [], strict=True):
        for row, p in zip(rows, preds, strict=True):
            row["pred:" + name] = p
    pols = policies(c.max_k, c.thresholds, c.svip_thresholds, head_names, lags)
    t0 = time.perf_counter()
    results = pt.simulate(rows, pols, seeds=range(seeds))
    records = pt.summarise(results, pols, costs, n_boot=c.n_boot)
    fixed = pt.best(records, "fixed_k")
    best_lines, margins = [], {}
    for name in dict.fromkeys(r["name"] for r in records):
        b = pt.best(records, name)
        line = f"{name}: best {b['label']} at {b['speedup']:.3f}x {_ci(b['speedup_ci95'])}"
        if name != "fixed_k":
            lo_hi = pt.margin_interval(results[b["label"]], results[fixed["label"]], costs, n_boot=c.n_boot)
            margin = b["speedup"] / fixed["speedup"] - 1
            margins[name] = {"margin": margin, "ci95": lo_hi, "setting": b["label"]}
            line += (f", {100 * margin:+.1f}% vs best fixed K ({fixed['label']}), "
                     f"95% CI [{100 * lo_hi[0]:+.1f}%, {100 * lo_hi[1]:+.1f}%]")
        best_lines.append(line)
    margins_by_width = {}
    if costs.target_by_width:  # the same comparison at the measured width curve (what tokens/s on this machine sees)
        fw = pt.best(records, "fixed_k", "speedup_by_width")
        for name in dict.fromkeys(r["name"] for r in records):
            if name in ("fixed_k", "oracle"):
                continue
            b = pt.best(records, name, "speedup_by_width")
            margin = b["speedup_by_width"] / fw["speedup_by_width"] - 1
            lo_hi = pt.margin_interval(results[b["label"]], results[fw["label"]], costs, by_width=True, n_boot=c.n_boot)
            margins_by_width[name] = {"margin": margin, "ci95": lo_hi, "setting": b["label"]}
            best_lines.append(f"with t_target(n): {name} best {b['label']} {b['speedup_by_width']:.3f}x vs fixed K "
                              f"{fw['label']} {fw['speedup_by_width']:.3f}x ({100 * margin:+.1f}%, 95% CI "
                              f"[{100 * lo_hi[0]:+.1f}%, {100 * lo_hi[1]:+.1f}%])")
    informed, lag_free = margins.get("informed"), margins.get("informed_lag_free")
    if informed and lag_free and informed["margin"] < WHATIF_BELOW:
        best_lines.append(
            f"verdict: even a perfect head with Algorithm 2's lag is {100 * informed['margin']:+.1f}% over fixed K "
            f"here (the paper's pair: +7-11%), without the lag {100 * lag_free['margin']:+.1f}%; how much more the "
            f"draft would have to accept: python -m infer.potential {data_dir} --split {split} "
            f"--cost-ratio {costs.ratio:.3f} --whatif-gammas 1 0.6 0.3 0.1 --out WHATIF_DIR")
    context = {"data": str(data_dir), "split": split, "prompts": len(rows),
               "positions": int(sum(len(r["p_acc"]) for r in rows)),
               **mean_p(rows),
               "seeds": seeds, "cost_ratio": costs.ratio, "head_context": head_context,
               "cost_source": "given" if costs_file is None else f"measured, {costs_file}",
               "best_lines": best_lines, "simulation_s": time.perf_counter() - t0}
    out_dir = Path(out) if out else Path(data_dir) / "potential"
    out_dir.mkdir(parents=True, exist_ok=True)
    md = report_markdown(records, context)
    (out_dir / "potential.md").write_text(md)
    payload = {"context": {k: v for k, v in context.items()},
               "costs": {"t_draft": costs.t_draft, "t_target": costs.t_target,
                         "target_by_width": costs.target_by_width}, "margins_vs_best_fixed_k": margins,
               "margins_vs_best_fixed_k_by_width": margins_by_width, "records": records}
    (out_dir / "potential.json").write_text(json.dumps(payload, indent=1) + "\n")
    plot(records, out_dir / "potential.png", f"{data_dir} ({split}): stop potential at c = {costs.ratio:.3f}")
    if not c.quiet:
        print(md)
        print(f"wrote {out_dir / 'potential.md'}, potential.json, potential.png")
    return {"records": records, "margins": margins, "margins_by_width": margins_by_width, "out": str(out_dir),
            "context": context}


def run_whatif(data_dir: str, split: str = "test", gammas=whatif.DEFAULT_GAMMAS, ratios=(),
               cost_ratio: float | None = None, costs_file: str | None = None, seeds: int = 5, max_k: int = 10,
               out: str | None = None, limit: int | None = None, quiet: bool = False) -> list[dict]:
    """The what-if grid (``infer.whatif``) at the measured or given cost ratio, then ``ratios``."""
    if cost_ratio is not None and costs_file is not None:
        raise ValueError("give at most one of --cost-ratio R or --costs FILE")
    if seeds < 1:
        raise ValueError(f"--seeds must be >= 1, got {seeds}")
    ratios = list(ratios)
    if cost_ratio is not None or costs_file is not None:
        c = round((Costs.from_ratio(cost_ratio) if costs_file is None else load_costs(costs_file)).ratio, 4)
        ratios = [c] + [r for r in ratios if r != c]
    rows, _, _ = dataset_rows(data_dir, split, limit)
    if not rows:
        raise ValueError(f"dataset {str(data_dir)!r}, split {split!r}: no labelled positions")
    return whatif.run(rows, str(data_dir), split, gammas, ratios, out or Path(data_dir) / "whatif", seeds, max_k, quiet)


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a data_gen output directory")
    ap.add_argument("--split", default="test", help="train, dev, test or all (default test)")
    ap.add_argument("--cost-ratio", type=float, help="t_draft / t_target for Eq. 2.3")
    ap.add_argument("--costs", help="JSON with measured t_draft, t_target (and target_by_width)")
    ap.add_argument("--head", action="append", default=[], help="a trained head directory (repeatable)")
    ap.add_argument("--draft", help="the draft model for --head (default: the dataset's)")
    ap.add_argument("--head-context", choices=HEAD_CONTEXTS, default="mixed",
                    help="where a lag-free head's features come from: mixed (train's token mixing, default) or "
                         "target (the labels' own context x, X_<i, as the replayed rounds assume)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--max-k", type=int, default=10)
    ap.add_argument("--thresholds", type=float, nargs="+", default=list(DEFAULT_THRESHOLDS))
    ap.add_argument("--svip-thresholds", type=float, nargs="+", default=list(DEFAULT_SVIP))
    ap.add_argument("--limit", type=int, help="only the first N prompts")
    ap.add_argument("--out", help="output directory (default DATA/potential, or DATA/whatif with --whatif-gammas)")
    ap.add_argument("--whatif-gammas", type=float, nargs="+", metavar="G",
                    help="run the what-if grid instead: labels P ** G for each G "
                         "(e.g. 1 0.8 0.6 0.45 0.3 0.2 0.1 0.05)")
    ap.add_argument("--whatif-ratios", type=float, nargs="+", default=[], metavar="C",
                    help="with --whatif-gammas: more cost ratios t_draft / t_target beside the measured one")
    args = ap.parse_args(argv)
    if args.whatif_ratios and not args.whatif_gammas:
        ap.error("--whatif-ratios needs --whatif-gammas")
    if args.whatif_gammas and args.head:
        ap.error("--head does not apply to the what-if grid (it replays perfect heads on raised labels)")
    try:
        if args.whatif_gammas:
            run_whatif(args.data, args.split, args.whatif_gammas, args.whatif_ratios, args.cost_ratio, args.costs,
                       args.seeds, args.max_k, args.out, args.limit)
        else:
            config = PotentialConfig(split=args.split, cost_ratio=args.cost_ratio, seeds=args.seeds, max_k=args.max_k,
                                     thresholds=tuple(args.thresholds), svip_thresholds=tuple(args.svip_thresholds),
                                     limit=args.limit, head_context=args.head_context)
            run(args.data, config, costs_file=args.costs, heads=args.head, draft=args.draft, out=args.out)
    except (ValueError, FileNotFoundError) as exc:
        sys.exit(f"infer.potential: {exc}")


if __name__ == "__main__":
    main()
