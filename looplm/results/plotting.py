"""The one matplotlib set-up every looplm figure uses.

Figures are plain :class:`matplotlib.figure.Figure` objects on an Agg canvas: no pyplot state,
no backend switch, nothing left open between figures, safe in worker threads. They are written
as PNG through :func:`save_png` (atomically, like every looplm output file).
"""

from __future__ import annotations

import io
import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from looplm.io import atomic_write_bytes

# Stable colours for the methods people compare most; others take the default cycle.
METHOD_COLORS = {
    "scse": "#2ca02c",
    "looped": "#d62728",
    "tuned_adapter": "#1f77b4",
    "capacity_matched": "#9467bd",
    "step_conditioned": "#ff7f0e",
    "step_film": "#8c564b",
}
# One marker per adaptive-depth rule family, shared by the report and the supplement.
RULE_MARKERS = {"maxtoken": "s", "kl": "^", "router": "D"}
CYCLE = [f"C{i}" for i in range(10)]


def new_figure(
    figsize: tuple[float, float],
    *,
    nrows: int = 1,
    ncols: int = 1,
    dpi: float | None = None,
    layout: str | None = "constrained",
) -> tuple[Any, Any]:
    """``(figure, axes)``: a figure on an Agg canvas and ``figure.subplots(nrows, ncols)``."""
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=dpi, layout=layout)
    FigureCanvasAgg(fig)
    return fig, fig.subplots(nrows, ncols)


def save_png(
    fig: Any, path: str | os.PathLike, *, dpi: float | None = None, tight: bool = False
) -> Path:
    """Render ``fig`` as PNG to ``path`` atomically (folders created); returns the path."""
    buf = io.BytesIO()
    kw: dict[str, Any] = {"format": "png"}
    if dpi is not None:
        kw["dpi"] = dpi
    if tight:
        kw["bbox_inches"] = "tight"
    fig.savefig(buf, **kw)
    path = Path(path)
    atomic_write_bytes(path, buf.getvalue())
    return path


def method_color(method: str, i: int) -> str:
    """A stable colour per method name (falls back to the default cycle)."""
    return METHOD_COLORS.get(method, CYCLE[i % len(CYCLE)])


def log2_depth_axis(ax: Any, ticks: Sequence[float], lo: float, hi: float) -> None:
    """Loop depth on a base-2 log axis from ``lo`` to ``hi``, labelled at ``ticks``."""
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_xscale("log", base=2)
    ax.set_xlim(lo, hi)
    ticks = sorted(set(ticks))
    if len(ticks) > 12:  # dense sweeps (T = 1..48): labelled ticks at 1-2-3-4-6-8-12-… only
        nice = {m * 2**k for k in range(12) for m in (1, 3)}
        ticks = [t for t in ticks if t in nice] + [t for t in ticks[-1:] if t not in nice]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
