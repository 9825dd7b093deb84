"""A Lightning callback for tests that run `python -m train` in a subprocess: every rank fails once
at a given step, as a killed job would (its marker files make the rerun go through)."""

from pathlib import Path

import lightning as L


class CrashOnce(L.Callback):
    def __init__(self, step: int, marker: str) -> None:
        self.step, self.marker = step, marker

    def on_train_batch_start(self, trainer, pl_module, batch, batch_idx) -> None:
        marker = Path(f"{self.marker}.rank{trainer.global_rank}")
        if trainer.global_step == self.step and not marker.exists():
            marker.touch()
            raise RuntimeError(f"simulated crash at step {self.step}")
