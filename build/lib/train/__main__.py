"""``python -m train``: see conf/train.yaml and docs/train.md."""

import os
import sys
import warnings

import hydra
import torch
from hydra.core.hydra_config import HydraConfig
from hydra.types import RunMode
from omegaconf import DictConfig, read_write

from .app import run

# conf/hydra/launcher/{joblib,submitit_*}.yaml are our presets of the launcher plugins' configs of
# the same names, which Hydra validates them against (wanted) with a deprecation notice (not).
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


@hydra.main(config_path="../conf", config_name="train", version_base="1.3")
def main(cfg: DictConfig) -> float:
    """Train one head; return its dev KL (the value a Hydra sweeper minimises)."""
    _one_job_argv()
    environment = {key: os.environ.get(key) for key in DDP_LAUNCH_VARIABLES}
    try:
        metrics = run(cfg)["metrics"]
    finally:
        _end_ddp_job(environment)
    return metrics.get("dev", metrics.get("train", {})).get("KL", float("nan"))


# What Lightning's DDP launcher leaves in the launching process (its own environment): the next job
# of a multirun would take them for an external launch and start no ranks of its own.
DDP_LAUNCH_VARIABLES = ("MASTER_ADDR", "MASTER_PORT", "NODE_RANK", "LOCAL_RANK", "WORLD_SIZE")


def _end_ddp_job(environment: dict[str, str | None]) -> None:
    """Leave the process as the job found it: no process group, the launch variables as they were."""
    if torch.distributed.is_available() and torch.distributed.is_initialized():
        torch.distributed.destroy_process_group()
    for key, value in environment.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value


def _one_job_argv() -> None:
    """Lightning's DDP starts the other ranks by running ``sys.argv`` again (with Hydra's run dir);
    in a multirun job that would be the whole sweep. Hand it this job's overrides and directory."""
    hydra_cfg = HydraConfig.get()
    if hydra_cfg.mode == RunMode.MULTIRUN:
        sys.argv = [sys.argv[0], *hydra_cfg.overrides.task]
        with read_write(hydra_cfg.run):
            hydra_cfg.run.dir = hydra_cfg.runtime.output_dir


if __name__ == "__main__":
    main()
