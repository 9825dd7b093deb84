"""How much could a stop predictor learn from each kind of information? A probe on a data_gen dataset.

    python research/head_gap/probe_features.py data/demo/reference --eval data/demo/heldout_bundled:test \
        --eval data/demo/heldout_humaneval:test --cost-ratio 0.137 --out reports/probe

A diagnostic beside `python -m train`, not a way to ship heads: it trains the same kind of network
as the lag-free head (Linear(F, 256), one residual block, Linear(256, 1); the weighted soft-label
BCE of specdecpp.training.loss with w_rej = 1, Adam, best-on-dev epoch) on feature sets that include
information the engine does not hand a head today, and reports the dev and held-out AUROC, KL
and calibration (specdecpp.training.metrics), and the Eq. 2.3 margin over the best fixed K of the
lag-free Algorithm 2 with the probe's predictions (specdecpp.analysis.potential, 5 seeds).

Every position i of a response is scored in the data_gen context (prompt + X_<i, no token mixing:
the context the label P_i was computed in), for the candidate Y_i. Features:

- draft side (what the lag-free head sees; specdecpp.stopping.head.next_token_features): ``hidden`` e_{i-1},
  ``embedding`` of Y_i, ``prob``, ``logprob``, ``entropy`` of q_i, ``topm`` (its 8 largest
  probabilities);
- ``target@d``: the target's final hidden state d positions before the one that produced p_i
  (d = 1 is the freshest state a round's first candidate could get from the last verification:
  that forward's last state produced p for the token the round starts after; a round's k-th
  candidate is k positions away). d = 0 is the state that produced p_i itself: no engine has it
  before verifying, it is the control that shows the probe learns when the information is there;
- ``tnum@d``: the entropy and the 8 largest probabilities of the target's distribution at the
  ``target@d`` state (the engine has these logits from the last verification for d >= 1);
- ``position``: log(1 + i) for the candidate's index i in the response (the lag-free head's optional
  ``position`` feature, which the engine hands a head that asks for it);
- ``history``: the labels P_{i-1} and P_{i-2} themselves (with indicators at the response start):
  an upper bound on what the outcomes of earlier rounds could tell (the engine sees only their
  Bernoulli outcomes, and none for the candidates of the current round).

``--train-fractions 0.25 0.5 1`` fits every set on the first quarter, half and all of the train
prompts (a learning curve: would more labelled data help?); ``--widths 256 1024`` fits networks of these widths.
``--extra-train DIR:SPLIT[:N]`` adds the first N responses (all without N) of another dataset of the same
pair to the train split (another data_gen seed: data_curve.sh; other prompts: domain_data.sh, both beside this file).
``--bilinear R`` also fits each set that holds the candidate's embedding and the draft's hidden state with a
rank-R term (U emb)·(V hidden) added to the network's output: the shape of a correction to the draft's
logit of the candidate, E[y]·A·h, which the MLP on the concatenated features learns only slowly.
``--cache DIR`` keeps each dataset's feature blocks, so a second probe on the same data skips the forwards.

Writes probe.json and probe.md to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import numpy as np
import torch

REPO = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(REPO))
from specdecpp.analysis import potential as pt  # noqa: E402
from specdecpp.analysis.costmodel import Costs, load_costs  # noqa: E402
from specdecpp.core.sampling import SamplingConfig  # noqa: E402
from specdecpp.data.dataset import load_labelled  # noqa: E402
from specdecpp.models.loading import load_model  # noqa: E402
from specdecpp.training.loss import weighted_bce  # noqa: E402
from specdecpp.training.metrics import (  # noqa: E402
    binary_kl,
    calibration_bins,
    expected_calibration_error,
    rejection_auroc,
)
from specdecpp.training.mixing import draft_features, lag_free_features  # noqa: E402

DRAFT_SPEC = {"kind": "next", "features": ["hidden", "embedding", "prob", "logprob", "entropy", "topm"],
              "temperature": 1.0, "top_m": 8}
FEATURE_SETS = {  # name -> the blocks concatenated
    "q numbers (prob, logprob, entropy)": ["q"],
    "q numbers + topm": ["q", "topm"],
    "today's lag-free head (hidden, embedding, q numbers)": ["hidden", "embedding", "q"],
    "today's + topm": ["hidden", "embedding", "q", "topm"],
    "today's + topm + history (P_{i-1}, P_{i-2})": ["hidden", "embedding", "q", "topm", "history"],
    "q numbers + position": ["q", "position"],
    "today's + topm + position (log(1 + i), i the index in the response)": ["hidden", "embedding", "q", "topm",
                                                                            "position"],
    "today's + topm + position + target@1 + tnum@1 + history": ["hidden", "embedding", "q", "topm", "position",
                                                                "target@1", "tnum@1", "history"],
    "today's + topm + tnum@1 (entropy, top-8 of p one position back)": ["hidden", "embedding", "q", "topm", "tnum@1"],
    "today's + topm + target@2 + tnum@2": ["hidden", "embedding", "q", "topm", "target@2", "tnum@2"],
    "today's + topm + target@1 + tnum@1": ["hidden", "embedding", "q", "topm", "target@1", "tnum@1"],
    "today's + topm + target@1 + tnum@1 + history": ["hidden", "embedding", "q", "topm", "target@1", "tnum@1",
                                                     "history"],
    "control: today's + target@0 (not visible to any engine)": ["hidden", "embedding", "q", "topm", "target@0"],
}


def blocks_of(rows, draft, target, hidden_size: int, sampling=None, batch: int = 8) -> dict[str, np.ndarray]:
    """Every feature block for every position of ``rows`` (dicts of one split), in row order.
    With ``sampling`` (the dataset's), ``recomputed`` holds min(1, p/q) of Y_i from the warped
    target logits of the ``target@0`` state and the draft's of ``hidden``: it must equal the label
    (the check that the states sit where the docstring says)."""
    from specdecpp.core.sampling import warp

    out = {k: [] for k in ("hidden", "embedding", "q", "topm", "position", "target@0", "target@1", "target@2",
                           "history", "tnum@1", "tnum@2", "labels", "row_len", "recomputed")}
    h = hidden_size
    for a in range(0, len(rows), batch):
        chunk = rows[a : a + batch]
        seqs = [torch.cat([torch.as_tensor(r["prompt_ids"]), torch.as_tensor(r["target_ids"])]).long() for r in chunk]
        # the state that produced q_i / p_i for response position i is index L - 1 + i
        pos = [len(r["prompt_ids"]) - 1 + torch.arange(len(r["target_ids"])) for r in chunk]
        dh = draft_features(draft, seqs, pos)
        th = draft_features(target, seqs, [torch.cat([p, (p - 1).clamp_min(0), (p - 2).clamp_min(0)]) for p in pos])
        for r, d, t in zip(chunk, dh, th, strict=True):
            n = len(r["target_ids"])
            y = torch.as_tensor(r["draft_ids"]).long()
            f = lag_free_features(draft, d, y, DRAFT_SPEC).float()
            out["hidden"].append(f[:, :h])
            out["embedding"].append(f[:, h : 2 * h])
            out["q"].append(f[:, 2 * h : 2 * h + 3])
            out["topm"].append(f[:, 2 * h + 3 :])
            for d_ in range(3):
                out[f"target@{d_}"].append(t[d_ * n : (d_ + 1) * n].float())
            with torch.no_grad():  # the shape of p at the stale states (the verification's logits)
                for d_ in (1, 2):
                    logp = torch.log_softmax(target.get_output_embeddings()(t[d_ * n : (d_ + 1) * n].to(target.dtype))
                                             .float() / DRAFT_SPEC["temperature"], -1)
                    top = logp.topk(8, dim=-1).values.exp()
                    ent = -(logp.exp() * logp).nansum(-1, keepdim=True)
                    out[f"tnum@{d_}"].append(torch.cat([ent, top], -1))
            t = t.float()
            if sampling is not None:
                with torch.no_grad():
                    q_y = warp(draft.get_output_embeddings()(d.to(draft.dtype)), sampling).gather(-1, y[:, None])
                    p_y = warp(target.get_output_embeddings()(t[:n].to(target.dtype)), sampling).gather(-1, y[:, None])
                out["recomputed"].append((p_y / q_y.clamp_min(1e-30)).clamp_max(1.0).squeeze(-1).float())
            p = torch.as_tensor(r["p_acc"]).float()
            prev1 = torch.cat([torch.zeros(1), p[:-1]])
            prev2 = torch.cat([torch.zeros(2), p[:-2]])[:n]
            idx = torch.arange(n)
            out["history"].append(torch.stack([prev1, prev2, (idx >= 1).float(), (idx >= 2).float()], -1))
            out["position"].append(torch.log1p(idx.float())[:, None])  # as specdecpp.stopping.head's `position` feature
            out["labels"].append(p)
            out["row_len"].append(torch.tensor([n]))
    return {k: torch.cat(v).numpy() for k, v in out.items() if v}


def cached_blocks(cache: str | None, directory: str, split: str, n: int | None, meta: dict, compute,
                  checked: bool = False) -> dict:
    """``compute()``'s blocks of dataset ``directory``'s ``split`` (its first ``n`` rows), kept in
    ``cache`` (an .npz per dataset, split, rows, labelling run (the dataset meta's ``created``) and
    ``checked``: whether they hold the ``recomputed`` labels) so that a second probe on the same data
    skips the models' forwards; no cache: just ``compute()``."""
    if not cache:
        return compute()
    import hashlib

    key = json.dumps([str(Path(directory).resolve()), split, n, meta.get("created"), meta.get("draft"),
                      meta.get("target"), DRAFT_SPEC, checked])
    path = Path(cache) / f"blocks-{hashlib.sha1(key.encode()).hexdigest()[:16]}.npz"
    if path.exists():
        with np.load(path) as z:
            return {k: z[k] for k in z.files}
    blocks = compute()
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp.npz")
    np.savez(tmp, **blocks)
    tmp.replace(path)  # a complete file or none
    return blocks


class Probe(torch.nn.Module):
    """Linear(F, width), one residual block, Linear(width, 1), as the lag-free head; with ``bilinear``
    = R > 0 also a rank-R term sum_r (U_r . a)(V_r . b) between two blocks of the input (``pair``:
    their column slices), the form of a logit correction E[y] A h that the MLP computes only slowly."""

    def __init__(self, size: int, width: int = 256, bilinear: int = 0, pair: tuple[slice, slice] | None = None) -> None:
        super().__init__()
        self.proj, self.block, self.out = (torch.nn.Linear(size, width), torch.nn.Linear(width, width),
                                           torch.nn.Linear(width, 1))
        self.pair = pair
        if bilinear:
            a, b = pair
            self.u = torch.nn.Linear(a.stop - a.start, bilinear, bias=False)
            self.v = torch.nn.Linear(b.stop - b.start, bilinear, bias=False)
            for m in (self.u, self.v):
                torch.nn.init.normal_(m.weight, std=0.1 / m.in_features ** 0.5)

    def forward(self, x):
        z = self.proj(x)
        z = self.out(z + torch.nn.functional.silu(self.block(z))).squeeze(-1)
        if self.pair is not None:
            a, b = self.pair
            z = z + (self.u(x[:, a]) * self.v(x[:, b])).sum(-1)
        return z


def block_slices(data: dict, names: list[str]) -> dict[str, slice]:
    """Each block's columns in ``matrix(data, names)``."""
    out, at = {}, 0
    for n in names:
        out[n] = slice(at, at + data[n].shape[1])
        at += data[n].shape[1]
    return out


def matrix(data: dict, names: list[str], mean=None, std=None):
    x = torch.from_numpy(np.concatenate([data[n] for n in names], axis=1)).float()
    if mean is None:
        mean, std = x.mean(0), x.std(0).clamp_min(1e-6)
    return (x - mean) / std, mean, std


def metrics(logits: torch.Tensor, labels: torch.Tensor) -> dict:
    kl = binary_kl(logits, labels).mean()
    c = labels.mean().clamp(1e-6, 1 - 1e-6)
    kl_const = binary_kl(torch.full_like(labels, float(torch.logit(c))), labels).mean()
    return {"AUROC": float(rejection_auroc(logits, labels)), "KL": float(kl), "KL_const": float(kl_const),
            "ECE": float(expected_calibration_error(*calibration_bins(torch.sigmoid(logits), labels))),
            "positions": int(labels.numel())}


def first_rows(data: dict, fraction: float) -> dict:
    """The blocks of the first ``fraction`` of ``data``'s responses (whole responses, in order)."""
    if fraction >= 1.0:
        return data
    lens = data["row_len"]
    rows = max(1, int(round(fraction * len(lens))))
    end = int(lens[:rows].sum())
    return {k: (v[:rows] if k == "row_len" else v[:end]) for k, v in data.items()}


def fit(train: dict, dev: dict, names: list[str], epochs: int, seed: int, targets: str = "soft", width: int = 256,
        bilinear: int = 0):
    """``targets``: ``soft`` trains on P_i (the paper's loss); ``bernoulli`` on 0/1 draws of
    Bernoulli(P_i), a fresh draw per epoch (the same loss in expectation, more noise). ``bilinear``:
    the rank of a term between the ``embedding`` and ``hidden`` blocks (0: none)."""
    torch.manual_seed(seed)
    x, mean, std = matrix(train, names)
    xd, _, _ = matrix(dev, names, mean, std)
    p, yd = torch.from_numpy(train["labels"]), torch.from_numpy(dev["labels"])
    y = p
    pair = None
    if bilinear:
        cols = block_slices(train, names)
        if "embedding" not in cols or "hidden" not in cols:
            raise SystemExit(f"probe_features: --bilinear needs the embedding and hidden blocks, the set has {names}")
        pair = (cols["embedding"], cols["hidden"])
    model = Probe(x.shape[1], width, bilinear, pair)
    opt = torch.optim.Adam(model.parameters(), lr=1e-3, weight_decay=1e-4)
    best, best_state, g = float("inf"), None, torch.Generator().manual_seed(seed)
    for _ in range(epochs):
        if targets == "bernoulli":
            y = torch.bernoulli(p, generator=g)
        model.train()
        for idx in torch.randperm(len(x), generator=g).split(512):
            loss = weighted_bce(model(x[idx]), y[idx], 1.0)
            opt.zero_grad()
            loss.backward()
            opt.step()
        model.eval()
        with torch.no_grad():
            dev_loss = float(weighted_bce(model(xd), yd, 1.0))
        if dev_loss < best:
            best, best_state = dev_loss, {k: v.clone() for k, v in model.state_dict().items()}
    model.load_state_dict(best_state)
    return model.eval(), mean, std


def temperature_scale(logits: torch.Tensor, labels: torch.Tensor) -> float:
    """The T minimising the soft-label BCE of logits / T (on dev), by a grid then golden search."""
    def nll(t):
        return float(binary_kl(logits / t, labels).mean())
    grid = np.exp(np.linspace(np.log(0.2), np.log(5), 41))
    t = float(grid[int(np.argmin([nll(g) for g in grid]))])
    lo, hi = t / 1.1, t * 1.1
    for _ in range(30):
        a, b = lo + 0.382 * (hi - lo), lo + 0.618 * (hi - lo)
        lo, hi = (lo, b) if nll(a) < nll(b) else (a, hi)
    return (lo + hi) / 2


def margin(data: dict, logits: np.ndarray, costs: Costs, seeds: int = 5) -> dict:
    """The lag-free Algorithm 2 with these predictions against the best fixed K (Eq. 2.3)."""
    ends = np.cumsum(data["row_len"])
    starts = ends - data["row_len"]
    pred = 1 / (1 + np.exp(-logits))
    rows = [{"p_acc": data["labels"][a:b].astype(np.float64), "pred:probe": pred[a:b].astype(np.float64),
             "draft_entropy": np.zeros(b - a)} for a, b in zip(starts, ends, strict=True)]
    hs = (0.1, 0.2, 0.3, 0.4, 0.5, 0.6, 0.7, 0.8, 0.9, 0.95)
    pols = [pt.fixed_k(k) for k in range(1, 11)] + [pt.head_rule("probe", h, lag=0) for h in hs] + \
        [pt.informed_lag_free(h) for h in hs]
    results = pt.simulate(rows, pols, seeds=range(seeds))
    records = pt.summarise(results, pols, costs, n_boot=200)
    fixed = pt.best(records, "fixed_k")
    out = {"best_fixed_k": fixed["label"], "fixed_k_speedup": fixed["speedup"]}
    for name, key in (("head:probe", "probe"), ("informed_lag_free", "perfect_lag_free")):
        b = pt.best(records, name)
        out[key] = {"setting": b["label"], "speedup": b["speedup"], "margin": b["speedup"] / fixed["speedup"] - 1}
    out["share_of_perfect"] = out["probe"]["margin"] / out["perfect_lag_free"]["margin"]
    return out


def extra_train_spec(spec: str) -> tuple[str, str, int | None]:
    """``--extra-train DIR:SPLIT[:N]`` -> (DIR, SPLIT, N or None)."""
    directory, _, split = spec.rpartition(":")
    rows = None
    if split.isdigit() and ":" in directory:  # DIR:SPLIT:N
        rows, (directory, _, split) = int(split), directory.rpartition(":")
    if not directory or not split or rows == 0:
        raise SystemExit(f"probe_features: --extra-train wants DIR:SPLIT or DIR:SPLIT:N with N >= 1, got {spec!r}")
    return directory, split, rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("data", help="a data_gen dataset with train and dev splits")
    ap.add_argument("--eval", action="append", default=[], help="DIR:SPLIT of a held-out dataset (repeatable)")
    ap.add_argument("--cost-ratio", type=float)
    ap.add_argument("--costs")
    ap.add_argument("--epochs", type=int, default=12)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--sets", nargs="+", help="only these feature sets (their names' first words are enough)")
    ap.add_argument("--extra-train", action="append", default=[],
                    help="DIR:SPLIT[:N] of another dataset of the same pair whose positions join the train split "
                         "(more labelled data: e.g. the same prompts with another data_gen seed; N: its first N "
                         "responses only); repeatable")
    ap.add_argument("--train-fractions", type=float, nargs="+", default=[1.0],
                    help="fit on the first fraction of the train prompts (a learning curve)")
    ap.add_argument("--widths", type=int, nargs="+", default=[256], help="the probe network's width(s)")
    ap.add_argument("--bilinear", type=int, nargs="+", default=[],
                    help="also fit each set with a rank-R bilinear term between the candidate's embedding and the "
                         "draft's hidden state (sets that hold both), for each R given")
    ap.add_argument("--cache", help="keep each dataset's feature blocks here (.npz), so a rerun on the same data "
                                    "skips the models' forwards")
    ap.add_argument("--out", default="reports/probe")
    args = ap.parse_args()
    if any(not 0 < f <= 1 for f in args.train_fractions):
        ap.error(f"--train-fractions must lie in (0, 1], got {args.train_fractions}")
    if (args.cost_ratio is None) == (args.costs is None):
        ap.error("give exactly one of --cost-ratio or --costs")
    costs = Costs.from_ratio(args.cost_ratio) if args.costs is None else load_costs(args.costs)
    torch.set_num_threads(int(os.environ.get("PROBE_THREADS", "1")))
    splits, meta = load_labelled(args.data)
    for name in ("train", "dev"):
        if name not in splits:
            raise SystemExit(f"probe_features: {args.data} has no {name!r} split (it has {sorted(splits)})")
    t = float((meta.get("sampling") or {}).get("temperature", 1.0))
    DRAFT_SPEC["temperature"] = t if t > 0 else 1.0
    draft = load_model(meta["draft"], device="cpu", dtype=meta.get("dtype", "float32"))
    target = load_model(meta["target"], device="cpu", dtype=meta.get("dtype", "float32"))
    size = int(draft.config.hidden_size)
    sampling = SamplingConfig(**meta["sampling"])
    t0 = time.perf_counter()
    data = {name: cached_blocks(args.cache, args.data, name, None, meta,
                                lambda name=name: blocks_of([splits[name][i] for i in range(len(splits[name]))], draft,
                                                            target, size, sampling if name == "dev" else None),
                                checked=name == "dev")
            for name in ("train", "dev")}
    for spec in args.extra_train:
        directory, split, rows = extra_train_spec(spec)
        extra, extra_meta = load_labelled(directory)
        if split not in extra:
            raise SystemExit(f"probe_features: --extra-train {directory} has no split {split!r} "
                             f"(it has {sorted(extra)})")
        if extra_meta.get("draft") != meta.get("draft") or extra_meta.get("target") != meta.get("target"):
            raise SystemExit(f"probe_features: --extra-train {directory} was labelled by another pair "
                             f"({extra_meta.get('draft')}, {extra_meta.get('target')})")
        n = len(extra[split]) if rows is None else min(rows, len(extra[split]))
        more = cached_blocks(args.cache, directory, split, n, extra_meta,
                             lambda ds=extra[split], n=n: blocks_of([ds[i] for i in range(n)], draft, target, size))
        data["train"] = {k: np.concatenate([data["train"][k], more[k]]) for k in data["train"] if k in more}
    for spec in args.eval:
        directory, _, split = spec.rpartition(":")
        ev, ev_meta = load_labelled(directory)
        data[spec] = cached_blocks(args.cache, directory, split, None, ev_meta,
                                   lambda ds=ev[split]: blocks_of([ds[i] for i in range(len(ds))], draft, target, size))
    diff = np.abs(data["dev"]["recomputed"] - data["dev"]["labels"])
    print(f"index check on dev: |min(1, p/q) from target@0 and hidden - P| mean {diff.mean():.4f}, "
          f"median {np.median(diff):.4f}, "
          f"corr {np.corrcoef(data['dev']['recomputed'], data['dev']['labels'])[0, 1]:.4f}",
          flush=True)
    if np.corrcoef(data["dev"]["recomputed"], data["dev"]["labels"])[0, 1] < 0.9:
        raise SystemExit("probe_features: the recomputed labels do not match the dataset's: the states are misplaced")
    print(f"features in {time.perf_counter() - t0:.0f} s: "
          + ", ".join(f"{k} {len(v['labels'])}" for k, v in data.items()), flush=True)
    sets = {k: v for k, v in FEATURE_SETS.items() if not args.sets or any(k.startswith(s) for s in args.sets)}
    results = []
    runs = [(name, names, "soft", False) for name, names in sets.items()]
    if args.train_fractions != [1.0] or args.widths != [256]:
        runs = [(f"{name} [train {f:.0%}, width {w}]", names, "soft", False, f, w)
                for name, names, *_ in runs for w in args.widths for f in sorted(args.train_fractions)]
    elif not args.sets:  # the training variants, on the best engine-visible set
        runs += [("today's + topm, Bernoulli 0/1 targets", FEATURE_SETS["today's + topm"], "bernoulli", False),
                 ("today's + topm, temperature-scaled on dev", FEATURE_SETS["today's + topm"], "soft", True)]
    runs = [(*r, 0) for r in runs] + [(f"{r[0]}, bilinear rank {rank}", *r[1:], rank) for rank in args.bilinear
                                      for r in runs if {"embedding", "hidden"} <= set(r[1])]
    for name, names, targets, scale, *curve, rank in runs:
        t1 = time.perf_counter()
        fraction, width = curve if curve else (1.0, 256)
        train = first_rows(data["train"], fraction)
        model, mean, std = fit(train, data["dev"], names, args.epochs, args.seed, targets, width, rank)
        record = {"set": name, "blocks": names, "targets": targets, "width": width, "bilinear": rank,
                  "train_positions": int(len(train["labels"])), "train_prompts": int(len(train["row_len"])),
                  "splits": {}}
        temperature = 1.0
        if scale:
            with torch.no_grad():
                dev_logits = model(matrix(data["dev"], names, mean, std)[0])
            temperature = temperature_scale(dev_logits, torch.from_numpy(data["dev"]["labels"]))
            record["temperature"] = temperature
        for split, d in data.items():
            if split == "train":
                continue
            with torch.no_grad():
                logits = model(matrix(d, names, mean, std)[0]) / temperature
            record["splits"][split] = {**metrics(logits, torch.from_numpy(d["labels"])),
                                       **margin(d, logits.numpy(), costs)}
        record["fit_s"] = time.perf_counter() - t1
        results.append(record)
        print(json.dumps({"set": name, **{s: {k: round(v, 4) if isinstance(v, float) else v
                                               for k, v in m.items()
                                               if k in ("AUROC", "KL", "KL_const", "share_of_perfect")}
                                           for s, m in record["splits"].items()}}), flush=True)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    (out / "probe.json").write_text(json.dumps({"data": args.data, "cost_ratio": costs.ratio, "epochs": args.epochs,
                                                "results": results}, indent=1) + "\n")
    lines = [f"# Feature probe: {args.data} (cost ratio {costs.ratio:.3f})", "",
             "| feature set | " + " | ".join(f"{s} AUROC | {s} KL (const) | {s} margin (perfect) | {s} share"
                                              for s in results[0]["splits"]) + " |",
             "|---|" + "---|---|---|---|" * len(results[0]["splits"])]
    for r in results:
        cells = []
        for m in r["splits"].values():
            cells += [f"{m['AUROC']:.3f}", f"{m['KL']:.4f} ({m['KL_const']:.4f})",
                      f"{100 * m['probe']['margin']:+.1f}% ({100 * m['perfect_lag_free']['margin']:+.1f}%)",
                      f"{m['share_of_perfect']:.2f}"]
        lines.append(f"| {r['set']} | " + " | ".join(cells) + " |")
    (out / "probe.md").write_text("\n".join(lines) + "\n")
    print("\n".join(lines))


if __name__ == "__main__":
    main()
