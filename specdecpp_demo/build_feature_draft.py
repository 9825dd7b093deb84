"""Build the demo target's EAGLE-3 feature draft (issue 62, item 3) on a CPU, resumably.

    python -m specdecpp_demo.build_feature_draft data   [--config conf/distill/feature.yaml]
    python -m specdecpp_demo.build_feature_draft train
    python -m specdecpp_demo.build_feature_draft export [--out DIR]
    python -m specdecpp_demo.build_feature_draft all    # data, then train, then export

On two cores: ``data --worker 0/2`` and ``data --worker 1/2`` (each writes every other shard of the
plan); ``train`` may start once the validation shards exist while one ``data`` goes on: it reads the
shards written since at each eval. ``train.init`` continues a shipped artifact's training (a session's
build starts from the last session's layers on fresh data).

Work files go to ``$SPECDECPP_CACHE/demo/feature/<config stem>`` (default .cache/demo/feature/feature),
or to the config's ``work``.

data: the target (bf16 on CPUs with native bf16, ``teacher_dtype``) is run teacher-forced over
    (a) its own sampled answers (temperature 1, top-k 50, batched HF ``generate`` with the chat
    template, ``max_new_tokens``) to the bundled TRAIN prompts, ``answers_per_prompt`` answers per
    prompt in each of ``rounds`` rounds (each round its own seeds), and (b) windows of Python
    standard-library source. One shard per batch (``shards/<name>.safetensors``, written
    atomically, skipped when present: a killed run resumes), holding the rows concatenated:
    ``token_ids`` [N] int32, ``lengths`` [R] int32, ``loss_mask`` [N] bool (position s is trained on
    when the target's prediction there is of an answer token, or of text), ``features`` [N, 3H]
    bf16 (``hidden_states[i]`` for the draft's aux layers, concatenated), ``topk_ids`` [N, k]
    int32 and ``topk_logits`` [N, k] bf16 (the target's top-k logits, k = 50: its T=1 top-k-50
    distribution). Validation shards (``val_*``) hold answers to bundled DEV prompts (checkpoints
    are selected on them); bundled TEST prompts and HumanEval are never used. Training shards stop
    once ``max_tokens`` positions are stored. Progress: tqdm and ``data_progress.json``.
train: ``FeatureDraft.init_from(target, draft_vocab=<12,288 ids>)``, trained with the training-time
    test (``ttt_steps`` unrolled steps; step k reads the draft's own output of step k-1 at the same
    anchor and the teacher-forced token shifted by k; attention: the step-0 entries causally, each
    later step's entry of the same anchor: EAGLE-3's and speculators' masks). Loss: the sum over
    steps of the cross-entropy of q (softmax over the draft vocabulary) against the target's T=1
    top-50 distribution restricted to the draft vocabulary and renormalised. AdamW, warm-up +
    cosine; embed and lm_head frozen (``train_lm_head``). Checkpoints (``checkpoint.pt``) every
    ``checkpoint_minutes`` and at every eval; resumes from it. Each eval logs the held-out alpha_k
    = E[sum_v min(p(v), q(v))] (p, q: T=1 top-50 distributions of the target and the draft) at
    draft steps k = 1..ttt_steps (step 1 on the target's features, later steps on the draft's own)
    against tokens seen to ``metrics.csv`` and plots it (``metrics.png``); ``best.pt`` keeps the
    checkpoint of the highest alpha_1 + alpha_1 alpha_2 + alpha_1 alpha_2 alpha_3 (the expected
    accepted drafts of a 3-token chain).
export: the best checkpoint in the speculators format (``FeatureDraft.save_pretrained``, bf16) in
    ``--out`` (default <work>/export/full), and the shipped form beside it (``<work>/export/artifact``:
    the trained layers, d2t/t2d and config.json; :func:`materialize` rebuilds the full directory
    with the target's embedding and output rows).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import load_file, save_file
from tqdm import tqdm

from specdecpp.models.feature_draft import FeatureDraft, default_aux_layers
from specdecpp.training.schedules import warmup_cosine
from specdecpp_demo.text import text_files, text_windows

REPO_ROOT = Path(__file__).resolve().parents[1]
DEFAULT_CONFIG = REPO_ROOT / "conf" / "distill" / "feature.yaml"
FROZEN = ("embed_tokens.weight", "lm_head.weight")  # rebuilt from the target (lm_head: unless trained)


# ---------------------------------------------------------------- config, target, paths

def load_recipe(path: Path) -> dict:
    if not Path(path).is_file():
        raise FileNotFoundError(f"feature-draft config {str(path)!r} not found")
    return yaml.safe_load(Path(path).read_text())


def work_dir(recipe: dict, config_path: Path) -> Path:
    if recipe.get("work"):
        return Path(os.path.expanduser(recipe["work"])).resolve()
    from specdecpp_demo.pair import cache_dir

    return cache_dir() / "feature" / Path(config_path).stem


def shards_dir(recipe: dict, work: Path) -> Path:
    """Where the data shards are (``shards_dir``; default <work>/shards): a probe run can train on
    another build's shards while that build is still writing them."""
    return Path(os.path.expanduser(recipe["shards_dir"])) if recipe.get("shards_dir") else work / "shards"


