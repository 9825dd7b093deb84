"""data_gen: the labelled dataset for acceptance heads (``python -m data_gen``)."""

from .app import DataGenResult, run

__all__ = ["DataGenResult", "run"]
