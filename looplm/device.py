"""Devices: ``auto``/``cpu``/``cuda`` resolved the same way by training, evaluation, diagnostics,
the experiment runner and the commands (loop-depth lists are read by :mod:`looplm.settings`,
the progress switch is :mod:`looplm.progress`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

from looplm.errors import LoopLMError

if TYPE_CHECKING:  # torch is imported when a device is resolved, not when the CLI starts
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a one-line error."""
    import torch

    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LoopLMError("train.device=cuda but no CUDA GPU is available; use cpu or auto")
    return torch.device(name)
