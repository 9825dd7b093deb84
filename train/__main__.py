"""``python -m train``: see conf/train.yaml and docs/train.md."""

import warnings

import hydra
from omegaconf import DictConfig

from .app import run

# conf/hydra/launcher/{joblib,submitit_*}.yaml are our presets of the launcher plugins' configs of
# the same names, which Hydra validates them against (wanted) with a deprecation notice (not).
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train one head; return its dev KL (the value a Hydra sweeper minimises)."""
    metrics = run(cfg)["metrics"]
    return metrics.get("dev", metrics.get("train", {})).get("KL", float("nan"))


if __name__ == "__main__":
    main()
