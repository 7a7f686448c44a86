"""Turn a results store (or its JSON export) into paper-style tables, figures and results.json.

``write_report(store_path, out_dir)`` reads *files only* (never live models) and writes, atomically:

* ``report.md`` — per evaluation context (protocol × dataset × split × eval tag × calibration):
  a methods × depths table of mean ± std PPL (best per column in bold; extra-loop depths
  T > ``train_depth_max`` marked †), paired deltas of every method against the reference
  (Δ = reference − method, matched by seed and depth, 95 % t half-width and deterministic
  paired-bootstrap interval), task-accuracy tables when records carry ``n_correct`` /
  ``n_examples``, adaptive-depth tables (static T=8 | adaptive rules | static T=ceiling, with the
  achieved mean depth) and the scaling-law fit.
* ``figures/*.png`` — (a) the depth-response plot: PPL vs T on a base-2 depth axis and a
  shifted-log PPL axis ``log(PPL − c)`` with tick labels in PPL units (the paper's Figure 3 uses
  c = 84.85), per-method minima starred, T > 8 shaded, mean ± std error bars; (b) adaptive quality
  vs achieved average depth per rule, with the uniform-depth curve for reference; (c) the scaling
  fit (collapse onto the effective-parameter axis, and predicted vs observed).
* ``results.json`` — every number in the tables (per-seed values included), strict JSON.

Grouping rules: rows are (method, model_hash); when a method has several model hashes in one
table the row label carries the short hash. Records whose ``extra`` holds scaling-sweep fields go
to the scaling section only. Methods named ``unshared*`` are absolute references and are not
bolded (as in the paper), unless they are the only rows.
"""

from __future__ import annotations

import io
import json
import math
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.io import atomic_write_bytes, atomic_write_text
from looplm.results.scaling import ScalingFit, fit_records, is_scaling_record, scaling_points
from looplm.results.stats import (
    DEFAULT_SEEDS,
    EXPANDED_SEEDS,
    PairedDelta,
    SeedSpec,
    Summary,
    paired_deltas,
    resolve_seed_set,
    summarize,
)
from looplm.results.store import EvalRecord, group_by, load_records

CONTEXT_FIELDS = ("protocol", "dataset", "split", "eval_tag", "calibration")
ADAPTIVE_CONTEXT_FIELDS = ("protocol", "dataset", "split", "eval_tag")


# --------------------------------------------------------------------------- small helpers
def _decimals(x: float) -> int:
    if not math.isfinite(x) or x == 0:
        return 2
    return int(min(3, max(1, 3 - math.floor(math.log10(abs(x))))))


def _table_decimals(values: Sequence[float]) -> int:
    """Decimals for a whole table: 1 for values in the hundreds (as the paper), more when small."""
    vals = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not vals:
        return 2
    return int(min(3, max(1, 2 - math.floor(math.log10(float(np.median(vals)))))))


def fmt_num(x: float, decimals: int | None = None) -> str:
    """A number with ~4 significant digits (1–3 decimals); a real minus sign; 'n/a' for NaN."""
    if x is None or not math.isfinite(x):
        return "n/a"
    d = _decimals(x) if decimals is None else decimals
    return f"{x:.{d}f}".replace("-", "−")


def fmt_mean_std(mean: float, std: float, decimals: int | None = None) -> str:
    """``mean ± std`` (std omitted when undefined, e.g. one seed)."""
    d = _decimals(mean) if decimals is None else decimals
    if std is None or not math.isfinite(std):
        return fmt_num(mean, d)
    return f"{fmt_num(mean, d)} ± {fmt_num(std, d)}"


def _md_escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def _slug(parts: Sequence[Any]) -> str:
    text = "_".join(str(p) for p in parts if p not in ("", None))
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "all"


