"""The evaluation-kind interface and registry.

An evaluation kind is one small class per kind of measurement the experiment runner makes for
every trained run (fixed-depth sweep, adaptive depth, held-out transfer, LAMBADA, …). It declares

    name        the kind's name (``--redo`` takes it; ``sweep --redo fixed,lambada``); every
                record the kind writes carries it (``extra['kind']``, see :meth:`stamp`)
    section     its key under ``evaluate:`` in the experiment YAML (None: it uses only the
                common keys ``split``, ``max_tokens``, ``depths``, ``batch_size``, ``tag``)
    Settings    the dataclass of that section's keys (an entry's, for a list section), read with
                :func:`looplm.settings.build_settings` and listed in ``docs/configuration.md``
    order       where it runs among the kinds (the store rows do not depend on it)

and implements

    configure(evaluate) -> kind | None      validate its settings; None when not asked for
    identities(job) -> [identity, …]        the store identities it would write for a run
    run(job, todo) -> [EvalRecord, …]       measure the identities ``todo`` (a subset)

Its records go to the section of ``looplm report`` that names the kind
(:class:`looplm.results.sections.ReportSection`, ``kinds = (...)``): the fixed-depth, transfer,
LAMBADA and diagnostics rows to the depth tables, the others to their own sections. A plugin
kind brings its section in the same module.

The runner asks each configured kind for its identities, skips those already in the store and
writes the records :meth:`EvaluationKind.records` returns (``run``'s, marked with the kind), so a
kind never deals with the store or with resuming.
Adding a kind is one file in this folder (found by a package scan), or a plugin module named by
an entry point (group ``looplm.evaluations``) or by ``$LOOPLM_PLUGINS``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

from looplm.errors import LoopLMError
from looplm.evaluate.settings import DEFAULT_DEPTHS, EvaluateSettings
from looplm.settings import build_settings
from looplm.settings.plugins import Registry

COMMON_KEYS = {f.name for f in dataclasses.fields(EvaluateSettings)}


def check_settings(cls: type, values: Any, where: str) -> dict[str, Any]:
    """``values`` checked against the settings dataclass ``cls`` (unknown keys, types, required
    keys and its ``validate()``, in one-line errors naming ``where.<key>``); returns them."""
    build_settings(cls, values, where)
    return values or {}


def check_keys(d: Any, allowed: set[str], where: str) -> dict[str, Any]:
    """``d`` as a mapping whose keys are all in ``allowed`` (else a one-line LoopLMError)."""
    if d is None:
        return {}
    if not isinstance(d, dict):
        raise LoopLMError(f"{where} must be a mapping, got {type(d).__name__}")
    unknown = sorted(set(d) - allowed)
    if unknown:
        raise LoopLMError(
            f"unknown key {where}.{unknown[0]}; allowed: {', '.join(sorted(allowed))}"
        )
    return d


@dataclass
class EvalJob:
    """One trained run, as every evaluation kind sees it: its config, identity fields, where
    its checkpoint is, the experiment's common evaluation settings, and the model (loaded on
    first use, checked against the run's config hash)."""

    cfg: Any  # RunConfig
    protocol: str
    checkpoint: Path
    model_hash: str
    evaluate: dict[str, Any]  # the experiment's evaluate section (depths already parsed)
    data_dir: str | None = None
    progress: bool = False
    device: Any = None
    extra: dict[str, Any] = field(default_factory=dict)  # written into every record
    sweep_protocol: str = ""  # the grid's protocol without a training variant's suffix (default:
    # ``protocol``)
    _model: Any = None

    def __post_init__(self) -> None:
        from looplm.device import resolve_device

        self.device = resolve_device(self.device or self.cfg.train.device)
        self.extra = {"checkpoint": str(self.checkpoint), **self.extra}
        self.sweep_protocol = self.sweep_protocol or self.protocol

    @property
    def batch_size(self) -> int:
        return int(self.evaluate.get("batch_size") or self.cfg.eval.batch_size)

    @property
    def split(self) -> str:
        return self.evaluate.get("split", "test")

    @property
    def max_tokens(self) -> int | None:
        return self.evaluate.get("max_tokens")

    @property
    def depths(self) -> list[int]:
        return list(self.evaluate.get("depths", DEFAULT_DEPTHS))

    def tag(self, **cap: int | None) -> str:
        """The eval tag: the experiment's tag plus the evaluation cap (``max_tokens=…``)."""
        from looplm.evaluate.records import eval_tag

        return eval_tag(self.evaluate.get("tag", ""), **cap)

    def model(self) -> Any:
        """The run's model on the job's device (loaded once); records get its training step."""
        if self._model is None:
            from looplm.evaluate.records import model_hash
            from looplm.model.checkpoint import load_checkpoint

            self._model, saved, meta = load_checkpoint(self.checkpoint, map_location=self.device)
            if model_hash(saved) != self.model_hash:
                raise LoopLMError(f"{self.checkpoint}: config hash changed since training")
            self.extra["step"] = meta["state"].get("step")
        return self._model


