"""Frontier figures and tables from stored frontier rows (reads records only).

A frontier row is an accuracy record whose split is ``difficulty=<d>`` (written by the sweep's
frontier evaluation): per (method, seed, difficulty, T) the number of correct answers. This module
turns them into

* a heat map per method: accuracy (mean over seeds) over thinking steps T × difficulty, with the
  training difficulty range marked;
* the "climb shape" per method and difficulty (:func:`climb_shape` on the seed-mean curve):
  abrupt from chance vs gradual;
* extrapolation accuracy (difficulties above the training range, at the deepest T) paired by seed
  between two methods (e.g. silent thinking vs per-step supervision), with a t interval.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.sections import ReportSection, difficulty_of, register_section
from looplm.results.store import EvalRecord


def frontier_records(records: Sequence[EvalRecord]) -> list[EvalRecord]:
    return [r for r in records if difficulty_of(r) is not None and not r.adaptive_mode]


def accuracy_grid(
    records: Sequence[EvalRecord], method: str
) -> tuple[list[int], list[int], np.ndarray, np.ndarray, int]:
    """(difficulties, depths, mean accuracy (D, T), std over seeds (D, T), number of seeds)."""
    recs = [r for r in frontier_records(records) if r.method == method]
    diffs = sorted({difficulty_of(r) for r in recs})
    depths = sorted({r.depth for r in recs})
    seeds = sorted({r.seed for r in recs})
    cube = np.full((len(seeds), len(diffs), len(depths)), np.nan)
    seen: dict[tuple[int, int, int], EvalRecord] = {}
    for r in recs:
        key = (r.seed, difficulty_of(r), r.depth)
        if key in seen:
            o = seen[key]
            raise LoopLMError(
                f"two frontier rows for method {method!r}, seed {key[0]}, difficulty {key[1]}, "
                f"T={key[2]} (protocol {r.protocol!r}): model {o.model_hash!r} / eval tag "
                f"{o.eval_tag!r} and model {r.model_hash!r} / eval tag {r.eval_tag!r}; report "
                "one protocol per grid (give the runs different protocols or methods)"
            )
        seen[key] = r
        acc = r.extra["n_correct"] / max(r.extra["n_examples"], 1)
        cube[seeds.index(r.seed), diffs.index(key[1]), depths.index(r.depth)] = acc
    if not seeds:  # no frontier rows for this method
        return [], [], np.empty((0, 0)), np.empty((0, 0)), 0
    with np.errstate(invalid="ignore"):
        mean = np.nanmean(cube, axis=0)
        std = np.nanstd(cube, axis=0, ddof=1) if len(seeds) > 1 else np.full(mean.shape, np.nan)
    return diffs, depths, mean, std, len(seeds)


def plot_heatmap(
    records: Sequence[EvalRecord],
    methods: Sequence[str],
    path: Path,
    *,
    title: str,
    train_difficulty: tuple[int, int] | None = None,
) -> Path | None:
    """One panel per method: accuracy over T (x) × difficulty (y), training range outlined."""
    from looplm.results.plotting import new_figure, save_png

    panels = [(m, *accuracy_grid(records, m)) for m in methods]
    panels = [p for p in panels if p[1] and p[2]]
    if not panels:
        return None
    fig, axes = new_figure((3.3 * len(panels) + 0.8, 3.4), ncols=len(panels))
    axes = np.atleast_1d(axes)
    im = None
    for ax, (m, diffs, depths, mean, _std, n) in zip(axes, panels):
        im = ax.imshow(mean, origin="lower", aspect="auto", vmin=0.5, vmax=1.0, cmap="viridis")
        ax.set_xticks(range(len(depths)), [str(t) for t in depths], fontsize=7)
        ax.set_yticks(range(len(diffs)), [str(d) for d in diffs], fontsize=7)
        ax.set_xlabel("thinking steps T")
        ax.set_title(f"{m} ({n} seed{'s' if n != 1 else ''})", fontsize=9)
        if train_difficulty:
            lo, hi = train_difficulty
            rows = [i for i, d in enumerate(diffs) if lo <= d <= hi]
            if rows:
                ax.axhspan(rows[0] - 0.5, rows[-1] + 0.5, fill=False, ec="w", lw=1.2, ls="--")
    axes[0].set_ylabel("difficulty")
    fig.colorbar(im, ax=list(axes), shrink=0.9, label="accuracy (chance 0.5)")
    fig.suptitle(title, fontsize=10)
    return save_png(fig, path, dpi=130)


def climb_table(
    records: Sequence[EvalRecord], methods: Sequence[str], chance: float = 0.5
) -> list[dict[str, Any]]:
    """Climb shape per (method, difficulty) on the seed-mean accuracy curve; fixed-depth methods
    (:func:`fixed_depth_methods`) have no climb and are left out."""
    out = []
    fixed = fixed_depth_methods(records)
    for m in methods:
        if m in fixed:
            continue
        diffs, depths, mean, _std, n = accuracy_grid(records, m)
        for i, d in enumerate(diffs):
            ok = np.isfinite(mean[i])
            if ok.sum() < 2:
                continue
            shape = climb_shape(np.asarray(depths)[ok], mean[i][ok], chance)
            out.append({"method": m, "difficulty": d, "n_seeds": n, **shape})
    return out


def extrapolation_by_seed(
    records: Sequence[EvalRecord], method: str, above: int, depth: int | None = None
) -> dict[int, float]:
    """Per seed: accuracy over every difficulty > ``above`` at ``depth`` (default: the deepest
    evaluated T), pooled by answers."""
    recs = [r for r in frontier_records(records) if r.method == method]
    if not recs:
        return {}
    T = depth or max(r.depth for r in recs)
    out: dict[int, list[int]] = {}
    for r in recs:
        if r.depth == T and difficulty_of(r) > above:
            c = out.setdefault(r.seed, [0, 0])
            c[0] += r.extra["n_correct"]
            c[1] += r.extra["n_examples"]
    return {s: c / max(n, 1) for s, (c, n) in sorted(out.items())}


def paired_accuracy_delta(a: dict[int, float], b: dict[int, float]) -> dict[str, Any]:
    """Mean of (a − b) over shared seeds with a 95% t half-width (NaN for one seed)."""
    from scipy.stats import t as student_t

    seeds = sorted(set(a) & set(b))
    diff = np.array([a[s] - b[s] for s in seeds], dtype=float)
    n = diff.size
    half = (
        float(student_t.ppf(0.975, n - 1) * diff.std(ddof=1) / math.sqrt(n)) if n > 1 else math.nan
    )
    return {
        "seeds": seeds,
        "mean_a": float(np.mean([a[s] for s in seeds])) if n else math.nan,
        "mean_b": float(np.mean([b[s] for s in seeds])) if n else math.nan,
        "delta": float(diff.mean()) if n else math.nan,
        "half_width": half,
        "per_seed": diff.tolist(),
    }


def plot_propagation(summary_points: dict[str, np.ndarray], path: Path, *, title: str) -> Path:
    """First-correct loop step vs true hop distance (reachable queries), with the one-hop-per-step
    line t = d."""
    from looplm.results.plotting import new_figure, save_png

    d, f = summary_points["distance"], summary_points["first_correct"]
    keep = (d > 0) & (f >= 0)
    d, f = d[keep], f[keep]
    fig, ax = new_figure((4.6, 3.6))
    ks = np.unique(d)
    if ks.size:
        ax.boxplot([f[d == k] for k in ks], positions=ks, widths=0.5, showfliers=False)
        rng = np.random.default_rng(0)
        ax.scatter(d + rng.uniform(-0.18, 0.18, d.size), f, s=4, alpha=0.25, color="C0")
        m = summary_points.get("min_step")
        if m is not None:
            m = np.asarray(m)[keep]
            ax.plot(ks, [m[d == k].mean() for k in ks], color="C3", lw=1.0, ls="--",
                    marker="_", label="earliest possible step (hops per step)")  # fmt: skip
        else:
            lim = [0, max(ks.max(), f.max() if f.size else 1) + 1]
            ax.plot(lim, lim, color="C3", lw=1.0, ls="--", label="t = d (one hop per step)")
        ax.set_xticks(ks, [str(int(k)) for k in ks])
        ax.legend(fontsize=7, frameon=False)
    ax.set_xlabel("true shortest-path distance d from the source")
    ax.set_ylabel("first loop step with the correct answer")
    ax.set_title(title, fontsize=9)
    ax.grid(True, color="0.9", lw=0.6)
    return save_png(fig, path, dpi=130)


def climb_shape(depths: Sequence[float], accuracy: Sequence[float], chance: float = 0.5) -> dict:
    """Shape of accuracy-vs-T at one difficulty, up to its peak (a later decline — overthinking
    beyond the trained depths — is reported as ``drop_after_peak``, not as part of the climb):
    ``rise`` = peak − first accuracy; ``max_step_share`` = the largest gain between consecutive
    evaluated depths before the peak over that rise; ``abrupt`` when one step carries ≥ 50% of the
    rise (else gradual), and separately ``from_chance`` when the curve starts within 5 points of
    chance — "abrupt from chance" needs both."""
    T = np.asarray(depths, dtype=float)
    a = np.asarray(accuracy, dtype=float)
    order = np.argsort(T)
    T, a = T[order], a[order]
    peak = int(np.argmax(a))
    rise = float(a[peak] - a[0])
    steps = np.diff(a[: peak + 1])
    share = float(steps.max() / rise) if rise > 1e-9 and steps.size else math.nan
    at = float(T[1:][steps.argmax()]) if steps.size else math.nan
    return {
        "start": float(a[0]),
        "peak": float(a[peak]),
        "peak_at": float(T[peak]),
        "final": float(a[-1]),
        "rise": rise,
        "drop_after_peak": float(a[peak] - a[-1]),
        "max_step_share": share,
        "max_step_at": at,
        "abrupt": bool(math.isfinite(share) and share >= 0.5),
        "from_chance": bool(abs(float(a[0]) - chance) <= 0.05),
    }


@register_section
class FrontierSection(ReportSection):
    """Frontier heat maps, best accuracy per difficulty, climb shape and extrapolation per
    (protocol, task), and the propagation-depth table of node tasks."""

    name = "frontier"
    kinds = ("frontier", "propagation")
    order = 40

    def write(self, recs: list[EvalRecord]) -> None:
        from looplm.results.tables import md_escape, method_order

        prop = [r for r in recs if "propagation" in r.extra]
        acc = frontier_records(recs)
        self.report.json.setdefault("frontier", [])
        for (proto, task), grp in sorted(_groups(acc, ("protocol", "dataset")).items()):
            methods = method_order(sorted({r.method for r in grp}), self.report.reference)
            train = _train_range(grp)
            entry: dict[str, Any] = {"protocol": proto, "task": task, "train_difficulty": train}
            self.report.md += [
                f"## Computational frontier — `{md_escape(task)}`, protocol `{proto}`",
                "",
            ]
            if self.report.make_figures:
                name = self.report.unique_slug("frontier", [proto, task])
                path = Path(self.report.out_dir) / "figures" / f"{name}.png"
                if plot_heatmap(grp, methods, path, title=f"{task}: accuracy over T × difficulty",
                                train_difficulty=train):  # fmt: skip
                    self.report.figures.append(path)
                    entry["figure"] = f"figures/{name}.png"
                    self.report.md += [f"![frontier {task}](figures/{name}.png)", ""]
            self._frontier_best_table(grp, methods, entry)
            self._frontier_climb(grp, methods, entry)
            if train:
                self._frontier_extrapolation(grp, methods, train[1], entry)
            self.report.json["frontier"].append(entry)
        if prop:
            self._propagation_section(prop)

    def _frontier_best_table(self, grp, methods, entry) -> None:
        from looplm.results.tables import md_escape

        diffs = sorted({difficulty_of(r) for r in grp})
        self.report.md += [
            "Best accuracy over T (mean over seeds) and the T that reaches it, per difficulty:",
            "",
            "| Method | " + " | ".join(f"d={d}" for d in diffs) + " |",
            "|---|" + "---:|" * len(diffs),
        ]
        entry["grid"] = {}
        for m in methods:
            ds, depths, mean, std, n = accuracy_grid(grp, m)
            cells = []
            for d in diffs:
                if d not in ds or not np.isfinite(mean[ds.index(d)]).any():
                    cells.append("–")
                    continue
                row = mean[ds.index(d)]
                j = int(np.nanargmax(row))
                cells.append(f"{100 * row[j]:.1f} (T={depths[j]})")
            self.report.md.append(f"| {md_escape(m)} | " + " | ".join(cells) + " |")
            entry["grid"][m] = {
                "difficulties": ds, "depths": depths, "mean": mean.tolist(),
                "std": std.tolist(), "n_seeds": n,
            }  # fmt: skip
        self.report.md.append("")

    def _frontier_climb(self, grp, methods, entry) -> None:
        from looplm.results.tables import md_escape

        rows = climb_table(grp, methods)
        entry["climb"] = rows
        diffs = sorted({r["difficulty"] for r in rows})
        cell = {(r["method"], r["difficulty"]): r for r in rows}
        self.report.md += [
            "Climb of accuracy with T up to its peak (seed means; fixed-depth models left out): "
            "*abrupt* when one step between evaluated depths carries ≥ 50% of the rise, else "
            "*gradual*; the number is that largest step's share of the rise; *from chance* when "
            "the curve starts within 5 points of chance, else *from s%* (its accuracy at the "
            "smallest T); ↓k: the deepest T is k points below the peak.",
            "",
            "| Method | " + " | ".join(f"d={d}" for d in diffs) + " |",
            "|---|" + "---|" * len(diffs),
        ]
        for m in [m for m in methods if any(r["method"] == m for r in rows)]:
            out = []
            for d in diffs:
                r = cell.get((m, d))
                if r is None or not math.isfinite(r["max_step_share"]):
                    out.append("–")
                    continue
                kind = "abrupt" if r["abrupt"] else "gradual"
                start = "from chance" if r["from_chance"] else f"from {100 * r['start']:.0f}%"
                drop = round(100 * r["drop_after_peak"])
                out.append(
                    f"{kind} {100 * r['max_step_share']:.0f}% {start}"
                    + (f" ↓{drop}" if drop >= 1 else "")
                )
            self.report.md.append(f"| {md_escape(m)} | " + " | ".join(out) + " |")
        self.report.md.append("")

    def _frontier_extrapolation(self, grp, methods, train_max: int, entry) -> None:
        from looplm.results.tables import md_escape

        ref = self.report.reference if self.report.reference in methods else methods[0]
        base = extrapolation_by_seed(grp, ref, train_max)
        self.report.md += [
            f"Extrapolation: accuracy pooled over difficulties > {train_max} (beyond training) at "
            f"the deepest evaluated T, per seed; paired Δ = method − `{ref}` (95% t half-width):",
            "",
            "| Method | accuracy % (mean ± std) | Δ vs reference (pp) | seeds |",
            "|---|---:|---:|---:|",
        ]
        entry["extrapolation"] = {}
        for m in methods:
            mine = extrapolation_by_seed(grp, m, train_max)
            if not mine:
                continue
            d = paired_accuracy_delta(mine, base)
            vals = list(mine.values())
            sd = np.std(vals, ddof=1) if len(vals) > 1 else math.nan
            hw = f" ± {100 * d['half_width']:.1f}" if math.isfinite(d["half_width"]) else ""
            delta = "–" if m == ref else f"{100 * d['delta']:+.1f}{hw}"
            spread = f" ± {100 * sd:.1f}" if math.isfinite(sd) else ""
            self.report.md.append(
                f"| {md_escape(m)} | {100 * np.mean(vals):.1f}{spread} | {delta} | {len(vals)} |"
            )
            entry["extrapolation"][m] = {"per_seed": mine, "paired_vs_reference": d}
        self.report.md.append("")

    def _propagation_section(self, prop: list[EvalRecord]) -> None:
        from looplm.results.tables import md_escape

        self.report.md += [
            "## Propagation depth on the adjacency-masked graph task",
            "",
            "First loop step from which each reachable query stays correct, against its true "
            "hop distance from the source. Adjacency attention moves information one hop per "
            "layer, so the earliest possible step is ⌈(d − prelude − coda)/k⌉ for a k-layer core "
            "(d for a single-block model); 'earlier than possible' counts answers right before "
            "that (guesses from local structure).",
            "",
            "| Method | seed | queries | Pearson r | Spearman ρ | first step = distance | "
            "earlier than possible |",
            "|---|---:|---:|---:|---:|---:|---:|",
        ]
        self.report.json["propagation"] = []
        pooled: dict[str, dict[str, list]] = {}
        for r in sorted(prop, key=lambda r: (r.method, r.seed)):
            s = r.extra["propagation"]
            self.report.md.append(
                f"| {md_escape(r.method)} | {r.seed} | {s['n_reachable_correct']} | "
                f"{s.get('pearson_r', math.nan):.3f} | {s.get('spearman_rho', math.nan):.3f} | "
                f"{100 * s['exact']:.1f}% | {100 * s['early']:.1f}% |"
            )
            self.report.json["propagation"].append({"method": r.method, "seed": r.seed, **s})
            p = pooled.setdefault(r.method, {"distance": [], "first_correct": [], "min_step": []})
            p["distance"] += r.extra["distance"]
            p["first_correct"] += r.extra["first_correct"]
            p["min_step"] += r.extra.get("min_step", r.extra["distance"])
        self.report.md.append("")
        if self.report.make_figures:
            for m, p in pooled.items():
                name = self.report.unique_slug("propagation", [m])
                path = Path(self.report.out_dir) / "figures" / f"{name}.png"
                pts = {k: np.asarray(v) for k, v in p.items()}
                plot_propagation(pts, path, title=f"{m}: first correct step vs hop distance")
                self.report.figures.append(path)
                self.report.md += [f"![propagation {m}](figures/{name}.png)", ""]


def _groups(recs: Sequence[EvalRecord], fields: tuple[str, ...]) -> dict[tuple, list]:
    out: dict[tuple, list] = {}
    for r in recs:
        out.setdefault(tuple(getattr(r, f) for f in fields), []).append(r)
    return out


def _train_range(recs: Sequence[EvalRecord]) -> tuple[int, int] | None:
    """The training difficulty range shared by ``recs`` (None when no row records one)."""
    ranges = {(int(t[0]), int(t[1])) for r in recs if (t := r.extra.get("train_difficulty"))}
    if len(ranges) > 1:
        raise LoopLMError(
            f"frontier rows of one protocol and task were trained on different difficulty "
            f"ranges {sorted(ranges)}; extrapolation needs one (give each range its own protocol)"
        )
    return ranges.pop() if ranges else None


def fixed_depth_methods(records: Sequence[EvalRecord]) -> set[str]:
    """Methods whose frontier rows come from a fixed-depth (unshared) model: T beyond its layers
    changes nothing, so their curve over T is no climb."""
    return {r.method for r in frontier_records(records) if r.extra.get("fixed_depth")}