def _finite_or_none(obj: Any) -> Any:
    """Recursively replace NaN/inf by None so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): _finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [_finite_or_none(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return _finite_or_none(obj.item())
    return obj


def _method_order(methods: Sequence[str], reference: str) -> list[str]:
    others = sorted(m for m in methods if m != reference and not m.startswith("unshared"))
    tail = sorted(m for m in methods if m.startswith("unshared") and m != reference)
    return others + ([reference] if reference in methods else []) + tail


def _row_keys(records: Sequence[EvalRecord], reference: str) -> list[tuple[str, str]]:
    keys = sorted({(r.method, r.model_hash) for r in records})
    order = {m: i for i, m in enumerate(_method_order([k[0] for k in keys], reference))}
    return sorted(keys, key=lambda k: (order[k[0]], k[1]))


def _row_labels(keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    count: dict[str, int] = {}
    for m, _ in keys:
        count[m] = count.get(m, 0) + 1
    return {(m, h): (f"{m} [{h[:8]}]" if count[m] > 1 and h else m) for m, h in keys}


def _has_accuracy(rec: EvalRecord) -> bool:
    return "n_correct" in rec.extra and "n_examples" in rec.extra


def _adaptive_family(mode: str) -> str:
    return mode.split(":", 1)[0]


def _context_title(ctx: dict[str, str], code: bool = True) -> str:
    head = " / ".join(x for x in (ctx.get("dataset"), ctx.get("split")) if x) or "(no dataset)"
    q = "`" if code else ""
    bits = [f"{k} {q}{v}{q}" for k, v in ctx.items() if k not in ("dataset", "split") and v]
    return head + (" · " + ", ".join(bits) if bits else "")


# --------------------------------------------------------------------------- figures
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
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    fig = Figure(figsize=figsize, dpi=150, layout="constrained")
    FigureCanvasAgg(fig)
    axes = fig.subplots(1, ncols)
    return fig, axes


def _save_png(fig: Any, path: Path) -> None:
    buf = io.BytesIO()
    fig.savefig(buf, format="png")
    atomic_write_bytes(path, buf.getvalue())


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


def _log2_depth_axis(ax: Any, ticks: Sequence[float], lo: float, hi: float) -> None:
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


@dataclass
class Series:
    """One method's curve: x values, mean and std of y (std may be NaN)."""

    label: str
    x: list[float]
    mean: list[float]
    std: list[float]
    color: str | None = None
    x_std: list[float] | None = None


def _yrange(series: Sequence[Series]) -> tuple[float, float]:
    lows, highs = [], []
    for s in series:
        for m, sd in zip(s.mean, s.std):
            if not math.isfinite(m):
                continue
            sd = sd if math.isfinite(sd) else 0.0
            lows.append(m - sd)
            highs.append(m + sd)
    if not lows:
        raise LoopLMError("nothing to plot: no finite values")
    return min(lows), max(highs)


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
    star_done = False
    for s in series:
        std = [sd if math.isfinite(sd) else 0.0 for sd in s.std]
        ax.errorbar(
            s.x,
            s.mean,
            yerr=std,
            color=s.color,
            marker="o",
            ms=4,
            lw=1.6,
            capsize=3,
            label=s.label,
            zorder=3,
        )
        finite = [(m, x) for m, x in zip(s.mean, s.x) if math.isfinite(m)]
        if finite:
            m, x = min(finite)
            ax.plot(
                [x],
                [m],
                marker="*",
                ms=15,
                color=s.color,
                mec="black",
                mew=0.7,
                ls="none",
                zorder=5,
            )
            star_done = True
    if star_done:  # neutral legend entry for the stars
        ax.plot(
            [],
            [],
            marker="*",
            ms=12,
            color="white",
            mec="black",
            mew=0.8,
            ls="none",
            label="per-method minimum",
        )
    _log2_depth_axis(ax, xs, lo_x, hi_x)
    _shifted_log_axis(ax, shift, low, high)
    ax.set_xlabel("evaluation loop depth T (log2 axis)")
    ax.set_ylabel(f"{ylabel}  (axis: log({ylabel} − {shift:g}))")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, which="major", color="0.9", lw=0.6, zorder=1)
    fig.legend(fontsize=8, frameon=False, loc="outside right upper")
    _save_png(fig, Path(path))
    return shift


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
    _log2_depth_axis(ax, ticks, lo_x, hi_x)
    _shifted_log_axis(ax, shift, low, high)
    ax.set_xlabel("average active loop depth (log2 axis)")
    ax.set_ylabel(f"PPL  (axis: log(PPL − {shift:g}))")
    if title:
        ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6, zorder=1)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    _save_png(fig, Path(path))
    return shift


