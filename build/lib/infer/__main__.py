"""python -m infer [overrides]: see conf/infer.yaml and docs/infer.md."""

import warnings

import hydra

from infer.app import run

# conf/hydra/launcher/{joblib,submitit_*}.yaml are our presets of the launcher plugins' configs of
# the same names, which Hydra validates them against (wanted) with a deprecation notice (not).
warnings.filterwarnings("ignore", message=r"(?s).*is validated against ConfigStore schema with the same name")


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg) -> float | None:
    summary = run(cfg)
    print(f"{summary['path']}: {summary['rows']} rows ({summary['new_rows']} new), "
          f"tokens/s {summary['tokens_per_s']}")
    return summary["tokens_per_s"]


if __name__ == "__main__":
    main()