class EvaluationKind:
    """Base class; see the module docstring for the contract."""

    name: ClassVar[str] = ""
    section: ClassVar[str | None] = None
    Settings: ClassVar[type | None] = None
    order: ClassVar[int] = 100

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> EvaluationKind | None:
        """The kind set up from the experiment's ``evaluate`` section (None: not asked for). By
        default: ``evaluate[cls.section]``, when present and not empty, read into ``cls.Settings``
        (errors name ``evaluate.<section>.<key>``) and handed to ``cls(settings)``."""
        raw = evaluate.get(cls.section) if cls.section else None
        if not raw or cls.Settings is None:
            return None
        from looplm.settings import build_settings

        return cls(build_settings(cls.Settings, raw, f"evaluate.{cls.section}"))

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        raise NotImplementedError

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        raise NotImplementedError

    def records(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        """:meth:`run`'s records, each marked with this kind (what the runner stores)."""
        return self.stamp(self.run(job, todo))

    @classmethod
    def stamp(cls, records: list[Any]) -> list[Any]:
        """Mark ``records`` as written by this kind (``extra['kind']``); returns them."""
        for rec in records:
            rec.extra = {**rec.extra, "kind": cls.name}
        return records

    @classmethod
    def depth_records(cls, rows: list[dict[str, Any]], cfg: Any, **identity: Any) -> list[Any]:
        """Store records of per-depth result rows of a run with config ``cfg``
        (:func:`looplm.evaluate.records.fixed_depth_records`), marked with this kind."""
        from looplm.evaluate.records import fixed_depth_records

        return cls.stamp(fixed_depth_records(rows, cfg, **identity))


_KINDS: Registry[EvaluationKind] = Registry("evaluation kind", "looplm.evaluations")


def register_kind(cls: type[EvaluationKind]) -> type[EvaluationKind]:
    """Class decorator adding an evaluation kind to the registry under ``cls.name``."""
    return _KINDS.register(cls)


def evaluation_kinds() -> list[type[EvaluationKind]]:
    """Registered kinds in their running order (plugins loaded on first use)."""
    return sorted(_KINDS.items().values(), key=lambda k: (k.order, k.name))


def get_kind(name: str) -> type[EvaluationKind]:
    """The kind registered as ``name`` (LoopLMError naming the registered ones)."""
    kinds = _KINDS.items()
    if name not in kinds:
        raise LoopLMError(f"unknown evaluation kind {name!r}; allowed: {', '.join(kind_names())}")
    return kinds[name]


def kind_names() -> list[str]:
    """Names of the registered kinds, in running order."""
    return [k.name for k in evaluation_kinds()]


def evaluate_keys() -> set[str]:
    """Keys allowed under ``evaluate:``: the common ones and each kind's section."""
    return COMMON_KEYS | {k.section for k in evaluation_kinds() if k.section}


def configure_kinds(evaluate: dict[str, Any]) -> list[EvaluationKind]:
    """Every registered kind the ``evaluate`` section asks for, configured (validated)."""
    out = []
    for cls in evaluation_kinds():
        kind = cls.configure(evaluate)
        if kind is not None:
            out.append(kind)
    return out