def target_path(recipe: dict) -> Path:
    if recipe.get("target"):
        return Path(os.path.expanduser(recipe["target"]))
    from specdecpp_demo.pair import demo_target_path

    return demo_target_path()


def load_target(recipe: dict, dtype: str | None = None):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecpp.models.loading import resolve_dtype

    path = target_path(recipe)
    model = AutoModelForCausalLM.from_pretrained(
        path, dtype=resolve_dtype(dtype or recipe.get("teacher_dtype", "fast"))).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(path)


def aux_layers(recipe: dict, target) -> list[int]:
    return list(recipe.get("aux_layers") or default_aux_layers(target.config.num_hidden_layers))


def draft_vocab(recipe: dict):
    """The kept target ids (``draft_vocab``: a JSON file with ``token_ids``, relative to the repo), or None: all."""
    if not recipe.get("draft_vocab"):
        return None
    path = Path(recipe["draft_vocab"])
    path = path if path.is_absolute() else REPO_ROOT / path
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)


def write_json(path: Path, obj) -> None:
    path.with_suffix(".tmp").write_text(json.dumps(obj, indent=1))
    path.with_suffix(".tmp").replace(path)


# ---------------------------------------------------------------- data

def shard_plan(recipe: dict, tokenizer) -> list[dict]:
    """Every shard the data stage may write, in order: the validation shards, then answer and text
    shards interleaved (text while its share of the planned positions is below ``text_share``),
    answer rounds one after another (round r: every train prompt once more, new seeds)."""
    from specdecpp.data.prompts import encode_prompt, load_prompts

    d = recipe["data"]
    ans, txt, val = d["answers"], d["text"], d["validation"]
    plan = []
    val_prompts = load_prompts("bundled", val["split"], limit=val.get("prompts"))
    per = val["prompts_per_shard"]
    for j in range(0, len(val_prompts), per):
        plan.append({"name": f"val_{j // per:04d}", "kind": "answers", "answers": val["answers_per_prompt"],
                     "prompts": [encode_prompt(tokenizer, p.prompt) for p in val_prompts[j:j + per]],
                     "seed": recipe["seed"] * 1_000_003 + 900_000 + j})
    train_prompts = load_prompts("bundled", ans["split"], limit=ans.get("prompts"))
    per = ans["prompts_per_shard"]
    answer_shards = [{"name": f"ans_r{r}_{j // per:04d}", "kind": "answers", "answers": ans["answers_per_prompt"],
                      "prompts": [encode_prompt(tokenizer, p.prompt) for p in train_prompts[j:j + per]],
                      "seed": recipe["seed"] * 1_000_003 + r * 10_000 + j}
                     for r in range(ans["rounds"]) for j in range(0, len(train_prompts), per)]
    text_shards = [{"name": f"text_{i:04d}", "kind": "text", "index": i} for i in range(txt["shards"])]
    est_answer = ans["answers_per_prompt"] * per * (48 + 0.8 * d["max_new_tokens"])
    est_text = txt["rows_per_shard"] * txt["window"]
    planned = {"answers": 0.0, "text": 0.0}
    while answer_shards or text_shards:
        total = planned["answers"] + planned["text"]
        take_text = text_shards and (not answer_shards or planned["text"] < txt["text_share"] * (total + est_text))
        if take_text:
            plan.append(text_shards.pop(0))
            planned["text"] += est_text
        else:
            plan.append(answer_shards.pop(0))
            planned["answers"] += est_answer
    return plan


