"""The options of the experiment commands as settings dataclasses (``looplm sweep``, ``looplm
demo``, ``looplm findings``, ``looplm paper``, ``looplm settings``): :mod:`looplm.settings.options`
makes each command line from its dataclass, and the settings machinery checks the values. Light on
purpose: the command line imports this module at start-up (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.errors import LoopLMError
from looplm.settings import setting

DEMO_TASKS = ("bool_logic", "graph_reach", "relational_text")


@dataclass
class SweepSettings:
    """``looplm sweep CONFIG``: what part of the grid to run."""

    data_dir: str | None = None  # folder with local corpora (default: config / $LOOPLM_DATA_DIR)
    dry_run: bool = False  # list the runs and exit
    full: bool = False  # the config's larger grid (its 'full:' section)
    train: bool = True  # train missing runs (--no-train: evaluate existing checkpoints only)
    report: bool = True  # write the report at the end (--no-report skips it)
    report_only: bool = False  # only (re)write the report from the store
    # evaluation kinds to recompute even if stored (rows are replaced): fixed, adaptive,
    # transfer, lambada, frontier, propagation, lens, scaling, diagnostics
    redo: tuple[str, ...] = ()


@dataclass
class DemoSettings:
    """``looplm demo``: where it writes, how long it trains, which methods on which task."""

    out: str = "demo_out"  # output folder (default demo_out)
    quick: bool = False  # short schedule: 150 training steps per method instead of 500
    # recurrence names, or 'all' for every registered method
    methods: tuple[str, ...] = ("scse", "looped", "tuned_adapter")
    seed: int = setting(0, lo=0)  # seed of the parameters and the data
    # synthetic task (default: nested boolean logic)
    task: str = setting("bool_logic", choices=DEMO_TASKS)

    def validate(self) -> None:
        """At least one method."""
        if not self.methods:
            raise LoopLMError("--methods is empty; give recurrence names like scse,looped or all")


@dataclass
class FindingsSettings:
    """``looplm findings [GRID …]``: where the rows come from and which page is refreshed."""

    # read each grid's rows from its export in this folder (<folder>/<grid>.jsonl, see `looplm
    # results export`) instead of its results store
    data: str | None = None
    # replace the page's '<!-- generated: findings GRID -->' blocks in place
    write: str | None = None


@dataclass
class ReferenceSettings:
    """``looplm settings``: where the configuration reference goes."""

    out: str | None = None  # write the reference here (atomically) instead of printing it


@dataclass
class PaperSettings:
    """``looplm paper``: the catalogue of the paper's tables and figures."""

    data_dir: str | None = None  # folder with local corpora (default: $LOOPLM_DATA_DIR)
    json: bool = False  # catalogue as JSON


@dataclass
class PaperRunSettings:
    """``looplm paper run ENTRY``: which protocol, and what part of its grid runs."""

    full: bool = False  # the paper's protocol (default: CPU analogue)
    dry_run: bool = False  # list the runs and exit
    train: bool = True  # train missing runs (--no-train: evaluate existing checkpoints only)
    report: bool = True  # write the sweep report at the end (--no-report skips it)


@dataclass
class PaperReportSettings:
    """``looplm paper report [ENTRY …]``: which measured values, and where the page goes."""

    full: bool = False  # measured values of the full protocol
    out: str | None = None  # also write the Markdown to this file (diagnostics figures beside it)
    # read each grid's rows from its committed export in this folder (<folder>/<grid>.jsonl,
    # see `looplm results export`) instead of its run folder
    data: str | None = None
