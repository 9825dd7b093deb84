"""``python -m train``: see conf/train.yaml and docs/train.md."""

import hydra
from omegaconf import DictConfig

from .app import run


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train one head; return its dev KL (the value a Hydra sweeper minimises)."""
    metrics = run(cfg)["metrics"]
    return metrics.get("dev", metrics.get("train", {})).get("KL", float("nan"))


if __name__ == "__main__":
    main()
