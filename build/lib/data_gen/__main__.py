"""``python -m data_gen [overrides]``: see conf/data_gen.yaml and docs/data_gen.md."""

import warnings

import hydra
from omegaconf import DictConfig

from data_gen.app import run

# conf/hydra/launcher/{joblib,submitit_*}.yaml are our presets of the launcher plugins' configs of
# the same names, which Hydra validates them against (wanted) with a deprecation notice (not).
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


@hydra.main(config_path="../conf", config_name="data_gen", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
