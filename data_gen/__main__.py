"""``python -m data_gen [overrides]``: see conf/data_gen.yaml and docs/data_gen.md."""

import hydra
from omegaconf import DictConfig

from data_gen.app import run


@hydra.main(config_path="../conf", config_name="data_gen", version_base="1.3")
def main(cfg: DictConfig) -> None:
    run(cfg)


if __name__ == "__main__":
    main()
