"""Evaluation: fixed-depth sweeps, adaptive depth, LAMBADA and transfer (submodules), and the
evaluation kinds the experiment runner iterates over (:mod:`looplm.evaluate.kinds`).

``depth_sweep`` and ``evaluate_checkpoint`` are imported lazily, so the kind registry loads
without torch.
"""

from __future__ import annotations

from typing import Any

__all__ = ["depth_sweep", "evaluate_checkpoint"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from looplm.evaluate import sweep

        return getattr(sweep, name)
    raise AttributeError(f"module 'looplm.evaluate' has no attribute {name!r}")