def sample_answers(target, tokenizer, spec: dict, max_new_tokens: int, top_k: int) -> tuple[list, list]:
    """(rows, masks): each prompt's ``answers`` sampled answers (T=1, top-k), one left-padded batch;
    a row is prompt + answer up to and with its EOS; the mask marks the positions whose next token
    is an answer token."""
    prompts = [p for p in spec["prompts"] for _ in range(spec["answers"])]
    width = max(len(p) for p in prompts)
    pad = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else tokenizer.eos_token_id
    ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts])
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts])
    torch.manual_seed(spec["seed"])
    with torch.no_grad():
        out = target.generate(ids, attention_mask=attn, do_sample=True, temperature=1.0, top_k=top_k, top_p=1.0,
                              max_new_tokens=max_new_tokens, eos_token_id=tokenizer.eos_token_id,
                              pad_token_id=pad)
    rows, masks = [], []
    for p, seq in zip(prompts, out[:, width:].tolist(), strict=True):
        if tokenizer.eos_token_id in seq:
            seq = seq[: seq.index(tokenizer.eos_token_id) + 1]
        row = p + seq
        mask = [False] * len(row)
        for s in range(len(p) - 1, len(row) - 1):  # predictions of the answer tokens
            mask[s] = True
        if not (seq and seq[-1] == tokenizer.eos_token_id):
            mask[-1] = True  # cut at max_new_tokens: the target's next prediction is still an answer's
        rows.append(row)
        masks.append(mask)
    return rows, masks


def teacher_forward(target, aux: list[int], rows: list[list[int]], top_k: int, chunk_rows: int) -> dict:
    """The fused aux features and the top-k logits of every position of every row (right-padded
    batches of ``chunk_rows``: padding comes after a row's positions, so it changes none of them)."""
    feats, ids, vals = [], [], []
    order = sorted(range(len(rows)), key=lambda i: len(rows[i]))
    results = {}
    for start in range(0, len(order), chunk_rows):
        group = order[start:start + chunk_rows]
        width = max(len(rows[i]) for i in group)
        batch = torch.tensor([rows[i] + [0] * (width - len(rows[i])) for i in group])
        with torch.no_grad():
            out = target(batch, output_hidden_states=True)
            fused = torch.cat([out.hidden_states[i] for i in aux], dim=-1).to(torch.bfloat16)
            top = out.logits.topk(top_k, dim=-1)
        for j, i in enumerate(group):
            n = len(rows[i])
            results[i] = (fused[j, :n], top.indices[j, :n].to(torch.int32), top.values[j, :n].to(torch.bfloat16))
    for i in range(len(rows)):
        f, t, v = results[i]
        feats.append(f)
        ids.append(t)
        vals.append(v)
    return {"features": torch.cat(feats).contiguous(), "topk_ids": torch.cat(ids).contiguous(),
            "topk_logits": torch.cat(vals).contiguous()}


def shard_tokens(path: Path) -> int:
    with safe_open(str(path), "pt") as f:
        return int(f.metadata()["tokens"])


def data(recipe: dict, work: Path, worker: tuple[int, int] = (0, 1)) -> None:
    """Write the planned shards that are missing. ``worker=(i, n)``: this process takes the plan's
    shards i, i + n, i + 2n, ... (n processes on n cores share one plan; each shard is written by one)."""
    d = recipe["data"]
    shard_dir = shards_dir(recipe, work)
    shard_dir.mkdir(parents=True, exist_ok=True)
    target, tokenizer = load_target(recipe)
    aux = aux_layers(recipe, target)
    plan = shard_plan(recipe, tokenizer)
    windows = None
    t0, made, made_tokens = time.time(), 0, 0
    index, workers = worker
    if not 0 <= index < workers:
        raise SystemExit(f"data: worker {index} of {workers} is out of range (want 0 <= i < n)")
    plan = plan[index::workers]
    progress_path = work / ("data_progress.json" if workers == 1 else f"data_progress_{index}of{workers}.json")

    def stored() -> tuple[int, int]:
        paths = [p for p in shard_dir.glob("*.safetensors") if not p.name.startswith("val_")]
        return len(paths), sum(shard_tokens(p) for p in paths)

    bar = tqdm(plan, desc="feature data (shards)")
    for spec in bar:
        path = shard_dir / f"{spec['name']}.safetensors"
        n_train, train_tokens = stored()
        is_val = spec["name"].startswith("val_")
        if path.is_file():
            continue
        if not is_val and train_tokens >= recipe["max_tokens"]:
            break
        t_shard = time.time()
        if spec["kind"] == "answers":
            rows, masks = sample_answers(target, tokenizer, spec, d["max_new_tokens"], d["top_k"])
        else:
            txt = d["text"]
            if windows is None:
                windows = text_windows(tokenizer, text_files(txt["files"]), txt["shards"] * txt["rows_per_shard"],
                                       txt["window"], recipe["seed"])
            rows = windows[spec["index"] * txt["rows_per_shard"]:(spec["index"] + 1) * txt["rows_per_shard"]]
            masks = [[True] * len(r) for r in rows]
        t_gen = time.time() - t_shard
        tensors = teacher_forward(target, aux, rows, d["top_k"], d.get("forward_rows", 8))
        tensors["token_ids"] = torch.tensor([t for r in rows for t in r], dtype=torch.int32)
        tensors["lengths"] = torch.tensor([len(r) for r in rows], dtype=torch.int32)
        tensors["loss_mask"] = torch.tensor([m for ms in masks for m in ms], dtype=torch.bool)
        n = int(tensors["token_ids"].numel())
        save_file(tensors, str(path.with_suffix(".part")),
                  metadata={"tokens": str(n), "kind": spec["kind"], "aux_layers": json.dumps(aux),
                            "generate_s": f"{t_gen:.2f}", "forward_s": f"{time.time() - t_shard - t_gen:.2f}"})
        path.with_suffix(".part").replace(path)
        made += 1
        made_tokens += n
        elapsed = time.time() - t0
        n_train, train_tokens = stored()
        bar.set_postfix(tokens=train_tokens, tok_s=f"{made_tokens / elapsed:.0f}")
        write_json(progress_path, {"stage": "data", "shard": spec["name"], "train_shards": n_train,
                                   "train_tokens": train_tokens, "max_tokens": recipe["max_tokens"],
                                   "planned_shards": len(plan), "this_run_shards": made,
                                   "this_run_tokens": made_tokens, "this_run_s": round(elapsed, 1),
                                   "tokens_per_s": round(made_tokens / elapsed, 1),
                                   "last_shard": {"tokens": n, "kind": spec["kind"], "generate_s": round(t_gen, 1),
                                                  "forward_s": round(time.time() - t_shard - t_gen, 1)}})
    bar.close()
    n_train, train_tokens = stored()
    print(f"data: {n_train} training shards, {train_tokens} positions in {shard_dir}", flush=True)


