"""python -m infer [overrides]: see conf/infer.yaml and docs/infer.md."""

import hydra

from infer.app import run


@hydra.main(config_path="../conf", config_name="infer", version_base="1.3")
def main(cfg) -> float | None:
    summary = run(cfg)
    print(f"{summary['path']}: {summary['rows']} rows ({summary['new_rows']} new), "
          f"tokens/s {summary['tokens_per_s']}")
    return summary["tokens_per_s"]


if __name__ == "__main__":
    main()
