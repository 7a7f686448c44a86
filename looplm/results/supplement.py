"""``supplement.md`` and its figures: what the main report does not tabulate.

Per adaptive rule: the achieved depth vs the target, quality relative to uniform depth at the same
average depth (paired by seed), the FLOP proxy and the measured wall clock (with and without work
skipping, and uniform fixed-depth timings), the router's fit; and LAMBADA exact-word accuracy.
Reads the store file only, through the typed fields of :mod:`looplm.results.metrics`.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from looplm.io import atomic_write_text
from looplm.results.export import load_records
from looplm.results.metrics import AdaptiveFields, CompletionFields
from looplm.results.plotting import RULE_MARKERS, new_figure, save_png
from looplm.results.store import EvalRecord, group_by
from looplm.results.tables import slug

CONTEXT_FIELDS = ("protocol", "dataset", "split", "eval_tag")
HEADER = [
    "# Supplement: adaptive-depth quality, runtime and LAMBADA exact-word accuracy",
    "",
    "Source: `{store}`. Values are mean ± sample std over seeds (std omitted for one "
    "seed). Wall clock is measured on the evaluation machine, summed over the capped "
    "evaluation set (the minimum over the configured timing repeats); on a shared machine it "
    "is noisy.",
    "",
]
ADAPTIVE_NOTE = (
    "*target*: calibrated mean budget (max-token rule, calibrated on validation). "
    "*achieved*: mean active loops per scored token on this split. *Δ vs uniform*: PPL "
    "relative to the same seed's uniform-depth PPL at the same (fractional) average depth, "
    "log-linearly interpolated between evaluated depths; negative = better than spending "
    "the same average depth uniformly. *body FLOPs/token*: Eq. 20 proxy at the achieved "
    "depth (idealised: the per-token rules still compute keys/values of halted tokens). "
    "*no skipping*: the per-token rule run with the dense block on every token."
)


def _mean_std(vals: Sequence[float | None]) -> tuple[float, float]:
    a = np.asarray([v for v in vals if v is not None and math.isfinite(v)], dtype=float)
    if a.size == 0:
        return math.nan, math.nan
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else math.nan


def _fmt(m: float, s: float, d: int = 2) -> str:
    if not math.isfinite(m):
        return "–"
    return f"{m:.{d}f}" + (f" ± {s:.{d}f}" if math.isfinite(s) else "")


def uniform_ppl_at(fixed: dict[int, float], depth: float) -> float:
    """Uniform-depth PPL at a fractional depth: linear interpolation of log PPL between the
    evaluated depths (NaN outside their range)."""
    ds = sorted(fixed)
    if not ds or not ds[0] <= depth <= ds[-1]:
        return math.nan
    return float(np.exp(np.interp(depth, ds, [math.log(fixed[d]) for d in ds])))


@dataclass
class _Points:
    """What the two adaptive figures plot, per (method, rule family)."""

    rel: dict[tuple[str, str], list[tuple[float, float, float, float]]]
    wall: dict[tuple[str, str], list[tuple[float, float]]]
    dense: dict[tuple[str, str], list[tuple[float, float]]]
    uniform_wall: dict[str, dict[int, list[float]]]


def write_supplement(store_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """Write ``<out_dir>/supplement.md`` and its figures; returns ``{"md", "figures"}``."""
    out = Path(out_dir)
    recs = load_records(store_path)
    md = [line.format(store=store_path) for line in HEADER]
    figures: list[Path] = []
    adaptive = [r for r in recs if r.adaptive_mode]
    fixed_all = [r for r in recs if not r.adaptive_mode and not r.calibration]
    for key, crecs in sorted(group_by(adaptive, CONTEXT_FIELDS + ("depth",)).items()):
        lines, figs = _adaptive_context(key, crecs, fixed_all, out)
        md += lines
        figures += figs
    lam = [r for r in recs if r.dataset == "lambada" and not r.adaptive_mode]
    for (proto, tg), lrecs in sorted(group_by(lam, ("protocol", "eval_tag")).items()):
        md += _lambada_section(proto, tg, lrecs)
    path = out / "supplement.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return {"md": path, "figures": figures}


def _uniform_context(
    key: tuple, crecs: list[EvalRecord], fixed_all: list[EvalRecord]
) -> tuple[dict[tuple, dict[int, float]], dict[str, dict[int, list[float]]]]:
    """Uniform-depth PPL per (method, model_hash, seed) in the context, and the uniform wall
    clock per method and T from the latest adaptive record of each seed."""
    uni_ppl: dict[tuple, dict[int, float]] = {}
    for r in fixed_all:
        if (r.protocol, r.dataset, r.split, r.eval_tag) == key[:4]:
            uni_ppl.setdefault((r.method, r.model_hash, r.seed), {})[r.depth] = r.ppl
    latest: dict[tuple, tuple[EvalRecord, AdaptiveFields]] = {}
    for r in crecs:
        f, k = AdaptiveFields.of(r), (r.method, r.seed)
        newer = k not in latest or (r.updated_at or "") > (latest[k][0].updated_at or "")
        if f.uniform_wall_clock_s and newer:
            latest[k] = (r, f)
    uni_wall: dict[str, dict[int, list[float]]] = {}
    for (m, _seed), (_r, f) in sorted(latest.items(), key=lambda kv: kv[0]):
        for T, v in f.uniform_wall_clock_s.items():
            uni_wall.setdefault(m, {}).setdefault(T, []).append(v)
    return uni_ppl, uni_wall


def _adaptive_rows(
    crecs: list[EvalRecord], uni_ppl: dict[tuple, dict[int, float]], pts: _Points
) -> list[str]:
    """One table row per (method, adaptive mode), sorted by method, family and depth."""
    rows = []
    for (method, mode), cell in group_by(crecs, ("method", "adaptive_mode")).items():
        fields = [AdaptiveFields.of(r) for r in cell]
        depth = _mean_std([f.mean_depth for f in fields])
        rows.append((method, mode.split(":")[0], depth[0], mode, cell, fields))
    lines = []
    for method, fam, _d, mode, cell, fields in sorted(rows, key=lambda r: r[:4]):
        depth = _mean_std([f.mean_depth for f in fields])
        ppl = _mean_std([r.ppl for r in cell])
        rel = []
        for r, f in zip(cell, fields):
            u = uniform_ppl_at(uni_ppl.get((r.method, r.model_hash, r.seed), {}), f.mean_depth)
            rel.append(100.0 * (r.ppl / u - 1.0) if math.isfinite(u) else math.nan)
        relm = _mean_std(rel)
        fl, _ = _mean_std([f.flops_per_token_body for f in fields])
        wall = _mean_std([f.wall_clock_s for f in fields])
        dense = _mean_std([f.wall_clock_dense_s for f in fields])
        target = fields[0].target
        lines.append(
            f"| {method} | `{mode}` | {f'{target:g}' if target else '–'} | "
            f"{_fmt(*depth)} | {_fmt(*ppl)} | {_fmt(*relm)} | {fl:.3g} | {_fmt(*wall)} | "
            f"{_fmt(*dense)} | {len(cell)} |"
        )
        pts.rel.setdefault((method, fam), []).append((depth[0], depth[1], *relm))
        pts.wall.setdefault((method, fam), []).append((depth[0], wall[0]))
        if math.isfinite(dense[0]):
            pts.dense.setdefault((method, fam), []).append((depth[0], dense[0]))
    return lines


def _router_lines(crecs: list[EvalRecord]) -> list[str]:
    fits = []
    for r in crecs:
        f = AdaptiveFields.of(r)
        if r.adaptive_mode.startswith("router") and f.router is not None:
            fits.append(
                f"{r.method} s{r.seed}: positives {f.router.positive_rate:.3f}, train acc "
                f"{f.router.train_accuracy:.3f} (majority {f.router.majority_accuracy:.3f})"
            )
    return (
        ["Router fit (validation, per seed): " + "; ".join(sorted(set(fits))), ""] if fits else []
    )


def _adaptive_context(
    key: tuple, crecs: list[EvalRecord], fixed_all: list[EvalRecord], out: Path
) -> tuple[list[str], list[Path]]:
    """The section of one adaptive context (protocol, dataset, split, tag, ceiling)."""
    proto, ds, sp, tg, ceiling = key
    uni_ppl, uni_wall = _uniform_context(key, crecs, fixed_all)
    md = [
        f"## Adaptive depth — {ds} / {sp}, protocol `{proto}`"
        + (f", tag `{tg}`" if tg else "")
        + f", ceiling {ceiling}",
        "",
        "| Method | mode | target | achieved mean depth | PPL | Δ vs uniform % "
        "| body FLOPs/token | wall s | wall s, no skipping | seeds |",
        "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    pts = _Points({}, {}, {}, uni_wall)
    md += _adaptive_rows(crecs, uni_ppl, pts)
    md += ["", ADAPTIVE_NOTE, ""]
    if uni_wall:
        md += [
            "Uniform fixed-depth wall clock on the same tokens (s, mean over seeds): "
            + "; ".join(
                f"{m}: " + ", ".join(f"T={T} {sum(v) / len(v):.2f}" for T, v in sorted(d.items()))
                for m, d in sorted(uni_wall.items())
            ),
            "",
        ]
    md += _router_lines(crecs)
    title = f"{ds} / {sp}, ceiling {ceiling}"
    fig_md, figures = _figures_md(pts, out, slug((ds, sp, proto, tg)), title)
    return md + fig_md, figures


def _figures_md(pts: _Points, out: Path, name: str, title: str) -> tuple[list[str], list[Path]]:
    md, figures = [], []
    fig = _plot_relative(pts.rel, out / "figures" / f"adaptive_vs_uniform_{name}.png", title)
    if fig:
        figures.append(fig)
        md += [
            f"![adaptive quality relative to uniform depth](figures/{fig.name})",
            "",
            "*PPL of each adaptive rule relative to uniform depth at the same average depth "
            "(paired by seed; mean ± std over seeds, x error bars: std of the achieved "
            "depth). Below 0: the rule beats uniform depth at equal average compute.*",
            "",
        ]
    path = out / "figures" / f"adaptive_wallclock_{name}.png"
    fig = _plot_wallclock(pts.wall, pts.dense, pts.uniform_wall, path, title)
    if fig:
        figures.append(fig)
        md += [
            f"![wall clock vs achieved depth](figures/{fig.name})",
            "",
            "*Measured wall clock (s, whole capped split, mean over seeds) vs achieved mean "
            "depth; dashed: uniform fixed depth; filled markers: adaptive rules; hollow "
            "markers, dotted: the per-token rules without work skipping.*",
            "",
        ]
    return md, figures


def _lambada_section(proto: str, tg: str, lrecs: list[EvalRecord]) -> list[str]:
    md = [
        f"## LAMBADA — protocol `{proto}`" + (f", tag `{tg}`" if tg else ""),
        "",
        "| Method | T | completion PPL | target-token acc % | exact last-word acc % | seeds |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for (method, T), cell in sorted(group_by(lrecs, ("method", "depth")).items()):
        fields = [CompletionFields.of(r) for r in cell]
        p = _mean_std([r.ppl for r in cell])
        a = _mean_std([100 * f.n_correct / f.n_examples for f in fields])
        e = _mean_std([100 * f.exact_word_correct / f.n_passages for f in fields])
        md.append(f"| {method} | {T} | {_fmt(*p, 1)} | {_fmt(*a)} | {_fmt(*e)} | {len(cell)} |")
    return md + [
        "",
        "Completion PPL and target-token accuracy over the target word's tokens "
        "(teacher-forced); exact last-word = greedy decoding reproduces every target token.",
        "",
    ]


def _finite(points: dict[Any, list[tuple]], *idx: int) -> dict[Any, list[tuple]]:
    kept = {
        k: sorted(p for p in v if all(math.isfinite(p[i]) for i in idx)) for k, v in points.items()
    }
    return {k: v for k, v in kept.items() if v}


def _plot_relative(
    points: dict[tuple[str, str], list[tuple[float, float, float, float]]],
    path: Path,
    title: str,
) -> Path | None:
    """ΔPPL % vs uniform depth at equal average depth, per (method, rule)."""
    from looplm.results.plotting import log2_depth_axis

    pts = _finite(points, 0, 2)
    if not pts:
        return None
    fig, ax = new_figure((7.8, 4.2))
    color = {m: f"C{i % 10}" for i, m in enumerate(sorted({m for m, _ in pts}))}
    ax.axhline(0.0, color="0.3", lw=1.0, ls="--", label="uniform depth (reference)")
    for (m, fam), v in sorted(pts.items()):
        ax.errorbar(
            [p[0] for p in v],
            [p[2] for p in v],
            xerr=[p[1] if math.isfinite(p[1]) else 0.0 for p in v],
            yerr=[p[3] if math.isfinite(p[3]) else 0.0 for p in v],
            color=color[m],
            marker=RULE_MARKERS.get(fam, "x"),
            ms=6,
            lw=1.4,
            capsize=2,
            elinewidth=0.8,
            label=f"{m} {fam}",
        )
    lo = min(p[0] for v in pts.values() for p in v)
    hi = max(p[0] for v in pts.values() for p in v)
    nice = (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96)
    log2_depth_axis(ax, [t for t in nice if lo / 1.3 <= t <= hi * 1.3], lo / 1.3, hi * 1.3)
    ax.set_xlabel("achieved average active depth (loops per token, log2 axis)")
    ax.set_ylabel("PPL vs uniform depth at equal average depth (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    return save_png(fig, path, dpi=130)


def _plot_wallclock(
    points: dict[tuple[str, str], list[tuple[float, float]]],
    dense: dict[tuple[str, str], list[tuple[float, float]]],
    uniform: dict[str, dict[int, list[float]]],
    path: Path,
    title: str,
) -> Path | None:
    """Measured wall clock vs achieved mean depth, adaptive rules and uniform depth."""
    pts = _finite(points, 0, 1)
    if not pts:
        return None
    fig, ax = new_figure((7.6, 4.2))
    methods = sorted({m for m, _ in pts} | set(uniform))
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for m, d in sorted(uniform.items()):
        ts = sorted(d)
        means = [sum(d[t]) / len(d[t]) for t in ts]
        ax.plot(
            ts, means, color=color[m], ls="--", marker="o", ms=3, lw=1.1, label=f"{m} uniform depth"
        )
    for (m, fam), v in sorted(pts.items()):
        ax.plot(
            [p[0] for p in v], [p[1] for p in v], color=color[m],
            marker=RULE_MARKERS.get(fam, "x"), ms=6, lw=1.4, label=f"{m} {fam}",
        )  # fmt: skip
    for (m, fam), v in sorted(_finite(dense, 0, 1).items()):
        if m in color:
            ax.plot(
                [p[0] for p in v], [p[1] for p in v], color=color[m], ls=":", lw=1.0,
                marker=RULE_MARKERS.get(fam, "x"), ms=5, mfc="none",
                label=f"{m} {fam}, no skipping",
            )  # fmt: skip
    ax.set_xlabel("achieved mean active depth (loops per token)")
    ax.set_ylabel("measured wall clock (s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6)
    ax.set_ylim(bottom=0)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    return save_png(fig, path, dpi=130)
