"""The report's figures: the depth response (paper Figure 3 style: PPL vs T on a base-2 depth
axis and a shifted-log ``log(PPL − c)`` axis), adaptive quality vs achieved average depth, and the
scaling-law fit. Each reads plain numbers (:class:`Series`, fitted parameters), never a store."""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.plotting import log2_depth_axis, new_figure, save_png


def choose_ppl_shift(low: float, high: float) -> float:
    """Shift c for the ``log(PPL − c)`` axis: a quarter of the data range below the lowest value.

    ``low``/``high`` are the lowest/highest plotted PPL (error bars included). The result is
    rounded down to 2 decimals and clipped at 0 (a plain log axis).
    """
    if not (math.isfinite(low) and math.isfinite(high)):
        raise LoopLMError(f"cannot choose a PPL axis shift from low={low}, high={high}")
    span = high - low
    c = low - (0.25 * span if span > 0 else 0.05 * abs(low) or 1.0)
    c = math.floor(c * 100.0) / 100.0
    return max(c, 0.0)


def _new_figure(figsize: tuple[float, float], ncols: int = 1):
    return new_figure(figsize, ncols=ncols, dpi=150)


def _nice_ticks(low: float, high: float, shift: float, max_ticks: int = 8) -> list[float]:
    """Round tick values (PPL units) spread evenly on the ``log(PPL − shift)`` axis.

    Candidates are multiples of decreasing "nice" steps (10^k, 5·10^(k−1), 2·10^(k−1), ...); a
    candidate is kept when it is at least 1/``max_ticks`` of the axis away (in transformed
    units) from every tick kept so far, so coarse round numbers win over fine ones.
    """

    def fw(v: float) -> float:
        return math.log(v - shift)

    z_lo, z_hi = fw(low), fw(high)
    gap = (z_hi - z_lo) / max_ticks
    span = max(high - low, 1e-12)
    top = math.floor(math.log10(span)) + 1
    ticks: list[float] = []
    zs: list[float] = []
    for e in range(top, top - 5, -1):
        for mult in (1.0, 0.5, 0.2):
            step = mult * 10.0**e
            k0, k1 = math.ceil(low / step), math.floor(high / step)
            if k1 - k0 > 400:
                continue
            for k in range(k0, k1 + 1):
                v = round(k * step, 10)
                if v <= shift:
                    continue
                z = fw(v)
                if all(abs(z - zz) >= gap for zz in zs):
                    ticks.append(v)
                    zs.append(z)
    return sorted(ticks)


def _shifted_log_axis(ax: Any, shift: float, low: float, high: float) -> None:
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    ax.set_yscale(
        "function",
        functions=(
            lambda y: np.log(np.maximum(np.asarray(y, dtype=float) - shift, 1e-12)),
            lambda z: np.exp(z) + shift,
        ),
    )
    pad = 0.04 * (math.log(high - shift) - math.log(low - shift))
    ax.set_ylim(
        math.exp(math.log(low - shift) - pad) + shift,
        math.exp(math.log(high - shift) + pad) + shift,
    )
    ticks = _nice_ticks(low, high, shift)
    ax.yaxis.set_major_locator(FixedLocator(ticks))
    ax.yaxis.set_major_formatter(FuncFormatter(lambda v, _pos: f"{v:g}"))
    ax.yaxis.set_minor_locator(NullLocator())


@dataclass
class Series:
    """One method's curve: x values, mean and std of y (std may be NaN)."""

    label: str
    x: list[float]
    mean: list[float]
    std: list[float]
    color: str | None = None
    x_std: list[float] | None = None


def _lower_bar(mean: float, sd: float) -> float:
    """The lower error bar, at most half the mean: PPL is positive, and a seed spread larger
    than the mean (one diverged seed) must not push the axis below zero."""
    return min(sd, 0.5 * mean)


