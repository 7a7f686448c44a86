"""The settings of a report, one dataclass read by ``looplm report``, the ``report:`` section of
an experiment grid and :func:`looplm.results.report.write_report` alike (:mod:`looplm.settings.options`
makes the command line from it). Light (no numpy until it is validated)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.errors import LoopLMError
from looplm.settings import setting

DEFAULT_REFERENCE = "scse"  # the method paired deltas are taken against (the paper's method)
DEFAULT_TRAIN_DEPTH_MAX = 8  # a store alone does not say how deep its runs were trained


@dataclass
class ReportSettings:
    """How a report aggregates a results store."""

    # required seed set (default: auto): ids like 0,1,2, or a named set: auto (0-4 where
    # complete, else 0,1,2), default (0,1,2), expanded (0-4), all
    seeds: list[int] | str = setting("auto", lo=0)
    # deepest training depth; deeper T are marked extra-loop (default: the runs' train.depth_max
    # in a grid, else 8)
    train_depth_max: int | None = setting(None, lo=1, hi=1_000_000)
    # mark summaries with missing or duplicate seeds instead of stopping
    allow_incomplete: bool = False
    reference: str = DEFAULT_REFERENCE  # the method paired deltas are taken against
    n_boot: int = setting(10_000, lo=1, cap=10_000_000)  # paired-bootstrap resamples
    boot_seed: int = setting(0, lo=0)  # bootstrap RNG seed
    confidence: float = setting(0.95, lo=0.5, hi=0.999999)  # level of the intervals
    ppl_shift: float | None = None  # fixed c for log(PPL - c) axes (default: chosen per figure)
    figures: bool = True  # render the PNG figures

    def validate(self) -> None:
        from looplm.results.stats import SEED_SET_NAMES, resolve_seed_set

        if isinstance(self.seeds, str) and self.seeds not in SEED_SET_NAMES:
            try:  # the command line's "0,1,2"
                self.seeds = [int(x) for x in self.seeds.split(",") if x.strip()] or self.seeds
            except ValueError:
                pass
        if isinstance(self.seeds, str) and self.seeds not in SEED_SET_NAMES:
            raise LoopLMError(
                f"report.seeds={self.seeds!r}: unknown seed set; allowed: "
                f"{', '.join(SEED_SET_NAMES)} or a list of ints like 0,1,2"
            )
        resolve_seed_set(self.seeds)

    @property
    def depth_max(self) -> int:
        """``train_depth_max``, or 8 when it is not given."""
        return self.train_depth_max or DEFAULT_TRAIN_DEPTH_MAX


@dataclass
class ReportOutput:
    """``looplm report STORE``: where the report goes and what is printed."""

    out: str | None = None  # output folder (default: <store folder>/report)
    quiet: bool = False  # print only the paths written


@dataclass
class ResultsExportSettings:
    """``looplm results export STORE``: where the rows go."""

    out: str  # the export file (.jsonl or .jsonl.gz)


@dataclass
class ResultsImportSettings:
    """``looplm results import EXPORT``: where the rows go."""

    store: str  # the results store to write (.sqlite)
