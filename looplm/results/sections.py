"""Report sections: what a section of ``report.md`` / ``results.json`` may use, and which
records it reports.

A :class:`ReportSection` names the evaluation kinds whose records it reports (``kinds``; the
kinds themselves live in :mod:`looplm.evaluate.kinds`, and every record carries the name of the
kind that wrote it, ``EvalRecord.kind``). Several kinds may share a section: the fixed-depth,
transfer, LAMBADA and diagnostics rows are all methods × depths tables. The report writes every
registered section, in ``order``, from the records of its kinds; a section sees the report only
through the :class:`ReportContext` it is given (the settings, the output lists and two helpers),
so a section written outside looplm has the same means as the built-in ones. A plugin kind
registers its section (:func:`register_section`) in its own module, which the same entry-point
group (``looplm.evaluations``) or ``$LOOPLM_PLUGINS`` loads.

Records written before kinds were recorded have no kind; :func:`legacy_kind` recognises them by
their fields, as the report always did, so old stores report unchanged.
"""

from __future__ import annotations

import importlib
import re
from collections.abc import Sequence
from pathlib import Path
from typing import Any, ClassVar

from looplm.errors import LoopLMError
from looplm.results.stats import (
    DEFAULT_SEEDS,
    EXPANDED_SEEDS,
    SeedSpec,
    Summary,
    resolve_seed_set,
    summarize,
)
from looplm.results.store import EvalRecord
from looplm.results.tables import method_order, slug
from looplm.settings.plugins import Registry, analysis_modules, import_submodules


class ReportContext:
    """Everything a report section may read or write.

    Settings: ``source``, ``out_dir``, ``reference``, ``seed_spec``, ``train_depth_max``,
    ``on_incomplete``, ``n_boot``, ``boot_seed``, ``confidence``, ``ppl_shift``,
    ``make_figures``, ``pair_seeds`` (the paired-delta seed restriction), ``colors`` (one per
    method). Outputs: ``md`` (report.md lines), ``json`` (results.json), ``figures`` (paths
    written), ``incomplete`` (summaries with missing or duplicate seeds). Records: ``records``
    (all of them) and :meth:`section_records` (another section's share, e.g. the fixed-depth
    rows an adaptive table compares against).
    """

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
        self.by_section: dict[str, list[EvalRecord]] = {}
        self._slugs: set[str] = set()
        methods = sorted({r.method for r in records})
        self.colors = {m: f"C{i % 10}" for i, m in enumerate(method_order(methods, reference))}
        # the paired-delta seed restriction: explicit sets restrict, "auto"/"all" pair what exists
        if seeds is None or (isinstance(seeds, str) and seeds in ("auto", "all")):
            self.pair_seeds = None
        else:
            self.pair_seeds = resolve_seed_set(seeds)

    def section_records(self, name: str) -> list[EvalRecord]:
        """The records that belong to the section called ``name`` (empty when none)."""
        return self.by_section.get(name, [])

    def unique_slug(self, prefix: str, parts: Sequence[Any]) -> str:
        """A figure file name (without .png) not used before in this report."""
        base = f"{prefix}_{slug(parts)}"
        name, i = base, 2
        while name in self._slugs:
            name, i = f"{base}_{i}", i + 1
        self._slugs.add(name)
        return name

    def summary(self, recs: list[EvalRecord], metric: str, label: str) -> Summary:
        """Mean ± std of ``metric`` over the required seeds (incomplete sets are listed)."""
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

    def seed_text(self) -> str:
        """The seed rule in words (the report's header)."""
        spec = self.seed_spec
        if isinstance(spec, str) and spec == "auto":
            return (
                f"auto: the expanded set {list(EXPANDED_SEEDS)} where all of it is present, "
                f"else the default set {list(DEFAULT_SEEDS)}"
            )
        if spec is None or spec == "all":
            return "all seeds present (no required set)"
        return f"required seeds {list(resolve_seed_set(spec))}"


def _problem(s: Summary) -> str:
    parts = []
    if s.missing:
        parts.append(f"missing seed(s) {list(s.missing)}")
    if s.duplicates:
        parts.append(f"duplicate seed(s) {list(s.duplicates)}")
    return "; ".join(parts) + f"; used {list(s.seeds)}"


class ReportSection:
    """One section of the report: ``write`` appends to ``report.md`` (``self.report.md``) and
    ``results.json`` (``self.report.json``) from the records of its kinds.

    ``name`` is the section's key among the report's sections, ``kinds`` the evaluation kinds
    whose records it reports, ``order`` its place in the report, ``json_keys`` the results.json
    entries it always creates (empty lists), so that a report without such records still has
    them.
    """

    name: ClassVar[str] = ""
    kinds: ClassVar[tuple[str, ...]] = ()
    order: ClassVar[int] = 100
    json_keys: ClassVar[tuple[str, ...]] = ()

    def __init__(self, report: ReportContext) -> None:
        self.report = report

    def write(self, records: list[EvalRecord]) -> None:
        raise NotImplementedError


_DIFFICULTY = re.compile(r"^difficulty=(\d+)$")


def difficulty_of(rec: EvalRecord) -> int | None:
    """The difficulty of a frontier record (its split ``difficulty=<d>``), else None."""
    m = _DIFFICULTY.match(rec.split or "")
    return int(m.group(1)) if m and "n_correct" in rec.extra else None


def legacy_kind(rec: EvalRecord) -> str:
    """The kind of a record written without one, recognised by its fields."""
    if all(k in rec.extra for k in SCALING_KEYS):  # a scaling-sweep point
        return "scaling"
    if "propagation" in rec.extra:
        return "propagation"
    if difficulty_of(rec) is not None:
        return "frontier"
    return "adaptive" if rec.adaptive_mode else "fixed"


# the fields of a record that is a point of the recurrence scaling fit (looplm.scaling)
SCALING_KEYS: tuple[str, ...] = ("n_once", "n_rec", "train_tokens")

_SECTIONS: Registry[ReportSection] = Registry("report section", "looplm.evaluations")


def register_section(cls: type[ReportSection]) -> type[ReportSection]:
    """Class decorator adding a report section to the registry under ``cls.name``."""
    return _SECTIONS.register(cls)


def report_sections() -> list[type[ReportSection]]:
    """Every registered section (built-in and plugins), in report order: the modules of
    :mod:`looplm.results` and each analysis package's ``section`` module are scanned, so a new
    section is one module with a :func:`register_section` class (no list to edit)."""
    import looplm.results

    import_submodules("looplm.results", looplm.results.__path__)
    for module in analysis_modules("section"):
        importlib.import_module(module)
    return sorted(_SECTIONS.items().values(), key=lambda c: (c.order, c.name))


def section_of(rec: EvalRecord, sections: Sequence[type[ReportSection]]) -> type[ReportSection]:
    """The section among ``sections`` that reports ``rec``'s kind (or :func:`legacy_kind`)."""
    kind = rec.kind or legacy_kind(rec)
    for cls in sections:
        if kind in cls.kinds:
            return cls
    raise LoopLMError(
        f"no report section for evaluation kind {kind!r} ({rec.method}, {rec.dataset}/"
        f"{rec.split}, T={rec.depth}); sections report: "
        + ", ".join(k for c in sections for k in c.kinds)
        + " (a plugin kind's section loads with $LOOPLM_PLUGINS)"
    )
