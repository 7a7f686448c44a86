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

Sections (:mod:`looplm.results.sections`): every record goes to the section of the evaluation
kind that wrote it (fixed-depth, transfer, LAMBADA and diagnostics rows: the depth tables here;
adaptive rows: :mod:`looplm.adaptive.section`; frontier and propagation rows:
:mod:`looplm.frontier.section`; scaling rows: :mod:`looplm.scaling.section`; a plugin kind: its
own section).
Grouping rules (:mod:`looplm.results.tables`): rows are (method, model_hash); when a method has
several model hashes in one table the row label carries the short hash. Methods named
``unshared*`` are absolute references and are not bolded (as in the paper), unless they are the
only rows. The figures are drawn by :mod:`looplm.results.figures`.
"""

from __future__ import annotations

import json
import math
import os
import sys
from collections.abc import Iterable, Sequence
from dataclasses import asdict, dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.io import atomic_write_text
from looplm.results.export import load_records
from looplm.results.figures import (
    Series,
    plot_accuracy_response,
    plot_depth_response,
)
from looplm.results.sections import (
    ReportContext,
    ReportSection,
    register_section,
    report_sections,
    section_of,
)
from looplm.results.settings import ReportSettings
from looplm.results.stats import PairedDelta, Summary, paired_deltas
from looplm.results.store import EvalRecord, group_by
from looplm.results.tables import (
    REFERENCE_PREFIX,
    ROW_CONTEXT,
    context_title,
    finite_or_none,
    fmt_num,
    has_accuracy,
    md_escape,
    mean_std_table,
    row_keys,
    row_labels,
)
from looplm.settings import build_settings

CONTEXT_FIELDS = (*ROW_CONTEXT, "calibration")


# --------------------------------------------------------------------------- the report
@dataclass
class ReportResult:
    """Paths written by :func:`write_report`."""

    out_dir: Path
    report_md: Path
    results_json: Path
    figures: list[Path] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)


@register_section
class DepthSection(ReportSection):
    """Methods × depths tables per evaluation context (protocol × dataset × split × eval tag ×
    calibration): PPL and task accuracy (mean ± std over seeds), the depth-response figure and
    the paired deltas against the reference."""

    name = "fixed_depth"
    kinds = ("fixed", "transfer", "lambada", "diagnostics")
    order = 10
    json_keys = ("fixed_depth",)

    def write(self, records: list[EvalRecord]) -> None:
        groups = group_by(records, CONTEXT_FIELDS)
        for key in sorted(groups):
            self._fixed_section(dict(zip(CONTEXT_FIELDS, key)), groups[key])

    def _depth_header(self, depths: Sequence[int]) -> list[str]:
        return [f"T={d}" + ("†" if d > self.report.train_depth_max else "") for d in depths]

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
        """Markdown methods × depths table (:func:`~looplm.results.tables.mean_std_table`)."""
        header = self._depth_header(depths)
        return mean_std_table(
            rows, labels, depths, header, cells, scale=scale, lower_is_better=lower_is_better
        )

    # long: one section's tables (PPL, deltas, accuracy) share the rows and cells built at its top
    def _fixed_section(self, ctx: dict[str, str], recs: list[EvalRecord]) -> None:
        title = context_title(ctx)
        rows = row_keys(recs, self.report.reference)
        labels = row_labels(rows)
        by_cell = group_by(recs, ("method", "model_hash", "depth"))
        depths = sorted({r.depth for r in recs})
        ppl: dict[tuple[tuple[str, str], int], Summary] = {}
        acc: dict[tuple[tuple[str, str], int], Summary] = {}
        for (m, h, d), cell in by_cell.items():
            label = f"{title}: {labels[(m, h)]} T={d}"
            ppl[((m, h), d)] = self.report.summary(cell, "ppl", label)
            acc_recs = [r for r in cell if has_accuracy(r)]
            if acc_recs:
                acc[((m, h), d)] = self.report.summary(acc_recs, "accuracy", label)
        self.report.md += [f"## {title}", "", "### PPL (mean ± std over seeds)", ""]
        lines, dec = self._table(rows, labels, depths, ppl)
        self.report.md += lines
        bold_note = "**Bold**: lowest mean per column"
        if len(rows) < 2:  # nothing is bolded in a table of one row: say so, promise nothing
            bold_note = "One method: nothing to compare (no bold)"
        elif any(k[0].startswith(REFERENCE_PREFIX) for k in rows):
            bold_note += " among shared-block rows (unshared* rows are absolute references)"
        bold_note += "."
        if not all(s.complete for s in ppl.values()):
            bold_note += " ⚠: incomplete seed set (listed at the end)."
        self.report.md += ["", bold_note, ""]
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
        if self.report.make_figures and len(depths) >= 2:
            self._depth_figure(ctx, rows, labels, depths, ppl, entry)
        # paired deltas vs the reference
        entry["deltas"] = self._delta_block(recs, rows, labels, "ppl", "PPL", dec + 1)
        if acc:
            self.report.md += ["### Task accuracy (%, mean ± std over seeds)", ""]
            lines, adec = self._table(rows, labels, depths, acc, scale=100.0, lower_is_better=False)
            self.report.md += lines
            note = (
                "**Bold**: highest mean per column." if len(rows) > 1 else "(No bold: one method.)"
            )
            self.report.md += ["", note, ""]
            if self.report.make_figures and len(depths) >= 2:
                self._accuracy_figure(ctx, rows, labels, depths, acc, entry)
            acc_recs = [r for r in recs if has_accuracy(r)]
            entry["accuracy_deltas"] = self._delta_block(
                acc_recs,
                row_keys(acc_recs, self.report.reference),
                labels,
                "accuracy",
                "accuracy, percentage points",
                adec + 1,
                scale=100.0,
            )
        self.report.json["fixed_depth"].append(entry)

    def _depth_figure(
        self,
        ctx: dict[str, str],
        rows: list[tuple[str, str]],
        labels: dict[tuple[str, str], str],
        depths: list[int],
        ppl: dict[tuple[tuple[str, str], int], Summary],
        entry: dict[str, Any],
    ) -> None:
        """Figure (a): the depth response of one fixed-depth context."""
        title = context_title(ctx)
        series = []
        for k in rows:
            ds = [d for d in depths if (k, d) in ppl and math.isfinite(ppl[(k, d)].mean)]
            if ds:
                means, stds = [ppl[(k, d)].mean for d in ds], [ppl[(k, d)].std for d in ds]
                series.append(Series(labels[k], ds, means, stds, self.report.colors[k[0]]))
        if not series:
            return
        slug = self.report.unique_slug("depth_response", ctx.values())
        path = self.report.out_dir / "figures" / f"{slug}.png"
        shift = plot_depth_response(
            series,
            path,
            train_depth_max=self.report.train_depth_max,
            shift=self.report.ppl_shift,
            title=context_title(ctx, code=False),
        )
        self.report.figures.append(path)
        entry["depth_response_figure"] = {"path": f"figures/{slug}.png", "ppl_shift": shift}
        self.report.md += [
            f"![PPL vs loop depth, {title}](figures/{slug}.png)",
            "",
            f"*Depth response: PPL axis log(PPL − {shift:g}), ticks in PPL; "
            f"stars mark per-method minima; shaded: T > {self.report.train_depth_max}.*",
            "",
        ]

    def _accuracy_figure(
        self,
        ctx: dict[str, str],
        rows: list[tuple[str, str]],
        labels: dict[tuple[str, str], str],
        depths: list[int],
        acc: dict[tuple[tuple[str, str], int], Summary],
        entry: dict[str, Any],
    ) -> None:
        """A synthetic task's depth response in accuracy (its PPL figure alone hides it)."""
        series = []
        for k in rows:
            ds = [d for d in depths if (k, d) in acc and math.isfinite(acc[(k, d)].mean)]
            if ds:
                means = [100.0 * acc[(k, d)].mean for d in ds]
                stds = [100.0 * acc[(k, d)].std for d in ds]
                series.append(Series(labels[k], ds, means, stds, self.report.colors[k[0]]))
        if not series:
            return
        slug = self.report.unique_slug("accuracy_response", ctx.values())
        path = self.report.out_dir / "figures" / f"{slug}.png"
        plot_accuracy_response(
            series, path, train_depth_max=self.report.train_depth_max,
            title=context_title(ctx, code=False),
        )  # fmt: skip
        self.report.figures.append(path)
        entry["accuracy_figure"] = {"path": f"figures/{slug}.png"}
        self.report.md += [
            f"![accuracy vs loop depth, {context_title(ctx)}](figures/{slug}.png)",
            "",
            f"*Depth response in task accuracy (mean ± std over seeds); shaded: "
            f"T > {self.report.train_depth_max}.*",
            "",
        ]

    # long: one table block's rows, columns and paired statistics
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
        # long: the paired-delta table and its three refusals, kept whole to read in order
        ref_rows = [k for k in rows if k[0] == self.report.reference]
        others = [k for k in rows if k[0] != self.report.reference]
        if not others:
            return []
        if not ref_rows:
            self.report.md += [
                f"*No paired deltas: reference method `{self.report.reference}` is not in this table.*",
                "",
            ]
            return []
        if len(ref_rows) > 1:
            self.report.md += [
                f"*No paired deltas: reference `{self.report.reference}` has several model "
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
                seeds=self.report.pair_seeds,
                confidence=self.report.confidence,
                n_boot=self.report.n_boot,
                boot_seed=self.report.boot_seed,
            ):
                out.append({"method": k[0], "model_hash": k[1], "label": labels[k], **pd.to_dict()})
                lines.append(self._delta_line(labels[k], pd, scale, dec))
        if lines:
            lower = "lower" if metric != "accuracy" else "lower (worse)"
            self.report.md += [
                f"### Paired deltas vs `{self.report.reference}` ({unit}; Δ = {self.report.reference} − method)",
                "",
                "| Method | T | n | Δ mean ± t-hw | bootstrap interval | seeds |",
                "|---|---:|---:|---:|---:|---|",
            ]
            self.report.md += lines
            self.report.md += [
                "",
                f"Negative Δ: `{self.report.reference}` is {lower}. ± is the "
                f"{self.report.confidence:.0%} t half-width (n − 1 degrees of freedom); the "
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
        tmark = "†" if pd.depth > self.report.train_depth_max else ""
        return (
            f"| {md_escape(label)} | {pd.depth}{tmark} | {pd.n} | {mean} ± {hw} | {boot} | "
            f"{','.join(map(str, pd.seeds))} |"
        )


def _build(r: ReportContext) -> None:
    """Fill ``r.md`` / ``r.json``: the header, then the section of every registered evaluation
    kind in order, each from the records of its kinds, then the incomplete summaries."""
    sections = report_sections()
    for rec in r.records:
        r.by_section.setdefault(section_of(rec, sections).name, []).append(rec)
    r.md += [
        "# looplm results report",
        "",
        f"Source: `{r.source}` ({len(r.records)} evaluations). "
        f"Generated {datetime.now(timezone.utc).strftime('%Y-%m-%d %H:%M UTC')}.",
        "",
        "Aggregation (paper, *Seed Protocol and Aggregation*): per seed, PPL = "
        "exp(Σ NLL / Σ tokens) over all batches; cells show the mean ± sample std (ddof = 1) "
        f"over seeds; seed set: {r.seed_text()}. Paired deltas Δ = "
        f"`{r.reference}` − method are matched by seed and loop depth; ± is the "
        f"{r.confidence:.0%} small-sample t half-width and [lo, hi] the deterministic "
        f"paired-bootstrap percentile interval ({r.n_boot:,} resamples, seed "
        f"{r.boot_seed}). † marks extra-loop depths T > {r.train_depth_max}.",
        "",
    ]
    seed_set = r.seed_spec if isinstance(r.seed_spec, (str, type(None))) else list(r.seed_spec)
    r.json = {
        "source": r.source,
        "generated": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "n_records": len(r.records),
        "reference": r.reference,
        "seed_set": seed_set,
        "train_depth_max": r.train_depth_max,
        "confidence": r.confidence,
        "n_boot": r.n_boot,
        "boot_seed": r.boot_seed,
    }
    for cls in sections:
        r.json.update({k: [] for k in cls.json_keys})
    for cls in sections:
        recs = r.by_section.get(cls.name, [])
        if recs:
            cls(r).write(recs)
    if r.incomplete:
        r.md += ["## Incomplete summaries", ""]
        r.md += [f"- {md_escape(x)}" for x in r.incomplete]
        r.md.append("")
    r.json["incomplete"] = r.incomplete
    r.json["figures"] = [str(p.relative_to(r.out_dir)) for p in r.figures]


_PRINTED = ("### Paired deltas", "## Recurrence scaling law")


def key_tables(markdown: str) -> str:
    """The report's paired-delta tables (each under its context heading) and the φ table: the
    sections ``looplm report`` prints, the rest stays in ``report.md``."""
    out: list[str] = []
    context, keep = "", False
    for line in markdown.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            keep = line.startswith(_PRINTED)
            if line.startswith("## ") and not keep:
                context = line
            elif keep:
                if context and line.startswith("### "):
                    out += [context, ""]
                context = ""
                out.append(line)
            continue
        if keep and not line.startswith("!["):
            out.append(line)
    return "\n".join(out).strip()


def _check_reference(
    reference: str, records: list, store_path: str | os.PathLike, known: Iterable[str] | None
) -> None:
    """A reference that names no method at all is a typo, not a table without paired deltas:
    refuse it before any work. ``known``: every method name there is (the registered
    recurrences; the command passes them, the results layer does not import model code); a
    known method missing from this store (the default ``scse`` on a store of baselines) keeps
    today's note in each table instead. Without ``known`` nothing is refused. (The command
    passes the default reference only: the results layer does not import model code, so a
    registered method that is in neither the store nor ``known`` is refused there too.)"""
    in_store = sorted({r.method for r in records})
    if known is None or reference in in_store or reference in set(known):
        return
    raise LoopLMError(
        f"reference {reference!r} is not a method; allowed (the methods in {store_path}): "
        f"{', '.join(in_store)}"
    )


def report_folder(store: str | os.PathLike, out: str | os.PathLike | None) -> Path:
    """``out``, else ``<store folder>/report``; replacing an earlier report there is said on
    stderr (even under ``--quiet``: a report is never replaced silently)."""
    if out:
        return Path(out)
    folder = Path(store).resolve().parent / "report"
    if (folder / "report.md").is_file():
        print(f"note: replacing the earlier report in {folder} (--out keeps it)", file=sys.stderr)
    return folder


def write_report(
    store_path: str | os.PathLike,
    out_dir: str | os.PathLike,
    settings: ReportSettings | None = None,
    *,
    known_methods: Iterable[str] | None = None,
    **changes: Any,
) -> ReportResult:
    """Write ``report.md``, ``results.json`` and ``figures/*.png`` for a results file.

    ``store_path`` is a SQLite results store or a JSON file from ``ResultsStore.export_json``;
    ``out_dir`` the output folder (created). ``settings`` (:class:`~looplm.results.settings.
    ReportSettings`; ``changes`` replace single fields, e.g. ``seeds=[0, 1]``) say against which
    method the paired deltas are taken (Δ = reference − method), which seed set is required,
    the largest training depth (deeper T are marked extra-loop), the bootstrap and interval
    settings and whether figures are drawn. ``known_methods``: every method name there is; a
    ``reference`` outside them and the store is refused before any work (the command passes
    the default reference; without it nothing is refused).

    Raises LoopLMError for a missing/unreadable store, an empty store, or (unless
    ``allow_incomplete``) a summary whose seed set is incomplete or duplicated.
    """
    s = build_settings(
        ReportSettings, {**asdict(settings or ReportSettings()), **changes}, "report"
    )
    records = load_records(store_path)
    if not records:
        raise LoopLMError(f"results file {str(store_path)!r} holds no evaluations")
    _check_reference(s.reference, records, store_path, known_methods)
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    b = ReportContext(
        records,
        source=str(store_path),
        out_dir=out,
        reference=s.reference,
        seeds=s.seeds,
        train_depth_max=s.depth_max,
        allow_incomplete=s.allow_incomplete,
        n_boot=s.n_boot,
        boot_seed=s.boot_seed,
        confidence=s.confidence,
        ppl_shift=s.ppl_shift,
        figures=s.figures,
    )
    _build(b)
    md_path, json_path = out / "report.md", out / "results.json"
    atomic_write_text(md_path, "\n".join(b.md).rstrip() + "\n")
    atomic_write_text(
        json_path, json.dumps(finite_or_none(b.json), indent=2, allow_nan=False) + "\n"
    )
    return ReportResult(out, md_path, json_path, b.figures, b.incomplete)