def _yrange(series: Sequence[Series]) -> tuple[float, float]:
    lows, highs = [], []
    for s in series:
        for m, sd in zip(s.mean, s.std):
            if not math.isfinite(m):
                continue
            sd = sd if math.isfinite(sd) else 0.0
            lows.append(m - _lower_bar(m, sd))
            highs.append(m + sd)
    if not lows:
        raise LoopLMError("nothing to plot: no finite values")
    return min(lows), max(highs)


def _curves_with_minima(ax: Any, series: Sequence[Series]) -> None:
    """Mean ± std curves, a star on each curve's minimum, one neutral legend entry for stars."""
    star_done = False
    for s in series:
        std = [sd if math.isfinite(sd) else 0.0 for sd in s.std]
        low = [_lower_bar(m, sd) if math.isfinite(m) else 0.0 for m, sd in zip(s.mean, std)]
        ax.errorbar(
            s.x, s.mean, yerr=[low, std], color=s.color, marker="o", ms=4, lw=1.6, capsize=3,
            label=s.label, zorder=3,
        )  # fmt: skip
        finite = [(m, x) for m, x in zip(s.mean, s.x) if math.isfinite(m)]
        if finite:
            m, x = min(finite)
            ax.plot(
                [x], [m], marker="*", ms=15, color=s.color, mec="black", mew=0.7, ls="none",
                zorder=5,
            )  # fmt: skip
            star_done = True
    if star_done:  # neutral legend entry for the stars
        ax.plot(
            [], [], marker="*", ms=12, color="white", mec="black", mew=0.8, ls="none",
            label="per-method minimum",
        )  # fmt: skip


def plot_depth_response(
    series: Sequence[Series],
    path: str | os.PathLike,
    *,
    train_depth_max: int = 8,
    shift: float | None = None,
    title: str = "",
    ylabel: str = "PPL",
) -> float:
    """Depth-response figure (paper Figure 3 style); returns the PPL shift c used.

    x: loop depth T on a base-2 log axis; y: ``log(PPL − c)`` with ticks in PPL units; mean ± std
    error bars; a star on each method's minimum; the extra-loop region T > ``train_depth_max``
    shaded.
    """
    low, high = _yrange(series)
    if shift is None:
        shift = choose_ppl_shift(low, high)
    if shift >= low:
        raise LoopLMError(
            f"PPL axis shift c={shift} must be below the lowest plotted PPL {low:.4g}"
        )
    fig, ax = _new_figure((8.2, 4.4))
    xs = sorted({x for s in series for x in s.x})
    lo_x, hi_x = xs[0] / 1.18, xs[-1] * 1.18
    if hi_x > train_depth_max:
        ax.axvspan(
            train_depth_max,
            hi_x,
            color="0.85",
            alpha=0.6,
            lw=0,
            label=f"T > {train_depth_max} (extra-loop)",
            zorder=0,
        )
    _curves_with_minima(ax, series)
    log2_depth_axis(ax, xs, lo_x, hi_x)
    _shifted_log_axis(ax, shift, low, high)
    ax.set_xlabel("evaluation loop depth T (log2 axis)")
    ax.set_ylabel(f"{ylabel}  (axis: log({ylabel} − {shift:g}))")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", color="0.9", lw=0.6, zorder=1)
    fig.legend(fontsize=8, frameon=False, loc="outside right upper")
    save_png(fig, path)
    return shift