def plot_scaling(
    fit: ScalingFit, points: dict[str, np.ndarray], path: str | os.PathLike, *, title: str = ""
) -> None:
    """Scaling-fit figure: (left) ``L − B·D^−β`` vs ``N_once + r^φ N_rec`` with the fitted
    ``E + A·N^−α`` curve, points coloured by r; (right) predicted vs observed loss."""
    fig, (ax1, ax2) = _new_figure((10.0, 4.2), ncols=2)
    r, once, rec, d, y = (points[k] for k in ("r", "n_once", "n_rec", "d", "loss"))
    n_eff = fit.effective_params(r, once, rec)
    y_adj = y - fit.B * d ** (-fit.beta)
    rs = sorted(set(r.tolist()))
    for i, rv in enumerate(rs):
        sel = r == rv
        ax1.scatter(n_eff[sel], y_adj[sel], s=22, color=f"C{i}", label=f"r = {rv:g}", zorder=3)
        pred = fit.predict(r[sel], once[sel], rec[sel], d[sel])
        ax2.scatter(pred, y[sel], s=22, color=f"C{i}", label=f"r = {rv:g}", zorder=3)
    grid = np.geomspace(n_eff.min() / 1.2, n_eff.max() * 1.2, 200)
    ax1.plot(grid, fit.E + fit.A * grid ** (-fit.alpha), color="black", lw=1.2, label="fit")
    from matplotlib.ticker import NullFormatter

    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel(r"effective parameters $N_\mathrm{once} + r^{\varphi} N_\mathrm{rec}$")
    ax1.set_ylabel(r"loss $-\ B\,D^{-\beta}$  (nats)")
    ax1.set_title(f"φ = {fit.phi:.3f}, α = {fit.alpha:.3f}, E = {fit.E:.3f}", fontsize=10)
    ax1.legend(fontsize=8, frameon=False)
    ax1.grid(True, color="0.9", lw=0.6)
    lo = float(min(y.min(), fit.predict(r, once, rec, d).min()))
    hi = float(max(y.max(), fit.predict(r, once, rec, d).max()))
    pad = 0.03 * (hi - lo or 1.0)
    ax2.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.5", lw=1, ls="--")
    ax2.set_xlim(lo - pad, hi + pad)
    ax2.set_ylim(lo - pad, hi + pad)
    ax2.set_xlabel("predicted loss (nats)")
    ax2.set_ylabel("observed loss (nats)")
    ax2.set_title(f"RMSE(log L) = {fit.rmse_log:.2g}, {fit.n_points} points", fontsize=10)
    ax2.grid(True, color="0.9", lw=0.6)
    if title:
        fig.suptitle(title, fontsize=10)
    _save_png(fig, Path(path))


# --------------------------------------------------------------------------- the report
@dataclass
class ReportResult:
    """Paths written by :func:`write_report`."""

    out_dir: Path
    report_md: Path
    results_json: Path
    figures: list[Path] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)


