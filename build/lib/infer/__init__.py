"""Inference benchmarks: every stopping method on the same pair, prompts and machine.

``python -m infer`` (one method, Hydra; ``-m`` sweeps), ``python -m infer.sweep`` (the paper's
whole comparison with the models loaded once), ``python -m infer.report RESULTS_DIR``.
"""

from .app import run

__all__ = ["run"]