def read_shard(path: Path) -> dict:
    return load_file(str(path))


def sequences(shards: list[dict]) -> list[dict]:
    """The rows of the shards as views: token_ids, loss_mask, features, topk_ids, topk_logits."""
    out = []
    for shard in shards:
        start = 0
        for n in shard["lengths"].tolist():
            out.append({k: shard[k][start:start + n] for k in
                        ("token_ids", "loss_mask", "features", "topk_ids", "topk_logits")})
            start += n
    return out


def collate(rows: list[dict]) -> dict:
    """Right-padded batch: tokens [B, L], valid [B, L] (the target position is trained on), features,
    topk ids and logits."""
    width = max(r["token_ids"].numel() for r in rows)
    b = len(rows)
    batch = {"tokens": torch.zeros(b, width, dtype=torch.long), "valid": torch.zeros(b, width, dtype=torch.bool),
             "features": torch.zeros(b, width, rows[0]["features"].shape[-1], dtype=torch.bfloat16),
             "topk_ids": torch.zeros(b, width, rows[0]["topk_ids"].shape[-1], dtype=torch.long),
             "topk_logits": torch.zeros(b, width, rows[0]["topk_logits"].shape[-1])}
    for i, r in enumerate(rows):
        n = r["token_ids"].numel()
        batch["tokens"][i, :n] = r["token_ids"].long()
        batch["valid"][i, :n] = r["loss_mask"]
        batch["features"][i, :n] = r["features"]
        batch["topk_ids"][i, :n] = r["topk_ids"].long()
        batch["topk_logits"][i, :n] = r["topk_logits"].float()
    return batch


# ---------------------------------------------------------------- the training-time test

