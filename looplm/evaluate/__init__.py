"""Evaluation: fixed-depth sweeps (here), adaptive depth, LAMBADA and transfer (submodules)."""

from looplm.evaluate.sweep import depth_sweep, evaluate_checkpoint

__all__ = ["depth_sweep", "evaluate_checkpoint"]
