"""``python -m train``: see conf/train.yaml and docs/train.md."""

import sys
import warnings

import hydra
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, open_dict

from .app import run

# conf/hydra/launcher/{joblib,submitit_*}.yaml are our presets of the launcher plugins' configs of
# the same names, which Hydra validates them against (wanted) with a deprecation notice (not).
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train one head; return its dev KL (the value a Hydra sweeper minimises)."""
    _one_job_argv()
    metrics = run(cfg)["metrics"]
    return metrics.get("dev", metrics.get("train", {})).get("KL", float("nan"))


def _one_job_argv() -> None:
    """Lightning's DDP starts the other ranks by running ``sys.argv`` again (with Hydra's run dir);
    in a multirun job that would be the whole sweep. Hand it this job's overrides and directory."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
        with open_dict(hydra_cfg):
            hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


if __name__ == "__main__":
    main()