def ttt_forward(draft: FeatureDraft, tokens: torch.Tensor, features: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """The normed outputs [B, L-1, H] of each unrolled step (:meth:`FeatureDraft.unrolled`)."""
    return [step.normed for step in draft.unrolled(tokens, features, steps)]


class Teacher:
    """The target's T=1 top-k distribution at each target position of a batch, over the full
    vocabulary (for alpha) and restricted to the draft's ids and renormalised (for the loss)."""

    def __init__(self, draft: FeatureDraft) -> None:
        self.where = torch.full((draft.vocab_size,), -1, dtype=torch.long)
        self.where[draft.token_ids.cpu()] = torch.arange(draft.draft_vocab_size)

    def __call__(self, batch: dict) -> dict:
        p = torch.softmax(batch["topk_logits"].float(), dim=-1)  # the saved ids are the top-k: T=1 top-k
        index = self.where[batch["topk_ids"]]
        inside = index >= 0
        kept = p * inside
        mass = kept.sum(-1, keepdim=True)
        return {"p": p, "index": index.clamp_min(0), "inside": inside, "p_draft": kept / mass.clamp_min(1e-12),
                "has_mass": mass.squeeze(-1) > 0}


def step_targets(batch: dict, teach: dict, k: int) -> tuple[torch.Tensor, ...]:
    """For unrolled step k (anchors 0..L-2): the target position i+1+k's entries, and whether it is
    trained on (inside the row and loss-masked)."""
    t = batch["tokens"].shape[1] - 1

    def shifted(x):
        x = x[:, 1 + k:]
        return torch.cat([x, x.new_zeros((x.shape[0], k, *x.shape[2:]))], dim=1)[:, :t]

    valid = shifted(batch["valid"]) & shifted(teach["has_mass"])
    return valid, shifted(teach["p"]), shifted(teach["p_draft"]), shifted(teach["index"]), shifted(teach["inside"])


def ttt_loss(draft: FeatureDraft, batch: dict, teacher: Teacher, steps: int,
             weights: list[float] | None = None) -> tuple[torch.Tensor, list[float]]:
    """Sum over steps of the masked mean cross-entropy of q against the restricted target distribution."""
    teach = teacher(batch)
    outs = ttt_forward(draft, batch["tokens"], batch["features"], steps)
    total, per_step = 0.0, []
    for k, out in enumerate(outs):
        valid, _, p_draft, index, _ = step_targets(batch, teach, k)
        logq = torch.log_softmax(draft.lm_head(out[valid]).float(), dim=-1)
        ce = -(p_draft[valid] * logq.gather(-1, index[valid])).sum(-1).mean()
        total = total + (weights[k] if weights else 1.0) * ce
        per_step.append(ce.item())
    return total, per_step


@torch.no_grad()
def evaluate(draft: FeatureDraft, rows: list[dict], teacher: Teacher, steps: int, top_k: int = 50,
             batch_rows: int = 8) -> dict:
    """Held-out alpha_k = mean over trained positions of sum_v min(p(v), q(v)), p and q the target's
    and the draft's T=1 top-k distributions, at unrolled step k = 1..steps; and the loss per step."""
    sums = [0.0] * steps
    ce_sums = [0.0] * steps
    counts = [0] * steps
    for start in range(0, len(rows), batch_rows):
        batch = collate(rows[start:start + batch_rows])
        teach = teacher(batch)
        outs = ttt_forward(draft, batch["tokens"], batch["features"], steps)
        for k, out in enumerate(outs):
            valid, p, p_draft, index, inside = step_targets(batch, teach, k)
            logits = draft.lm_head(out[valid]).float()
            top = logits.topk(min(top_k, logits.shape[-1]), dim=-1)
            q_top = torch.zeros_like(logits).scatter_(-1, top.indices, torch.softmax(top.values, dim=-1))
            q_at_p = q_top.gather(-1, index[valid]) * inside[valid]
            sums[k] += torch.minimum(p[valid], q_at_p).sum().item()
            logq = torch.log_softmax(logits, dim=-1)
            ce_sums[k] += -(p_draft[valid] * logq.gather(-1, index[valid])).sum().item()
            counts[k] += int(valid.sum())
    return {**{f"alpha_{k + 1}": sums[k] / max(1, counts[k]) for k in range(steps)},
            **{f"val_loss_{k + 1}": ce_sums[k] / max(1, counts[k]) for k in range(steps)},
            "val_positions": counts[0]}


def chain_score(metrics: dict, steps: int) -> float:
    """Expected accepted drafts of a ``steps``-token chain, sum_k prod_{i<=k} alpha_i."""
    score, prod = 0.0, 1.0
    for k in range(1, steps + 1):
        prod *= metrics[f"alpha_{k}"]
        score += prod
    return score


def trainable_state(draft: FeatureDraft) -> dict:
    return {k: v.detach().clone() for k, v in draft.state_dict().items()
            if k not in FROZEN or (k == "lm_head.weight" and draft.lm_head.weight.requires_grad)}


def build_draft(recipe: dict, target) -> FeatureDraft:
    tr = recipe["train"]
    draft = FeatureDraft.init_from(target, aux_layers=aux_layers(recipe, target), draft_vocab=draft_vocab(recipe),
                                   num_layers=tr.get("num_layers", 1), train_lm_head=tr.get("train_lm_head", False),
                                   generator=torch.Generator().manual_seed(recipe["seed"]))
    return draft.float()


def plot(csv_path: Path, png_path: Path, steps: int) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    with open(csv_path) as f:
        rows = list(csv.DictReader(f))
    if not rows:
        return
    tokens = [float(r["tokens_seen"]) for r in rows]
    fig, (a, b) = plt.subplots(1, 2, figsize=(11, 4))
    for k in range(1, steps + 1):
        a.plot(tokens, [float(r[f"alpha_{k}"]) for r in rows], marker="o", label=f"alpha_{k}")
    a.set_xlabel("training positions seen")
    a.set_ylabel("held-out acceptance (T=1, top-k 50)")
    a.grid(alpha=0.3)
    a.legend()
    train = [(t, float(r["train_loss"])) for t, r in zip(tokens, rows, strict=True) if r["train_loss"]]
    if train:
        b.plot(*zip(*train, strict=True), label="train loss (sum over steps)")
    b.plot(tokens, [sum(float(r[f"val_loss_{k}"]) for k in range(1, steps + 1)) for r in rows],
           label="held-out loss (sum over steps)")
    b.set_xlabel("training positions seen")
    b.grid(alpha=0.3)
    b.legend()
    fig.tight_layout()
    fig.savefig(png_path, dpi=90)
    plt.close(fig)


def save_atomic(obj, path: Path) -> None:
    torch.save(obj, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def warm_start(draft: FeatureDraft, artifact: Path) -> int:
    """Load a shipped artifact's trained layers into ``draft`` (a later session continues an earlier
    one's training on fresh data); returns the positions that artifact had seen."""
    weights = artifact / "model.safetensors"
    if not weights.is_file():
        raise FileNotFoundError(f"train.init {str(artifact)!r}: no model.safetensors there (the shipped form that "
                                "`export` writes to <work>/export/artifact)")
    tensors = load_file(str(weights))
    missing, unexpected = draft.load_state_dict(tensors, strict=False)
    if unexpected or set(missing) - set(FROZEN):
        raise ValueError(f"train.init {str(artifact)!r} does not fit this draft: missing "
                         f"{sorted(set(missing) - set(FROZEN))}, unexpected {sorted(unexpected)}")
    info = artifact / "trained.json"
    seen = int(json.loads(info.read_text()).get("tokens_seen", 0)) if info.is_file() else 0
    print(f"warm start from {artifact} ({seen} positions seen before)", flush=True)
    return seen


def train(recipe: dict, work: Path) -> None:
    tr = recipe["train"]
    steps_ttt = tr["ttt_steps"]
    shard_dir = shards_dir(recipe, work)
    train_paths = sorted(p for p in shard_dir.glob("*.safetensors") if not p.name.startswith("val_"))
    val_paths = sorted(shard_dir.glob("val_*.safetensors"))
    if not train_paths or not val_paths:
        raise SystemExit(f"train: {len(train_paths)} training and {len(val_paths)} validation shards in {shard_dir}; "
                         "run `data` first")
    target, _ = load_target(recipe, "float32")
    draft = build_draft(recipe, target)
    del target
    train_rows = sequences([read_shard(p) for p in train_paths])
    loaded = set(train_paths)

    def load_new_shards() -> None:
        """Shards a `data` process still running has written since: training starts while data is made."""
        new = sorted(p for p in shard_dir.glob("*.safetensors") if not p.name.startswith("val_") and p not in loaded)
        if new:
            train_rows.extend(sequences([read_shard(p) for p in new]))
            loaded.update(new)
            tqdm.write(f"train: {len(new)} new shards, {len(train_rows)} rows in all")
    val_rows = sequences([read_shard(p) for p in val_paths])[: tr.get("val_rows")]
    n_train_tokens = sum(r["token_ids"].numel() for r in train_rows)
    print(f"train: {len(train_rows)} rows, {n_train_tokens} positions from {len(train_paths)} shards; "
          f"held out: {len(val_rows)} rows, {sum(r['token_ids'].numel() for r in val_rows)} positions", flush=True)
    teacher = Teacher(draft)
    params = [p for p in draft.parameters() if p.requires_grad]
    optim = torch.optim.AdamW(params, lr=tr["lr"], betas=tuple(tr.get("betas", (0.9, 0.95))),
                              weight_decay=tr.get("weight_decay", 0.0))
    ckpt_path, best_path = work / "checkpoint.pt", work / "best.pt"
    csv_path, png_path = work / "metrics.csv", work / "metrics.png"
    fields = (["step", "tokens_seen", "elapsed_s", "lr", "train_loss"]
              + [f"alpha_{k}" for k in range(1, steps_ttt + 1)] + [f"val_loss_{k}" for k in range(1, steps_ttt + 1)]
              + ["chain_score", "train_tokens_per_s"])
    state = {"step": 0, "tokens_seen": 0, "elapsed_s": 0.0, "best_score": -1.0, "best_step": -1}
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ckpt["model"], strict=False)
        optim.load_state_dict(ckpt["optim"])
        state = ckpt["state"]
        print(f"resumed from {ckpt_path} at step {state['step']} ({state['tokens_seen']} positions seen)", flush=True)
    else:
        with open(csv_path, "w", newline="") as f:
            csv.DictWriter(f, fields).writeheader()
        if tr.get("init"):
            state["tokens_seen"] = warm_start(draft, REPO_ROOT / tr["init"])

    def log_eval(train_loss: float | None, tok_s: float | None) -> None:
        draft.eval()
        metrics = evaluate(draft, val_rows, teacher, steps_ttt, recipe["data"]["top_k"])
        draft.train()
        score = chain_score(metrics, steps_ttt)
        row = {"step": state["step"], "tokens_seen": state["tokens_seen"], "elapsed_s": round(state["elapsed_s"], 1),
               "lr": optim.param_groups[0]["lr"], "train_loss": "" if train_loss is None else round(train_loss, 5),
               **{k: round(v, 5) for k, v in metrics.items() if k in fields}, "chain_score": round(score, 5),
               "train_tokens_per_s": "" if tok_s is None else round(tok_s, 1)}
        with open(csv_path, "a", newline="") as f:
            csv.DictWriter(f, fields).writerow(row)
        plot(csv_path, png_path, steps_ttt)
        tqdm.write("eval " + json.dumps(row))
        if score > state["best_score"]:
            state["best_score"], state["best_step"] = score, state["step"]
            save_atomic({"model": trainable_state(draft), "state": dict(state), "metrics": row}, best_path)

    def checkpoint() -> None:
        save_atomic({"model": trainable_state(draft), "optim": optim.state_dict(), "state": dict(state)}, ckpt_path)

    if state["step"] == 0 and not best_path.is_file():
        log_eval(None, None)
    total = tr["steps"]
    bar = tqdm(total=total, initial=state["step"], desc="feature draft (steps)")
    last_ckpt = time.time()
    window_loss, window_n, window_tokens, window_t = 0.0, 0, 0, 0.0
    draft.train()
    amp = tr.get("autocast_bf16", False)
    while state["step"] < total:
        step = state["step"]
        lr = tr["lr"] * warmup_cosine(step, tr["warmup_steps"], total, floor=tr.get("lr_floor", 0.1),
                                      warmup_offset=1)
        for group in optim.param_groups:
            group["lr"] = lr
        rng = np.random.default_rng([recipe["seed"], step])
        batch = collate([train_rows[i] for i in rng.choice(len(train_rows), tr["batch_rows"], replace=False)])
        t_step = time.time()
        with torch.autocast("cpu", dtype=torch.bfloat16, enabled=amp):
            loss, _ = ttt_loss(draft, batch, teacher, steps_ttt, tr.get("step_weights"))
        optim.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(params, tr.get("grad_clip", 1.0))
        optim.step()
        dt = time.time() - t_step
        n_tokens = int(batch["valid"].sum())
        state["step"] = step = step + 1
        state["tokens_seen"] += n_tokens
        state["elapsed_s"] += dt
        window_loss, window_n, window_tokens, window_t = (window_loss + loss.item(), window_n + 1,
                                                          window_tokens + n_tokens, window_t + dt)
        bar.update(1)
        bar.set_postfix(loss=f"{loss.item():.3f}", tok_s=f"{n_tokens / dt:.0f}")
        if step % tr["eval_every"] == 0 or step == total:
            load_new_shards()
            log_eval(window_loss / window_n, window_tokens / window_t)
            window_loss, window_n, window_tokens, window_t = 0.0, 0, 0, 0.0
            checkpoint()
            last_ckpt = time.time()
        elif time.time() - last_ckpt > 60 * tr["checkpoint_minutes"]:
            checkpoint()
            last_ckpt = time.time()
        write_json(work / "train_progress.json",
                   {"stage": "train", "step": step, "steps": total, "tokens_seen": state["tokens_seen"],
                    "train_tokens_per_s": round(n_tokens / dt, 1), "loss": round(loss.item(), 4),
                    "best_step": state["best_step"], "best_chain_score": round(state["best_score"], 4)})
    bar.close()


# ---------------------------------------------------------------- export

def best_draft(recipe: dict, work: Path) -> tuple[FeatureDraft, dict, object]:
    best_path = work / "best.pt"
    if not best_path.is_file():
        raise FileNotFoundError(f"no trained feature draft at {str(best_path)!r}: run `train` first")
    best = torch.load(best_path, weights_only=False)
    target, _ = load_target(recipe, "float32")
    draft = build_draft(recipe, target)
    draft.load_state_dict(best["model"], strict=False)
    return draft, best, target


CHECK_ROWS, CHECK_MAX_TOKENS = 2, 256  # the held-out sample an artifact's figures are reproduced on


def sample_metrics(draft: FeatureDraft, target, rows: list[list[int]], masks: list[list[bool]], steps: int,
                   top_k: int = 50) -> dict:
    """Held-out alpha_k and losses (:func:`evaluate`) of ``draft`` on token rows, their features and
    the target's top-k logits computed afresh by a teacher-forced ``target`` forward: how an
    artifact's recorded figures are reproduced (tests/demo/test_demo.py)."""
    aux = list(draft.aux_layers)
    t = teacher_forward(target, aux, rows, top_k, chunk_rows=len(rows))
    out, start = [], 0
    for row, mask in zip(rows, masks, strict=True):
        n = len(row)
        out.append({"token_ids": torch.tensor(row, dtype=torch.int32), "loss_mask": torch.tensor(mask),
                    **{k: t[k][start:start + n] for k in ("features", "topk_ids", "topk_logits")}})
        start += n
    return evaluate(draft.float(), out, Teacher(draft), steps, top_k)


def export(recipe: dict, work: Path, out: Path | None = None) -> Path:
    draft, best, _ = best_draft(recipe, work)
    full = out or work / "export" / "full"
    draft.save_pretrained(full, dtype=torch.bfloat16)
    # a held-out sample (the first validation rows) and the exported draft's figures on it, recomputed
    # from scratch, so that a later checkout can check the shipped layers reproduce them
    val = sequences([read_shard(p) for p in sorted(shards_dir(recipe, work).glob("val_*.safetensors"))[:1]])
    check_rows = [r["token_ids"][:CHECK_MAX_TOKENS].tolist() for r in val[:CHECK_ROWS]]
    check_masks = [r["loss_mask"][:CHECK_MAX_TOKENS].tolist() for r in val[:CHECK_ROWS]]
    teacher, _ = load_target(recipe)
    exported = FeatureDraft.from_pretrained(full, target=teacher)
    check = {"token_ids": check_rows, "loss_mask": check_masks, "teacher_dtype": str(teacher.dtype),
             "metrics": sample_metrics(exported, teacher, check_rows, check_masks, recipe["train"]["ttt_steps"])}
    artifact = work / "export" / "artifact"
    artifact.mkdir(parents=True, exist_ok=True)
    tensors = {k: (v.to(torch.bfloat16) if v.is_floating_point() else v).contiguous()
               for k, v in draft.state_dict().items() if k not in FROZEN or k in best["model"]}
    save_file(tensors, str(artifact / "model.safetensors"), metadata={"format": "pt"})
    (artifact / "config.json").write_text(json.dumps(draft.spec_config, indent=2) + "\n")
    (artifact / "trained.json").write_text(json.dumps({"rebuilt_from_target": [k for k in FROZEN if k not in tensors],
                                                       "tokens_seen": best["state"]["tokens_seen"],
                                                       "check_sample": check,
                                                       "best": best["metrics"], "recipe": recipe}, indent=1))
    size = sum(f.stat().st_size for f in artifact.iterdir()) / 1e6
    print(f"wrote {full} (speculators format, bf16) and {artifact} "
          f"({size:.1f} MB); best step {best['state']['best_step']}, "
          f"held-out {json.dumps(best['metrics'])}", flush=True)
    return full


def materialize(artifact: str | os.PathLike, target, out: str | os.PathLike) -> Path:
    """The full speculators directory from the shipped form: the embedding is the target's, the
    lm_head the target's output rows of the kept ids (unless the artifact holds a trained one)."""
    artifact, out = Path(artifact), Path(out)
    tensors = load_file(str(artifact / "model.safetensors"))
    ids = torch.arange(tensors["d2t"].numel()) + tensors["d2t"].long()
    dtype = tensors["fc.weight"].dtype
    embed = target.get_input_embeddings().weight.detach().cpu()
    tensors.setdefault("embed_tokens.weight", embed.to(dtype).contiguous())
    tensors.setdefault("lm_head.weight",
                       target.get_output_embeddings().weight.detach().cpu()[ids].to(dtype).contiguous())
    out.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(out / "model.safetensors"), metadata={"format": "pt"})
    (out / "config.json").write_text((artifact / "config.json").read_text())
    return out


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["data", "train", "export", "all"])
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG)
    parser.add_argument("--out", type=Path, default=None,
                        help="export: the full directory (default <work>/export/full)")
    parser.add_argument("--worker", default="0/1", metavar="I/N",
                        help="data: this process writes shards I, I+N, ... of the plan (run N processes, one per core)")
    args = parser.parse_args(argv)
    try:
        worker = tuple(int(x) for x in args.worker.split("/"))
        assert len(worker) == 2 and worker[1] >= 1
    except (ValueError, AssertionError):
        parser.error(f"--worker {args.worker!r}: want I/N, e.g. 0/2")
    recipe = load_recipe(args.config)
    torch.set_num_threads(int(recipe.get("threads", 1)))
    work = work_dir(recipe, args.config)
    work.mkdir(parents=True, exist_ok=True)
    if args.stage in ("data", "all"):
        data(recipe, work, worker)
    if args.stage in ("train", "all"):
        train(recipe, work)
    if args.stage in ("export", "all"):
        export(recipe, work, args.out)


if __name__ == "__main__":
    main()
