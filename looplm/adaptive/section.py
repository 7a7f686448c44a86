"""The report's adaptive-depth sections: per context and ceiling, a table of static T = 8 |
adaptive rules (with the achieved mean depth) | static T = ceiling, its results.json entry and the
quality-vs-average-depth figure (a :class:`~looplm.results.sections.ReportSection`)."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any

import numpy as np

from looplm.results.figures import Series, plot_adaptive
from looplm.results.sections import ReportSection, register_section
from looplm.results.stats import Summary, summarize
from looplm.results.store import EvalRecord, group_by
from looplm.results.tables import (
    ROW_CONTEXT,
    adaptive_family,
    best_in_column,
    contenders,
    context_title,
    fmt_mean_std,
    fmt_num,
    md_escape,
    row_keys,
    row_labels,
    table_decimals,
)

Row = tuple[str, str]  # (method, model_hash)
Col = tuple[str, str]  # (adaptive_mode, calibration)
ADAPTIVE_CONTEXT_FIELDS = ROW_CONTEXT


@dataclass
class _Table:
    """The summaries of one adaptive table (context × ceiling)."""

    ctx: dict[str, str]
    title: str
    ceiling: int
    rows: list[Row]
    labels: dict[Row, str]
    cols: list[Col]
    ppl: dict[tuple[Row, Col], Summary]
    depth: dict[tuple[Row, Col], Summary]
    static_depths: list[int]
    static: dict[tuple[Row, int], Summary]
    static_ctx: list[EvalRecord]

    @property
    def keys(self) -> list[tuple[str, Any]]:
        """Columns in order: static T=8, the adaptive settings, static T=ceiling."""
        keys: list[tuple[str, Any]] = [("static", self.static_depths[0])]
        keys += [("adaptive", c) for c in self.cols]
        if len(self.static_depths) > 1:
            keys.append(("static", self.static_depths[-1]))
        return keys


@register_section
class AdaptiveSection(ReportSection):
    """Adaptive-depth tables: one per context (protocol × dataset × split × eval tag) and
    ceiling, with the static fixed-depth columns taken from the ``fixed_depth`` section."""

    name = "adaptive"
    kinds = ("adaptive",)
    order = 20
    json_keys = ("adaptive",)

    def write(self, records: list[EvalRecord]) -> None:
        fixed = self.report.section_records("fixed_depth")
        groups = group_by(records, ADAPTIVE_CONTEXT_FIELDS)
        for key in sorted(groups):
            self._adaptive_section(dict(zip(ADAPTIVE_CONTEXT_FIELDS, key)), groups[key], fixed)

    def _adaptive_section(
        self, ctx: dict[str, str], recs: list[EvalRecord], fixed: list[EvalRecord]
    ) -> None:
        title = context_title(ctx)
        static_ctx = [
            r
            for r in fixed
            if all(getattr(r, f) == v for f, v in ctx.items()) and r.calibration == ""
        ]
        for (ceiling,), crecs in sorted(group_by(recs, ("depth",)).items()):
            tab = self._adaptive_summaries(ctx, title, ceiling, crecs, static_ctx)
            self._adaptive_markdown(tab)
            entry = self._adaptive_json(tab)
            if self.report.make_figures:
                self._adaptive_figure(tab, entry)
            self.report.json["adaptive"].append(entry)

    def _adaptive_summaries(
        self,
        ctx: dict[str, str],
        title: str,
        ceiling: int,
        crecs: list[EvalRecord],
        static_ctx: list[EvalRecord],
    ) -> _Table:
        rows = row_keys(crecs, self.report.reference)
        labels = row_labels(rows)
        ppl: dict[tuple[Row, Col], Summary] = {}
        depth: dict[tuple[Row, Col], Summary] = {}
        cells = group_by(crecs, ("method", "model_hash", "adaptive_mode", "calibration"))
        for (m, h, mode, cal), cell in cells.items():
            label = f"{title}: {labels[(m, h)]} {mode}" + (f" ({cal})" if cal else "")
            ppl[((m, h), (mode, cal))] = self.report.summary(cell, "ppl", label)
            depth[((m, h), (mode, cal))] = self.report.summary(cell, "mean_depth", label)

        def col_depth(c: Col) -> float:
            vals = [depth[(k, c)].mean for k in rows if (k, c) in depth]
            return float(np.nanmean(vals)) if vals else math.inf

        cols_raw = sorted({(r.adaptive_mode, r.calibration) for r in crecs})
        cols = sorted(cols_raw, key=lambda c: (adaptive_family(c[0]), col_depth(c), c))
        static_depths = sorted({self.report.train_depth_max, ceiling})
        static: dict[tuple[Row, int], Summary] = {}
        srecs = group_by(
            [r for r in static_ctx if (r.method, r.model_hash) in set(rows)],
            ("method", "model_hash", "depth"),
        )
        for (m, h, d), cell in srecs.items():
            label = f"{title}: {labels[(m, h)]} T={d} (static)"
            static[((m, h), d)] = self.report.summary(cell, "ppl", label)
        return _Table(
            ctx, title, ceiling, rows, labels, cols, ppl, depth, static_depths, static, static_ctx
        )

    def _adaptive_markdown(self, tab: _Table) -> None:
        heads = (
            [f"Static T={tab.static_depths[0]}"]
            + [c[0] + (f" ({c[1]})" if c[1] else "") for c in tab.cols]
            + ([f"Static T={tab.static_depths[-1]}"] if len(tab.static_depths) > 1 else [])
        )
        text: dict[tuple, str] = {}
        dec = table_decimals([x.mean for x in list(tab.ppl.values()) + list(tab.static.values())])
        for kind, c in tab.keys:
            source = tab.static if kind == "static" else tab.ppl
            col = {k: source[(k, c)] for k in tab.rows if (k, c) in source}
            best = best_in_column(col, contenders(tab.rows), dec)
            for k, s in col.items():
                t = fmt_mean_std(s.mean, s.std, dec)
                t = f"**{t}**" if k in best else t
                if kind == "adaptive":
                    t += f" (d̄ {fmt_num(tab.depth[(k, c)].mean, 1)})"
                text[(k, (kind, c))] = t + ("" if s.complete else " ⚠")
        self.report.md += [
            f"## Adaptive depth — {tab.title}, ceiling T={tab.ceiling}",
            "",
            "| Method | " + " | ".join(md_escape(h) for h in heads) + " |",
            "|---|" + "---:|" * len(heads),
        ]
        for k in tab.rows:
            self.report.md.append(
                f"| {md_escape(tab.labels[k])} | "
                + " | ".join(text.get((k, key), "–") for key in tab.keys)
                + " |"
            )
        self.report.md += [
            "",
            "Cells: test PPL mean ± std over seeds; d̄: achieved mean active "
            "depth (mean over seeds). **Bold**: lowest PPL per column.",
            "",
        ]

    def _adaptive_json(self, tab: _Table) -> dict[str, Any]:
        return {
            "context": tab.ctx,
            "ceiling": tab.ceiling,
            "rows": [
                {
                    "method": k[0],
                    "model_hash": k[1],
                    "label": tab.labels[k],
                    "adaptive": [
                        {
                            "adaptive_mode": c[0],
                            "calibration": c[1],
                            "ppl": tab.ppl[(k, c)].to_dict(),
                            "mean_depth": tab.depth[(k, c)].to_dict(),
                        }
                        for c in tab.cols
                        if (k, c) in tab.ppl
                    ],
                    "static": {
                        str(d): tab.static[(k, d)].to_dict()
                        for d in tab.static_depths
                        if (k, d) in tab.static
                    },
                }
                for k in tab.rows
            ],
        }

    def _adaptive_series(self, tab: _Table) -> tuple[list[Series], list[tuple[str, str, Series]]]:
        """Uniform-depth curves (every evaluated T) and one adaptive series per rule family."""
        uniform, adapt = [], []
        for k in tab.rows:
            allfix = group_by(
                [r for r in tab.static_ctx if (r.method, r.model_hash) == k], ("depth",)
            )
            ds = sorted(d for (d,) in allfix)
            if ds:
                sums = [self._quiet_summary(allfix[(d,)]) for d in ds]
                means, stds = [s.mean for s in sums], [s.std for s in sums]
                uniform.append(Series(tab.labels[k], ds, means, stds, self.report.colors[k[0]]))
            for fam in sorted({adaptive_family(c[0]) for c in tab.cols}):
                fc = [c for c in tab.cols if adaptive_family(c[0]) == fam and (k, c) in tab.ppl]
                if fc:
                    series = Series(
                        tab.labels[k],
                        [tab.depth[(k, c)].mean for c in fc],
                        [tab.ppl[(k, c)].mean for c in fc],
                        [tab.ppl[(k, c)].std for c in fc],
                        self.report.colors[k[0]],
                        [tab.depth[(k, c)].std for c in fc],
                    )
                    adapt.append((tab.labels[k], fam, series))
        return uniform, adapt

    def _adaptive_figure(self, tab: _Table, entry: dict[str, Any]) -> None:
        uniform, adapt = self._adaptive_series(tab)
        if not adapt:
            return
        slug = self.report.unique_slug("adaptive", list(tab.ctx.values()) + [f"T{tab.ceiling}"])
        path = self.report.out_dir / "figures" / f"{slug}.png"
        shift = plot_adaptive(
            uniform,
            adapt,
            path,
            train_depth_max=self.report.train_depth_max,
            shift=self.report.ppl_shift,
            title=f"{context_title(tab.ctx, False)}, ceiling {tab.ceiling}",
        )
        self.report.figures.append(path)
        entry["figure"] = {"path": f"figures/{slug}.png", "ppl_shift": shift}
        ref = (
            "with the uniform-depth curve (dashed)"
            if uniform
            else "without a uniform-depth curve (no fixed-depth rows of these models in this "
            "context: the `fixed` evaluation draws it)"
        )
        self.report.md += [
            f"![adaptive depth, {tab.title}](figures/{slug}.png)",
            "",
            f"*PPL vs achieved average depth per adaptive rule (solid), {ref}; faint bars: ±1 "
            "std over seeds.*",
            "",
        ]

    def _quiet_summary(self, recs: list[EvalRecord]) -> Summary:
        """Summary for reference curves in figures: never raises, never reports."""
        return summarize(recs, "ppl", required_seeds=self.report.seed_spec, on_incomplete="mark")