def plot_accuracy_response(
    series: Sequence[Series],
    path: str | os.PathLike,
    *,
    train_depth_max: int = 8,
    title: str = "",
) -> None:
    """Task accuracy (%) vs loop depth T on a base-2 log axis, mean ± std over seeds, the
    extra-loop region T > ``train_depth_max`` shaded: the synthetic tasks' depth response."""
    fig, ax = _new_figure((8.2, 4.4))
    xs = sorted({x for s in series for x in s.x})
    lo_x, hi_x = xs[0] / 1.18, xs[-1] * 1.18
    if hi_x > train_depth_max:
        ax.axvspan(train_depth_max, hi_x, color="0.85", alpha=0.6, lw=0,
                   label=f"T > {train_depth_max} (extra-loop)", zorder=0)  # fmt: skip
    for s in series:
        std = [sd if math.isfinite(sd) else 0.0 for sd in s.std]
        ax.errorbar(s.x, s.mean, yerr=std, color=s.color, marker="o", ms=4, lw=1.6, capsize=3,
                    label=s.label, zorder=3)  # fmt: skip
    log2_depth_axis(ax, xs, lo_x, hi_x)
    ax.set_ylim(0, 105)
    ax.set_xlabel("evaluation loop depth T (log2 axis)")
    ax.set_ylabel("task accuracy (%)")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", color="0.9", lw=0.6, zorder=1)
    fig.legend(fontsize=8, frameon=False, loc="outside right upper")
    save_png(fig, path)


# long: one figure's panels, axes and annotations
def plot_adaptive(
    uniform: Sequence[Series],
    adaptive: Sequence[tuple[str, str, Series]],
    path: str | os.PathLike,
    *,
    train_depth_max: int = 8,
    shift: float | None = None,
    title: str = "",
) -> float:
    """Adaptive quality vs achieved average depth; returns the PPL shift c used.

    ``uniform``: one Series per method (fixed-depth PPL vs T, dashed). ``adaptive``:
    ``(method_label, rule_family, Series)`` with x = achieved mean depth (x_std its std over
    seeds), drawn solid in the method's colour, one marker per rule family.
    """
    allser = list(uniform) + [s for _, _, s in adaptive]
    low, high = _yrange(allser)
    if shift is None:
        shift = choose_ppl_shift(low, high)
    fig, ax = _new_figure((8.6, 4.4))
    markers = ["s", "^", "D", "v", "P", "X"]
    fams = sorted({f for _, f, _ in adaptive})
    fam_marker = {f: markers[i % len(markers)] for i, f in enumerate(fams)}
    xs = [x for s in allser for x in s.x if math.isfinite(x)]
    lo_x, hi_x = min(xs) / 1.18, max(xs) * 1.18
    if hi_x > train_depth_max:
        ax.axvspan(train_depth_max, hi_x, color="0.9", alpha=0.6, lw=0, zorder=0)
    for s in uniform:
        ax.plot(
            s.x,
            s.mean,
            color=s.color,
            ls="--",
            lw=1.2,
            marker="o",
            ms=3,
            alpha=0.8,
            label=f"{s.label} (uniform depth)",
        )
    for label, fam, s in adaptive:
        order = np.argsort(s.x)
        x = [s.x[i] for i in order]
        m = [s.mean[i] for i in order]
        ystd = [s.std[i] if math.isfinite(s.std[i]) else 0.0 for i in order]
        xstd = None
        if s.x_std is not None:
            xstd = [s.x_std[i] if math.isfinite(s.x_std[i]) else 0.0 for i in order]
        eb = ax.errorbar(
            x,
            m,
            yerr=ystd,
            xerr=xstd,
            color=s.color,
            marker=fam_marker[fam],
            ms=6,
            lw=1.8,
            capsize=2,
            elinewidth=0.8,
            label=f"{label} ({fam})",
            zorder=4,
        )
        for bars in (*eb[1], *eb[2]):  # seed-spread bars faint: the rule curves stay readable
            bars.set_alpha(0.35)
    ticks = sorted({2**k for k in range(0, 8)} | {round(x) for s in uniform for x in s.x})
    ticks = [t for t in ticks if lo_x <= t <= hi_x]
    log2_depth_axis(ax, ticks, lo_x, hi_x)
    _shifted_log_axis(ax, shift, low, high)
    ax.set_xlabel("average active loop depth (log2 axis)")
    ax.set_ylabel(f"PPL  (axis: log(PPL − {shift:g}))")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6, zorder=1)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    save_png(fig, path)
    return shift
