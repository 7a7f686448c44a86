"""The settings of an experiment grid (``configs/experiments/*.yaml``), as dataclasses.

:mod:`looplm.experiments.runner` reads a grid through these classes (:func:`looplm.settings.
build_settings`): an unknown key or a value of the wrong type stops with one line naming it and
the allowed keys, and ``docs/configuration.md`` lists every key from them. The run config under
``base`` is a :class:`looplm.settings.config.RunConfig`; the sections under ``evaluate`` other than the
common keys below belong to the evaluation kinds (each kind's ``Settings``).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from looplm.results.settings import DEFAULT_REFERENCE, ReportSettings


@dataclass
class ExperimentSettings:
    """The top level of an experiment config."""

    name: str = ""  # the experiment's name (default: the file name without .yaml)
    # run folders: <out_root>/[<variant>/]<method>/seed<seed> (default runs/<name>)
    out_root: str | None = None
    store: str | None = None  # results store (default <out_root>/results.sqlite)
    report_dir: str | None = None  # report folder (default <out_root>/report)
    data_dir: str | None = None  # corpora folder (default: $LOOPLM_DATA_DIR)
    # torch.set_num_threads for the whole sweep (null: leave as is)
    torch_threads: int | None = None
    # protocol identity of the runs (default <dataset>-<steps>); a variant appends -<name>
    protocol: str | None = None
    # required: the run config every run starts from (model, data, train, eval), as configs/*.yaml
    base: dict[str, Any] | None = None
    # required: recurrence names or {name, recurrence, args, overrides} entries (below)
    methods: list[Any] | None = None
    seeds: list[int] = field(default_factory=lambda: [0])  # training seeds of every method
    # training variants crossed with every method: {name, overrides} entries (below); none: one unnamed variant
    variants: list[Any] = field(default_factory=list)
    # the evaluations of every run: the common keys and one section per evaluation kind (below)
    evaluate: dict[str, Any] = field(default_factory=dict)
    # settings of the report written after the sweep (below)
    report: dict[str, Any] = field(default_factory=dict)
    # a larger grid (`looplm sweep --full`): its keys replace the grid's, mappings merge into them
    full: dict[str, Any] | None = None
    # training order: method (each method's seeds in turn) or seed (every method at the first
    # seed, then every method at the next, ...)
    run_order: str = "method"
    # start from another grid (a path relative to this file): this file's keys replace (mappings:
    # merge into) its keys; a method named by a bare string is the parent's entry of that name
    extends: str | None = None
    # catalogue metadata of a paper table or figure (looplm.experiments.paper); the sweep ignores it
    paper: dict[str, Any] | None = None
    # the source papers' claims this grid tests, with their verdict criteria (looplm.experiments.findings);
    # the sweep ignores it
    findings: dict[str, Any] | None = None

    def validate(self) -> None:
        from looplm.errors import LoopLMError

        if self.run_order not in ("method", "seed"):
            raise LoopLMError(f"run_order={self.run_order!r}; allowed: method, seed")


@dataclass
class MethodSettings:
    """One entry of ``methods`` (a plain name is ``{name: <name>}``)."""

    name: str = ""  # required: the method's name in run folders, store rows and reports
    recurrence: str | None = None  # the registered recurrence it runs (default: the name)
    # the recurrence's settings (model.recurrence_args)
    args: dict[str, Any] = field(default_factory=dict)
    # other key=value run-config overrides for this method only
    overrides: list[str] = field(default_factory=list)
    # the training variants this method runs in (default: all of them)
    variants: list[str] | None = None


@dataclass
class VariantSettings:
    """One entry of ``variants``."""

    name: str = ""  # the variant's name (a folder level and a protocol suffix)
    # key=value run-config overrides of this variant
    overrides: list[str] = field(default_factory=list)


def check_report(rep: ReportSettings, runs: list[Any]) -> None:
    """The ``report`` section against the grid (checked before any training; the report comes
    last): a reference that was set must be one of the grid's methods."""
    from looplm.errors import LoopLMError

    methods = sorted({p.method for p in runs})
    if rep.reference != DEFAULT_REFERENCE and rep.reference not in methods:
        raise LoopLMError(
            f"report.reference={rep.reference!r} is not a method of this grid; allowed: "
            f"{', '.join(methods)}"
        )
