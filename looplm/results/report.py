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

Grouping rules (:mod:`looplm.results.tables`): rows are (method, model_hash); when a method has
several model hashes in one table the row label carries the short hash. Records whose ``extra``
holds scaling-sweep fields go to the scaling section only. Methods named ``unshared*`` are
absolute references and are not bolded (as in the paper), unless they are the only rows. The
figures are drawn by :mod:`looplm.results.figures`, the adaptive sections by
:mod:`looplm.results.report_adaptive`.
"""

from __future__ import annotations

import json
import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.io import atomic_write_text
from looplm.results.figures import Series, plot_depth_response, plot_scaling
from looplm.results.frontier import FrontierSections, is_frontier_record
from looplm.results.report_adaptive import AdaptiveSections
from looplm.results.scaling import (
    bootstrap_records,
    fit_records,
    is_scaling_record,
    scaling_points,
)
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
from looplm.results.tables import (
    REFERENCE_PREFIX,
    context_title,
    finite_or_none,
    fmt_num,
    has_accuracy,
    md_escape,
    mean_std_table,
    method_order,
    row_keys,
    row_labels,
    slug,
)

CONTEXT_FIELDS = ("protocol", "dataset", "split", "eval_tag", "calibration")
ADAPTIVE_CONTEXT_FIELDS = ("protocol", "dataset", "split", "eval_tag")
PHI_BOOT = 200  # bootstrap resamples for φ's interval


# --------------------------------------------------------------------------- the report
@dataclass
class ReportResult:
    """Paths written by :func:`write_report`."""

    out_dir: Path
    report_md: Path
    results_json: Path
    figures: list[Path] = field(default_factory=list)
    incomplete: list[str] = field(default_factory=list)


class _Builder(AdaptiveSections, FrontierSections):
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
        self.colors = {m: f"C{i % 10}" for i, m in enumerate(method_order(methods, reference))}
        # the paired-delta seed restriction: explicit sets restrict, "auto"/"all" pair what exists
        if seeds is None or (isinstance(seeds, str) and seeds in ("auto", "all")):
            self.pair_seeds = None
        else:
            self.pair_seeds = resolve_seed_set(seeds)

    # -- helpers --------------------------------------------------------------------------
    def _unique_slug(self, prefix: str, parts: Sequence[Any]) -> str:
        base = f"{prefix}_{slug(parts)}"
        name, i = base, 2
        while name in self._slugs:
            name, i = f"{base}_{i}", i + 1
        self._slugs.add(name)
        return name

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
        frontier = [r for r in self.records if is_frontier_record(r)]
        rest = [r for r in self.records if not is_scaling_record(r) and not is_frontier_record(r)]
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
        if frontier:
            self._frontier_section(frontier)
        if self.incomplete:
            self.md += ["## Incomplete summaries", ""]
            self.md += [f"- {md_escape(x)}" for x in self.incomplete]
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
        """Markdown methods × depths table (:func:`~looplm.results.tables.mean_std_table`)."""
        header = self._depth_header(depths)
        return mean_std_table(
            rows, labels, depths, header, cells, scale=scale, lower_is_better=lower_is_better
        )

    def _fixed_section(self, ctx: dict[str, str], recs: list[EvalRecord]) -> None:
        title = context_title(ctx)
        rows = row_keys(recs, self.reference)
        labels = row_labels(rows)
        by_cell = group_by(recs, ("method", "model_hash", "depth"))
        depths = sorted({r.depth for r in recs})
        ppl: dict[tuple[tuple[str, str], int], Summary] = {}
        acc: dict[tuple[tuple[str, str], int], Summary] = {}
        for (m, h, d), cell in by_cell.items():
            label = f"{title}: {labels[(m, h)]} T={d}"
            ppl[((m, h), d)] = self._summary(cell, "ppl", label)
            acc_recs = [r for r in cell if has_accuracy(r)]
            if acc_recs:
                acc[((m, h), d)] = self._summary(acc_recs, "accuracy", label)
        self.md += [f"## {title}", "", "### PPL (mean ± std over seeds)", ""]
        lines, dec = self._table(rows, labels, depths, ppl)
        self.md += lines
        bold_note = "**Bold**: lowest mean per column"
        if any(k[0].startswith(REFERENCE_PREFIX) for k in rows):
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
        if self.make_figures and len(depths) >= 2:
            self._depth_figure(ctx, rows, labels, depths, ppl, entry)
        # paired deltas vs the reference
        entry["deltas"] = self._delta_block(recs, rows, labels, "ppl", "PPL", dec + 1)
        if acc:
            self.md += ["### Task accuracy (%, mean ± std over seeds)", ""]
            lines, adec = self._table(rows, labels, depths, acc, scale=100.0, lower_is_better=False)
            self.md += lines
            self.md += ["", "**Bold**: highest mean per column.", ""]
            acc_recs = [r for r in recs if has_accuracy(r)]
            entry["accuracy_deltas"] = self._delta_block(
                acc_recs,
                row_keys(acc_recs, self.reference),
                labels,
                "accuracy",
                "accuracy, percentage points",
                adec + 1,
                scale=100.0,
            )
        self.json["fixed_depth"].append(entry)

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
                series.append(Series(labels[k], ds, means, stds, self.colors[k[0]]))
        if not series:
            return
        slug = self._unique_slug("depth_response", ctx.values())
        path = self.out_dir / "figures" / f"{slug}.png"
        shift = plot_depth_response(
            series,
            path,
            train_depth_max=self.train_depth_max,
            shift=self.ppl_shift,
            title=context_title(ctx, code=False),
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
            f"| {md_escape(label)} | {pd.depth}{tmark} | {pd.n} | {mean} ± {hw} | {boot} | "
            f"{','.join(map(str, pd.seeds))} |"
        )

    def _scaling_section(self, recs: list[EvalRecord]) -> None:
        self.md += [
            "## Recurrence scaling law (the recurrence-equivalence exponent φ)",
            "",
            "L = E + A·(N_once + r^φ·N_rec)^−α + B·D^−β, fitted in log space (Huber, "
            "multiple starts); L is the token-weighted mean NLL (nats). φ's interval: 95% "
            f"percentile bootstrap over {PHI_BOOT} resamples of the sweep points.",
            "",
            "| Method | context | points | φ | φ 95% CI | E | A | α | B | β | RMSE(log L) |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        fields = ("method",) + ADAPTIVE_CONTEXT_FIELDS
        groups: dict[tuple, list[EvalRecord]] = {}
        for rec in recs:  # one fit per method over every training variant of a sweep
            sweep = rec.extra.get("sweep_protocol") or rec.protocol
            key = (rec.method, sweep, rec.dataset, rec.split, rec.eval_tag)
            groups.setdefault(key, []).append(rec)
        for key, grp in sorted(groups.items()):
            ctx = dict(zip(fields, key))
            ctx_text = context_title({k: v for k, v in ctx.items() if k != "method"})
            try:
                fit = fit_records(grp)
            except LoopLMError as exc:
                notes.append(f"- `{ctx['method']}` ({ctx_text}): no fit — {exc}")
                self.json["scaling"].append({"context": ctx, "error": str(exc)})
                continue
            try:
                ci = bootstrap_records(grp, fit=fit, n_boot=PHI_BOOT, seed=self.boot_seed)
                ci_text, ci_json = f"[{ci.low:.3f}, {ci.high:.3f}]", ci.to_dict()
            except LoopLMError as exc:
                ci_text, ci_json = "–", {"error": str(exc)}
            self.md.append(
                f"| {md_escape(ctx['method'])} | {md_escape(ctx_text)} | {fit.n_points} | "
                f"**{fit.phi:.3f}** | {ci_text} | {fit.E:.3f} | {fit.A:.4g} | {fit.alpha:.3f} | "
                f"{fit.B:.4g} | {fit.beta:.3f} | {fit.rmse_log:.2g} |"
            )
            entry: dict[str, Any] = {"context": ctx, "fit": fit.to_dict(), "phi_interval": ci_json}
            if self.make_figures:
                slug = self._unique_slug("scaling", ctx.values())
                path = self.out_dir / "figures" / f"{slug}.png"
                plain = context_title({k: v for k, v in ctx.items() if k != "method"}, False)
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


# long: the report's sections in reading order
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
        json_path, json.dumps(finite_or_none(b.json), indent=2, allow_nan=False) + "\n"
    )
    return ReportResult(out, md_path, json_path, b.figures, b.incomplete)
