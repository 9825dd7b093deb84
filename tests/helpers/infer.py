"""The infer app in tests: its Hydra config composed from overrides."""

from hydra import compose, initialize_config_dir

from tests.helpers.paths import CONF


def make_cfg(*overrides: str):
    with initialize_config_dir(config_dir=str(CONF), version_base="1.3"):
        return compose("infer", overrides=list(overrides))