class _Builder:
    def __init__(
        self,
        records: list[EvalRecord],
        *,
        source: str,
        out_dir: Path,
        reference: str,
        seeds: SeedSpec,
        train_depth_max: int,
        allow_incomplete: bool,
        n_boot: int,
        boot_seed: int,
        confidence: float,
        ppl_shift: float | None,
        figures: bool,
    ) -> None:
        self.records = records
        self.source = source
        self.out_dir = out_dir
        self.reference = reference
        self.seed_spec = seeds
        self.train_depth_max = train_depth_max
        self.on_incomplete = "mark" if allow_incomplete else "raise"
        self.n_boot, self.boot_seed, self.confidence = n_boot, boot_seed, confidence
        self.ppl_shift = ppl_shift
        self.make_figures = figures
        self.md: list[str] = []
        self.json: dict[str, Any] = {}
        self.figures: list[Path] = []
        self.incomplete: list[str] = []
        self._slugs: set[str] = set()
        methods = sorted({r.method for r in records})
        self.colors = {m: f"C{i % 10}" for i, m in enumerate(_method_order(methods, reference))}
        # the paired-delta seed restriction: explicit sets restrict, "auto"/"all" pair what exists
        if seeds is None or (isinstance(seeds, str) and seeds in ("auto", "all")):
            self.pair_seeds = None
        else:
            self.pair_seeds = resolve_seed_set(seeds)

    # -- helpers --------------------------------------------------------------------------
    def _unique_slug(self, prefix: str, parts: Sequence[Any]) -> str:
        base = f"{prefix}_{_slug(parts)}"
        slug, i = base, 2
        while slug in self._slugs:
            slug, i = f"{base}_{i}", i + 1
        self._slugs.add(slug)
        return slug

    def _summary(self, recs: list[EvalRecord], metric: str, label: str) -> Summary:
        s = summarize(
            recs,
            metric,
            required_seeds=self.seed_spec,
            on_incomplete=self.on_incomplete,
            label=label,
        )
        if not s.complete:
            self.incomplete.append(f"{label} ({metric}): " + _problem(s))
        return s

    def _seed_text(self) -> str:
        spec = self.seed_spec
        if isinstance(spec, str) and spec == "auto":
            return (
                f"auto: the expanded set {list(EXPANDED_SEEDS)} where all of it is present, "
                f"else the default set {list(DEFAULT_SEEDS)}"
            )
        if spec is None or spec == "all":
            return "all seeds present (no required set)"
        return f"required seeds {list(resolve_seed_set(spec))}"

    # -- sections -------------------------------------------------------------------------
    def build(self) -> None:
        scaling = [r for r in self.records if is_scaling_record(r)]
        rest = [r for r in self.records if not is_scaling_record(r)]
        fixed = [r for r in rest if not r.adaptive_mode]
        adaptive = [r for r in rest if r.adaptive_mode]
        self.md += [
            "# looplm results report",
            "",
            f"Source: `{self.source}` ({len(self.records)} evaluations). "
            f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.",
            "",
            "Aggregation (paper, *Seed Protocol and Aggregation*): per seed, PPL = "
            "exp(Σ NLL / Σ tokens) over all batches; cells show the mean ± sample std (ddof = 1) "
            f"over seeds; seed set: {self._seed_text()}. Paired deltas Δ = "
            f"`{self.reference}` − method are matched by seed and loop depth; ± is the "
            f"{self.confidence:.0%} small-sample t half-width and [lo, hi] the deterministic "
            f"paired-bootstrap percentile interval ({self.n_boot:,} resamples, seed "
            f"{self.boot_seed}). † marks extra-loop depths T > {self.train_depth_max}.",
            "",
        ]
        self.json = {
            "source": self.source,
            "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
            "n_records": len(self.records),
            "reference": self.reference,
            "seed_set": self.seed_spec
            if isinstance(self.seed_spec, (str, type(None)))
            else list(self.seed_spec),
            "train_depth_max": self.train_depth_max,
            "confidence": self.confidence,
            "n_boot": self.n_boot,
            "boot_seed": self.boot_seed,
            "fixed_depth": [],
            "adaptive": [],
            "scaling": [],
        }
        fixed_ctx = group_by(fixed, CONTEXT_FIELDS)
        for key in sorted(fixed_ctx):
            self._fixed_section(dict(zip(CONTEXT_FIELDS, key)), fixed_ctx[key])
        adaptive_ctx = group_by(adaptive, ADAPTIVE_CONTEXT_FIELDS)
        for key in sorted(adaptive_ctx):
            self._adaptive_section(
                dict(zip(ADAPTIVE_CONTEXT_FIELDS, key)), adaptive_ctx[key], fixed
            )
        if scaling:
            self._scaling_section(scaling)
        if self.incomplete:
            self.md += ["## Incomplete summaries", ""]
            self.md += [f"- {_md_escape(x)}" for x in self.incomplete]
            self.md.append("")
        self.json["incomplete"] = self.incomplete
        self.json["figures"] = [str(p.relative_to(self.out_dir)) for p in self.figures]

    def _depth_header(self, depths: Sequence[int]) -> list[str]:
        return [f"T={d}" + ("†" if d > self.train_depth_max else "") for d in depths]

    def _table(
        self,
        rows: list[tuple[str, str]],
        labels: dict[tuple[str, str], str],
        depths: list[int],
        cells: dict[tuple[tuple[str, str], int], Summary],
        *,
        scale: float = 1.0,
        lower_is_better: bool = True,
    ) -> tuple[list[str], int]:
        """Markdown methods × depths table of mean ± std with the best per column in bold.

        Returns the lines and the number of decimals used (one choice for the whole table).
        """
        contenders = [k for k in rows if not k[0].startswith("unshared")] or rows
        text: dict[tuple[tuple[str, str], int], str] = {}
        dec = _table_decimals([s.mean * scale for s in cells.values()])
        for d in depths:
            col = {k: cells[(k, d)] for k in rows if (k, d) in cells}
            for k, s in col.items():
                text[(k, d)] = fmt_mean_std(s.mean * scale, s.std * scale, dec)
            best_vals = [
                col[k].mean * scale for k in contenders if k in col and math.isfinite(col[k].mean)
            ]
            if best_vals and len(col) > 1:
                best = fmt_num(min(best_vals) if lower_is_better else max(best_vals), dec)
                for k in contenders:
                    if k in col and fmt_num(col[k].mean * scale, dec) == best:
                        text[(k, d)] = f"**{text[(k, d)]}**"
            for k, s in col.items():
                if not s.complete:
                    text[(k, d)] += " ⚠"
        out = [
            "| Method | seeds | " + " | ".join(self._depth_header(depths)) + " |",
            "|---|---|" + "---:|" * len(depths),
        ]
        for k in rows:
            ns = sorted({cells[(k, d)].n for d in depths if (k, d) in cells})
            ntext = str(ns[0]) if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"
            out.append(
                f"| {_md_escape(labels[k])} | {ntext} | "
                + " | ".join(text.get((k, d), "–") for d in depths)
                + " |"
            )
        return out, dec

    def _fixed_section(self, ctx: dict[str, str], recs: list[EvalRecord]) -> None:
        title = _context_title(ctx)
        rows = _row_keys(recs, self.reference)
        labels = _row_labels(rows)
        by_cell = group_by(recs, ("method", "model_hash", "depth"))
        depths = sorted({r.depth for r in recs})
        ppl: dict[tuple[tuple[str, str], int], Summary] = {}
        acc: dict[tuple[tuple[str, str], int], Summary] = {}
        for (m, h, d), cell in by_cell.items():
            label = f"{title}: {labels[(m, h)]} T={d}"
            ppl[((m, h), d)] = self._summary(cell, "ppl", label)
            acc_recs = [r for r in cell if _has_accuracy(r)]
            if acc_recs:
                acc[((m, h), d)] = self._summary(acc_recs, "accuracy", label)
        self.md += [f"## {title}", "", "### PPL (mean ± std over seeds)", ""]
        lines, dec = self._table(rows, labels, depths, ppl)
        self.md += lines
        bold_note = "**Bold**: lowest mean per column"
        if any(k[0].startswith("unshared") for k in rows):
            bold_note += " among shared-block rows (unshared* rows are absolute references)"
        bold_note += "."
        if not all(s.complete for s in ppl.values()):
            bold_note += " ⚠: incomplete seed set (listed at the end)."
        self.md += ["", bold_note, ""]
        entry: dict[str, Any] = {
            "context": ctx,
            "depths": depths,
            "rows": [
                {
                    "method": k[0],
                    "model_hash": k[1],
                    "label": labels[k],
                    "ppl": {str(d): ppl[(k, d)].to_dict() for d in depths if (k, d) in ppl},
                    "accuracy": {str(d): acc[(k, d)].to_dict() for d in depths if (k, d) in acc},
                }
                for k in rows
            ],
        }
        # figure (a): depth response
        if self.make_figures and len(depths) >= 2:
            series = []
            for k in rows:
                ds = [d for d in depths if (k, d) in ppl and math.isfinite(ppl[(k, d)].mean)]
                if ds:
                    series.append(
                        Series(
                            labels[k],
                            ds,
                            [ppl[(k, d)].mean for d in ds],
                            [ppl[(k, d)].std for d in ds],
                            self.colors[k[0]],
                        )
                    )
            if series:
                slug = self._unique_slug("depth_response", ctx.values())
                path = self.out_dir / "figures" / f"{slug}.png"
                shift = plot_depth_response(
                    series,
                    path,
                    train_depth_max=self.train_depth_max,
                    shift=self.ppl_shift,
                    title=_context_title(ctx, code=False),
                )
                self.figures.append(path)
                entry["depth_response_figure"] = {"path": f"figures/{slug}.png", "ppl_shift": shift}
                self.md += [
                    f"![PPL vs loop depth, {title}](figures/{slug}.png)",
                    "",
                    f"*Depth response: PPL axis log(PPL − {shift:g}), ticks in PPL; "
                    f"stars mark per-method minima; shaded: T > {self.train_depth_max}.*",
                    "",
                ]
        # paired deltas vs the reference
        entry["deltas"] = self._delta_block(recs, rows, labels, "ppl", "PPL", dec + 1)
        if acc:
            self.md += ["### Task accuracy (%, mean ± std over seeds)", ""]
            lines, adec = self._table(rows, labels, depths, acc, scale=100.0, lower_is_better=False)
            self.md += lines
            self.md += ["", "**Bold**: highest mean per column.", ""]
            acc_recs = [r for r in recs if _has_accuracy(r)]
            entry["accuracy_deltas"] = self._delta_block(
                acc_recs,
                _row_keys(acc_recs, self.reference),
                labels,
                "accuracy",
                "accuracy, percentage points",
                adec + 1,
                scale=100.0,
            )
        self.json["fixed_depth"].append(entry)

    def _delta_block(
        self,
        recs: list[EvalRecord],
        rows: list[tuple[str, str]],
        labels: dict[tuple[str, str], str],
        metric: str,
        unit: str,
        dec: int,
        scale: float = 1.0,
    ) -> list[dict[str, Any]]:
        ref_rows = [k for k in rows if k[0] == self.reference]
        others = [k for k in rows if k[0] != self.reference]
        if not others:
            return []
        if not ref_rows:
            self.md += [
                f"*No paired deltas: reference method `{self.reference}` is not in this table.*",
                "",
            ]
            return []
        if len(ref_rows) > 1:
            self.md += [
                f"*No paired deltas: reference `{self.reference}` has several model "
                f"configurations here ({', '.join(h[:8] for _, h in ref_rows)}); give "
                "them distinct protocols to compare them separately.*",
                "",
            ]
            return []
        ref = ref_rows[0]
        by_row = group_by(recs, ("method", "model_hash"))
        out, lines = [], []
        for k in others:
            for pd in paired_deltas(
                by_row[ref],
                by_row[k],
                metric,
                seeds=self.pair_seeds,
                confidence=self.confidence,
                n_boot=self.n_boot,
                boot_seed=self.boot_seed,
            ):
                out.append({"method": k[0], "model_hash": k[1], "label": labels[k], **pd.to_dict()})
                lines.append(self._delta_line(labels[k], pd, scale, dec))
        if lines:
            lower = "lower" if metric != "accuracy" else "lower (worse)"
            self.md += [
                f"### Paired deltas vs `{self.reference}` ({unit}; Δ = {self.reference} − method)",
                "",
                "| Method | T | n | Δ mean ± t-hw | bootstrap interval | seeds |",
                "|---|---:|---:|---:|---:|---|",
            ]
            self.md += lines
            self.md += [
                "",
                f"Negative Δ: `{self.reference}` is {lower}. ± is the "
                f"{self.confidence:.0%} t half-width (n − 1 degrees of freedom); the "
                "bootstrap interval resamples paired seeds. Intervals are paired "
                "robustness checks, not large-sample significance claims.",
                "",
            ]
        return out

    def _delta_line(self, label: str, pd: PairedDelta, scale: float, dec: int) -> str:
        hw = fmt_num(pd.t_halfwidth * scale, dec)
        mean = fmt_num(pd.mean * scale, dec)
        boot = (
            f"[{fmt_num(pd.boot_lo * scale, dec)}, {fmt_num(pd.boot_hi * scale, dec)}]"
            if math.isfinite(pd.boot_lo)
            else "n/a"
        )
        tmark = "†" if pd.depth > self.train_depth_max else ""
        return (
            f"| {_md_escape(label)} | {pd.depth}{tmark} | {pd.n} | {mean} ± {hw} | {boot} | "
            f"{','.join(map(str, pd.seeds))} |"
        )

    def _adaptive_section(
        self, ctx: dict[str, str], recs: list[EvalRecord], fixed: list[EvalRecord]
    ) -> None:
        title = _context_title(ctx)
        static_ctx = [
            r
            for r in fixed
            if all(getattr(r, f) == v for f, v in ctx.items()) and r.calibration == ""
        ]
        for (ceiling,), crecs in sorted(group_by(recs, ("depth",)).items()):
            self._adaptive_table(ctx, title, ceiling, crecs, static_ctx)

    def _adaptive_table(
        self,
        ctx: dict[str, str],
        title: str,
        ceiling: int,
        crecs: list[EvalRecord],
        static_ctx: list[EvalRecord],
    ) -> None:
        rows = _row_keys(crecs, self.reference)
        labels = _row_labels(rows)
        cols_raw = sorted({(r.adaptive_mode, r.calibration) for r in crecs})
        cells = group_by(crecs, ("method", "model_hash", "adaptive_mode", "calibration"))
        ppl: dict[tuple, Summary] = {}
        depth_s: dict[tuple, Summary] = {}
        for (m, h, mode, cal), cell in cells.items():
            label = f"{title}: {labels[(m, h)]} {mode}" + (f" ({cal})" if cal else "")
            ppl[((m, h), (mode, cal))] = self._summary(cell, "ppl", label)
            depth_s[((m, h), (mode, cal))] = self._summary(cell, "mean_depth", label)

        def col_depth(c: tuple[str, str]) -> float:
            vals = [depth_s[(k, c)].mean for k in rows if (k, c) in depth_s]
            return float(np.nanmean(vals)) if vals else math.inf

        cols = sorted(cols_raw, key=lambda c: (_adaptive_family(c[0]), col_depth(c), c))
        static_depths = sorted({self.train_depth_max, ceiling})
        static: dict[tuple, Summary] = {}
        srecs = group_by(
            [r for r in static_ctx if (r.method, r.model_hash) in set(rows)],
            ("method", "model_hash", "depth"),
        )
        for (m, h, d), cell in srecs.items():
            label = f"{title}: {labels[(m, h)]} T={d} (static)"
            static[((m, h), d)] = self._summary(cell, "ppl", label)
        heads = (
            [f"Static T={static_depths[0]}"]
            + [c[0] + (f" ({c[1]})" if c[1] else "") for c in cols]
            + ([f"Static T={static_depths[-1]}"] if len(static_depths) > 1 else [])
        )
        keys: list[tuple] = [("static", static_depths[0])] + [("adaptive", c) for c in cols]
        if len(static_depths) > 1:
            keys.append(("static", static_depths[-1]))
        text: dict[tuple, str] = {}
        contenders = [k for k in rows if not k[0].startswith("unshared")] or rows
        dec = _table_decimals([x.mean for x in list(ppl.values()) + list(static.values())])
        for kind, c in keys:
            col = {}
            for k in rows:
                s = static.get((k, c)) if kind == "static" else ppl.get((k, c))
                if s is not None:
                    col[k] = s
            if not col:
                continue
            best_vals = [col[k].mean for k in contenders if k in col and math.isfinite(col[k].mean)]
            best = fmt_num(min(best_vals), dec) if best_vals and len(col) > 1 else None
            for k, s in col.items():
                t = fmt_mean_std(s.mean, s.std, dec)
                if best is not None and k in contenders and fmt_num(s.mean, dec) == best:
                    t = f"**{t}**"
                if kind == "adaptive":
                    ds = depth_s[(k, c)]
                    t += f" (d̄ {fmt_num(ds.mean, 1)})"
                if not s.complete:
                    t += " ⚠"
                text[(k, (kind, c))] = t
        self.md += [
            f"## Adaptive depth — {title}, ceiling T={ceiling}",
            "",
            "| Method | " + " | ".join(_md_escape(h) for h in heads) + " |",
            "|---|" + "---:|" * len(heads),
        ]
        for k in rows:
            self.md.append(
                f"| {_md_escape(labels[k])} | "
                + " | ".join(text.get((k, key), "–") for key in keys)
                + " |"
            )
        self.md += [
            "",
            "Cells: test PPL mean ± std over seeds; d̄: achieved mean active "
            "depth (mean over seeds). **Bold**: lowest PPL per column.",
            "",
        ]
        entry = {
            "context": ctx,
            "ceiling": ceiling,
            "rows": [
                {
                    "method": k[0],
                    "model_hash": k[1],
                    "label": labels[k],
                    "adaptive": [
                        {
                            "adaptive_mode": c[0],
                            "calibration": c[1],
                            "ppl": ppl[(k, c)].to_dict(),
                            "mean_depth": depth_s[(k, c)].to_dict(),
                        }
                        for c in cols
                        if (k, c) in ppl
                    ],
                    "static": {
                        str(d): static[(k, d)].to_dict() for d in static_depths if (k, d) in static
                    },
                }
                for k in rows
            ],
        }
        if self.make_figures:
            uniform, adapt = [], []
            for k in rows:
                allfix = group_by(
                    [r for r in static_ctx if (r.method, r.model_hash) == k], ("depth",)
                )
                ds = sorted(d for (d,) in allfix)
                if ds:
                    sums = [self._quiet_summary(allfix[(d,)]) for d in ds]
                    uniform.append(
                        Series(
                            labels[k],
                            ds,
                            [s.mean for s in sums],
                            [s.std for s in sums],
                            self.colors[k[0]],
                        )
                    )
                for fam in sorted({_adaptive_family(c[0]) for c in cols}):
                    fc = [c for c in cols if _adaptive_family(c[0]) == fam and (k, c) in ppl]
                    if fc:
                        adapt.append(
                            (
                                labels[k],
                                fam,
                                Series(
                                    labels[k],
                                    [depth_s[(k, c)].mean for c in fc],
                                    [ppl[(k, c)].mean for c in fc],
                                    [ppl[(k, c)].std for c in fc],
                                    self.colors[k[0]],
                                    [depth_s[(k, c)].std for c in fc],
                                ),
                            )
                        )
            if adapt:
                slug = self._unique_slug("adaptive", list(ctx.values()) + [f"T{ceiling}"])
                path = self.out_dir / "figures" / f"{slug}.png"
                shift = plot_adaptive(
                    uniform,
                    adapt,
                    path,
                    train_depth_max=self.train_depth_max,
                    shift=self.ppl_shift,
                    title=f"{_context_title(ctx, False)}, ceiling {ceiling}",
                )
                self.figures.append(path)
                entry["figure"] = {"path": f"figures/{slug}.png", "ppl_shift": shift}
                self.md += [
                    f"![adaptive depth, {title}](figures/{slug}.png)",
                    "",
                    "*PPL vs achieved average depth per adaptive rule (solid), with "
                    "the uniform-depth curve (dashed); faint bars: ±1 std over seeds.*",
                    "",
                ]
        self.json["adaptive"].append(entry)

    def _quiet_summary(self, recs: list[EvalRecord]) -> Summary:
        """Summary for reference curves in figures: never raises, never reports."""
        return summarize(recs, "ppl", required_seeds=self.seed_spec, on_incomplete="mark")

    def _scaling_section(self, recs: list[EvalRecord]) -> None:
        self.md += [
            "## Recurrence scaling law (the recurrence-equivalence exponent φ)",
            "",
            "L = E + A·(N_once + r^φ·N_rec)^−α + B·D^−β, fitted in log space (Huber, "
            "multiple starts); L is the token-weighted mean NLL (nats).",
            "",
            "| Method | context | points | φ | E | A | α | B | β | RMSE(log L) |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        fields = ("method",) + ADAPTIVE_CONTEXT_FIELDS
        for key, grp in sorted(group_by(recs, fields).items()):
            ctx = dict(zip(fields, key))
            ctx_text = _context_title({k: v for k, v in ctx.items() if k != "method"})
            try:
                fit = fit_records(grp)
            except LoopLMError as exc:
                notes.append(f"- `{ctx['method']}` ({ctx_text}): no fit — {exc}")
                self.json["scaling"].append({"context": ctx, "error": str(exc)})
                continue
            self.md.append(
                f"| {_md_escape(ctx['method'])} | {_md_escape(ctx_text)} | {fit.n_points} | "
                f"**{fit.phi:.3f}** | {fit.E:.3f} | {fit.A:.4g} | {fit.alpha:.3f} | {fit.B:.4g} | "
                f"{fit.beta:.3f} | {fit.rmse_log:.2g} |"
            )
            entry: dict[str, Any] = {"context": ctx, "fit": fit.to_dict()}
            if self.make_figures:
                slug = self._unique_slug("scaling", ctx.values())
                path = self.out_dir / "figures" / f"{slug}.png"
                plain = _context_title({k: v for k, v in ctx.items() if k != "method"}, False)
                plot_scaling(fit, scaling_points(grp), path, title=f"{ctx['method']} — {plain}")
                self.figures.append(path)
                entry["figure"] = f"figures/{slug}.png"
                notes.append(f"![scaling fit {ctx['method']}](figures/{slug}.png)")
            self.json["scaling"].append(entry)
        self.md += [""] + notes + [""]


def _problem(s: Summary) -> str:
    parts = []
    if s.missing:
        parts.append(f"missing seed(s) {list(s.missing)}")
    if s.duplicates:
        parts.append(f"duplicate seed(s) {list(s.duplicates)}")
    return "; ".join(parts) + f"; used {list(s.seeds)}"


def write_report(
    store_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    *,
    reference: str = "scse",
    seeds: SeedSpec = "auto",
    train_depth_max: int = 8,
    allow_incomplete: bool = False,
    n_boot: int = 10_000,
    boot_seed: int = 0,
    confidence: float = 0.95,
    ppl_shift: float | None = None,
    figures: bool = True,
) -> ReportResult:
    """Write ``report.md``, ``results.json`` and ``figures/*.png`` for a results file.

    Args:
        store_path: a SQLite results store, or a JSON file from ``ResultsStore.export_json``.
        out_dir: output folder (created).
        reference: method the paired deltas are taken against (Δ = reference − method).
        seeds: required seed set — a list of ints, ``"default"``, ``"expanded"``, ``"auto"``
            (expanded where all five are present, else default) or ``"all"``.
        train_depth_max: largest training loop depth; deeper T are marked extra-loop.
        allow_incomplete: mark summaries with missing/duplicate seeds instead of raising.
        n_boot, boot_seed, confidence: paired-bootstrap and t-interval settings.
        ppl_shift: fixed c for the ``log(PPL − c)`` axis (default: chosen per figure).
        figures: also render the PNG figures.

    Raises LoopLMError for a missing/unreadable store, an empty store, or (unless
    ``allow_incomplete``) a summary whose seed set is incomplete or duplicated.
    """
    if int(train_depth_max) < 1:
        raise LoopLMError(f"train_depth_max must be >= 1, got {train_depth_max}")
    if int(n_boot) < 1:
        raise LoopLMError(f"n_boot must be >= 1, got {n_boot}")
    if not 0 < confidence < 1:
        raise LoopLMError(f"confidence must be in (0, 1), got {confidence}")
    resolve_seed_set(seeds)  # validate early
    records = load_records(store_path)
    if not records:
        raise LoopLMError(f"results file {str(store_path)!r} holds no evaluations")
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b = _Builder(
        records,
        source=str(store_path),
        out_dir=out,
        reference=reference,
        seeds=seeds,
        train_depth_max=int(train_depth_max),
        allow_incomplete=allow_incomplete,
        n_boot=int(n_boot),
        boot_seed=int(boot_seed),
        confidence=float(confidence),
        ppl_shift=ppl_shift,
        figures=figures,
    )
    b.build()
    md_path, json_path = out / "report.md", out / "results.json"
    atomic_write_text(md_path, "\n".join(b.md).rstrip() + "\n")
    atomic_write_text(
        json_path, json.dumps(_finite_or_none(b.json), indent=2, allow_nan=False) + "\n"
    )
    return ReportResult(out, md_path, json_path, b.figures, b.incomplete)
