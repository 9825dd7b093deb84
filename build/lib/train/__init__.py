"""Hydra app: train SpecDec++ acceptance heads (``python -m train +experiment=wrej6_d3``)."""

from .app import run

__all__ = ["run"]
