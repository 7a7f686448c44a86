"""Matplotlib set-up shared by every figure: a headless backend, one figure constructor, atomic PNG
writes."""

from __future__ import annotations

import io
from pathlib import Path
from typing import Any


def figure(figsize: tuple[float, float], **subplots: Any):
    """``(plt, fig, axes)`` with the Agg backend and constrained layout."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=figsize, layout="constrained", **subplots)


def save(plt, fig, path: Path, dpi: int = 130) -> Path:
    """Write ``fig`` as a PNG atomically and close it."""
    from looplm.io import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=dpi)
    plt.close(fig)
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path
