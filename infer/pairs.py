"""The draft/target pair of the argparse commands (``infer.costs``, ``infer.sequoia``): a
conf/pair/ config, with ``--draft`` / ``--target`` / ``--device`` / ``--dtype`` given on the
command line winning over it."""

from __future__ import annotations

from pathlib import Path

import torch
from omegaconf import OmegaConf

PAIR_DIR = Path(__file__).resolve().parents[1] / "conf" / "pair"


def pair_config(name: str) -> dict:
    """conf/pair/<name>.yaml with its interpolations resolved (the demo pair's paths follow
    $SPECDECPP_CACHE, as in infer); unset (``???``) entries are left out."""
    path = PAIR_DIR / f"{name}.yaml"
    if not path.is_file():
        choices = sorted(p.stem for p in PAIR_DIR.glob("*.yaml"))
        raise ValueError(f"--pair {name!r}: no conf/pair/{name}.yaml; choose among {choices} "
                         "or pass --draft and --target")
    cfg = OmegaConf.load(path)
    return {k: cfg[k] for k in cfg if not OmegaConf.is_missing(cfg, k)}


def command_pair(name: str, draft: str | None = None, target: str | None = None, device: str | None = None,
                 dtype: str | None = None) -> dict:
    """``{"draft", "target", "device", "dtype"}``: the given values, the rest from conf/pair/<name>.yaml
    (device ``auto`` resolved; default cpu and dtype ``fast``). A ValueError names a model that is
    not set or a local model directory that does not exist."""
    pair = {} if draft and target else pair_config(name)
    models = {"draft": draft or pair.get("draft"), "target": target or pair.get("target")}
    for which, ref in models.items():
        if not ref:
            raise ValueError(f"--pair {name} sets no {which} model: pass --{which} PATH")
        if str(ref).startswith((".", "/")) and not Path(ref).exists():
            raise ValueError(f"{which} model {str(ref)!r} does not exist (the demo pair: run `make demo-pair` first)")
    device = device or pair.get("device") or "cpu"
    if device == "auto":
        device = "cuda" if torch.cuda.is_available() else "cpu"
    return {"draft": str(models["draft"]), "target": str(models["target"]), "device": device,
            "dtype": dtype or pair.get("dtype") or "fast"}
