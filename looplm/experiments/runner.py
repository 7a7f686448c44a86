"""Experiments as code: a YAML grid of methods × seeds × training variants × evaluations.

``run_experiment("configs/experiments/wt2_tiny.yaml")`` (CLI: ``looplm sweep CONFIG``) trains every
run of the grid (skipping runs whose checkpoint is complete, resuming interrupted ones), evaluates
each run (skipping evaluations whose identity is already in the results store), then writes the
report (``looplm report``) plus ``supplement.md`` (adaptive-depth runtime, LAMBADA exact-word;
:mod:`looplm.results.supplement`). The evaluations are the registered evaluation kinds
(:mod:`looplm.evaluate.kinds`: ``fixed``, ``adaptive``, ``transfer``, ``lambada``, and any
plugin), each configured by its section under ``evaluate``.
Re-running the same command after an interruption finishes the missing work only.

The config's keys are the settings dataclasses of :mod:`looplm.experiments.grid` (top level, ``methods`` and
``variants`` entries, the common ``evaluate`` keys, ``report``) and each evaluation kind's
``Settings`` (its section under ``evaluate``); ``docs/configuration.md`` lists every key
(``looplm settings`` writes it) and ``docs/experiments.md`` shows a whole file.
``lambada.path`` is resolved against ``data_dir`` when it is not an existing path.
"""

from __future__ import annotations

import copy
import dataclasses
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import yaml

from looplm.errors import LoopLMError, yaml_problem
from looplm.evaluate.kinds.base import check_keys, check_settings
from looplm.evaluate.settings import DEFAULT_DEPTHS, EvaluateSettings
from looplm.experiments.cells import each_cell_locked
from looplm.experiments.grid import (
    ExperimentSettings,
    MethodSettings,
    VariantSettings,
    check_report,
)
from looplm.progress import progress_enabled
from looplm.results.settings import ReportSettings
from looplm.settings import build_settings, depth_list, load_yaml, merge
from looplm.settings.config import (
    UNSHARED,
    RunConfig,
    config_from_dict,
    parse_overrides,
)

_TOP_KEYS = {f.name for f in dataclasses.fields(ExperimentSettings)}


def _method_entry(m: Any, i: int) -> dict[str, Any]:
    """A ``methods`` entry: a recurrence name, or ``{name, recurrence, args, overrides}`` — a
    named method built from a recurrence with its own settings (``args``: recurrence settings;
    ``overrides``: other ``key=value`` config overrides for this method only)."""
    from looplm.model.recurrences import get_recurrence_class

    if isinstance(m, str):
        m = {"name": m}
    m = check_settings(MethodSettings, m, f"methods[{i}]")
    if not m.get("name"):
        raise LoopLMError(f"methods[{i}] needs a name")
    name = str(m["name"])
    rec = str(m.get("recurrence") or name)
    if rec != UNSHARED:
        get_recurrence_class(rec)  # LoopLMError naming the allowed methods
    args = m.get("args") or {}
    overrides = m.get("overrides") or []
    if not isinstance(args, dict) or not isinstance(overrides, list):
        raise LoopLMError(f"methods[{i}]: args must be a mapping and overrides a list")
    if not re.fullmatch(r"[A-Za-z0-9_.+-]+", name):
        raise LoopLMError(f"methods[{i}].name={name!r}: use letters, digits and _ . + - only")
    variants = m.get("variants")
    if variants is not None and not isinstance(variants, list):
        raise LoopLMError(f"methods[{i}].variants must be a list of variant names")
    return {
        "name": name,
        "recurrence": rec,
        "args": args,
        "overrides": [str(o) for o in overrides],
        "variants": None if variants is None else [str(v) for v in variants],
    }


@dataclass
class RunPlan:
    """One training run of the grid and where it lives."""

    method: str
    seed: int
    variant: str
    cfg: RunConfig
    protocol: str
    model_hash: str

    @property
    def run_dir(self) -> Path:
        return Path(self.cfg.out_dir)

    @property
    def ckpt(self) -> Path:
        return self.run_dir / "ckpt"

    @property
    def has_checkpoint(self) -> bool:
        from looplm.model.checkpoint import checkpoint_exists

        return checkpoint_exists(self.ckpt)

    @property
    def sweep_protocol(self) -> str:
        """The grid's protocol without this run's variant suffix: one φ fit spans its variants."""
        return self.protocol.removesuffix(f"-{self.variant}") if self.variant else self.protocol

    @property
    def label(self) -> str:
        v = f"{self.variant}/" if self.variant else ""
        return f"{v}{self.method} seed {self.seed}"


@dataclass
class Experiment:
    """A parsed, validated experiment config."""

    name: str
    path: Path
    out_root: Path
    store: Path
    report_dir: Path
    data_dir: str | None
    torch_threads: int | None
    runs: list[RunPlan]
    evaluate: dict[str, Any]
    report: ReportSettings = field(default_factory=ReportSettings)


def _read_yaml(path: str | os.PathLike, full: bool = False) -> tuple[Path, dict[str, Any]]:
    p = Path(path)
    if not p.is_file():
        # a name (wt2_tiny), or a path inside the checkout's configs/ written from its root
        # (configs/experiments/wt2_tiny.yaml, configs/paper/table19.yaml) run from any folder
        from looplm.settings.config import configs_root

        configs = configs_root()  # inside the package when installed from a wheel
        cands = [configs / "experiments" / f"{path}.yaml"]
        if not p.is_absolute() and p.parts[:1] == ("configs",):
            cands.insert(0, configs.joinpath(*p.parts[1:]))
        p = next((c for c in cands if c.is_file()), None)
        if p is None:
            known = sorted(q.stem for q in (configs / "experiments").glob("*.yaml"))
            raise LoopLMError(
                f"experiment config {str(path)!r} not found (a YAML path, or one of: "
                f"{', '.join(known) or 'none'})"
            )
    raw = _load_with_parents(p)[0]
    raw.pop("paper", None)
    raw.pop("findings", None)
    extra = raw.pop("full", None)
    if full:
        if not extra:
            raise LoopLMError(f"experiment config {p} has no 'full' section for --full")
        # the larger grid: its keys replace (mappings: merge into) the default grid's
        allowed = _TOP_KEYS - {"full", "extends", "paper", "findings"}
        raw = check_settings(
            ExperimentSettings, merge(raw, check_keys(extra, allowed, "full")), "experiment"
        )
    return p, raw


def _method_index(methods: Any) -> dict[str, Any]:
    if not isinstance(methods, list):
        return {}
    return {m["name"]: m for m in methods if isinstance(m, dict) and "name" in m}


def _load_with_parents(
    p: Path, seen: tuple[Path, ...] = ()
) -> tuple[dict[str, Any], dict[str, Any], dict[str, Any]]:
    """The YAML mapping of ``p`` merged over the config it ``extends`` (recursively), and the
    named method entries its ancestors and itself define (default grid, ``full`` grid).

    A method named by a bare string that an ancestor defines (with its args and overrides) is
    that entry: default methods from the default entries, ``full`` methods from the ``full``
    entries first."""
    try:
        raw = load_yaml(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LoopLMError(f"experiment config {p}: not valid YAML ({yaml_problem(exc)})") from None
    raw = dict(check_settings(ExperimentSettings, raw, "experiment"))
    parent = raw.pop("extends", None)
    if parent is None:
        default = _method_index(raw.get("methods"))
        return raw, default, {**default, **_method_index((raw.get("full") or {}).get("methods"))}
    if p.resolve() in seen:
        raise LoopLMError(f"experiment config {p}: 'extends' loops back to itself")
    q = p.parent / str(parent)
    if not q.is_file():
        raise LoopLMError(f"experiment config {p}: extends={parent!r}, but {q} does not exist")
    base, default, full = _load_with_parents(q, (*seen, p.resolve()))
    base.pop("paper", None)  # catalogue metadata belongs to its own file
    base.pop("findings", None)
    for section, known in ((raw, default), (raw.get("full") or {}, full)):
        if isinstance(section.get("methods"), list):
            section["methods"] = [
                copy.deepcopy(known[m]) if isinstance(m, str) and m in known else m
                for m in section["methods"]
            ]
    default = {**default, **_method_index(raw.get("methods"))}
    full = {**full, **_method_index((raw.get("full") or {}).get("methods"))}
    return merge(base, raw), default, full


def _methods(raw: dict[str, Any], p: Path) -> list[dict[str, Any]]:
    methods = raw.get("methods")
    if not methods or not isinstance(methods, list):
        raise LoopLMError(f"experiment config {p}: 'methods' must be a non-empty list")
    methods = [_method_entry(m, i) for i, m in enumerate(methods)]
    labels = [m["name"] for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise LoopLMError(f"experiment config {p}: method name {dup[0]!r} appears twice")
    return methods


def _run_plans(raw: dict[str, Any], p: Path, out_root: Path, data_dir: str | None) -> list[RunPlan]:
    """One plan per variant × method × seed, each RunConfig built (and validated)."""
    from looplm.data.cache import absolute_dataset
    from looplm.evaluate.records import model_hash, protocol_name

    base = raw.get("base")
    if not isinstance(base, dict):
        raise LoopLMError(f"experiment config {p}: 'base' (a RunConfig mapping) is required")
    methods = _methods(raw, p)
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise LoopLMError(f"experiment config {p}: 'seeds' must be a list of integers")
    runs = []
    for i, var in enumerate(raw.get("variants") or [{"name": "", "overrides": []}]):
        var = check_settings(VariantSettings, var, f"variants[{i}]")
        vname = str(var.get("name") or "")
        overrides = var.get("overrides") or []
        if not isinstance(overrides, list):
            raise LoopLMError(f"variants[{i}].overrides must be a list of key=value strings")
        for entry in methods:
            method = entry["name"]
            if entry["variants"] is not None and vname not in entry["variants"]:
                continue  # this method runs in some training variants only
            for seed in seeds:
                sub = Path(vname) / method if vname else Path(method)
                d = merge(base, parse_overrides([str(o) for o in overrides]))
                d = merge(d, parse_overrides(entry["overrides"]))
                d = merge(
                    d,
                    {
                        "model": {"recurrence": entry["recurrence"]},
                        "train": {"seed": seed},
                        "out_dir": str(out_root / sub / f"seed{seed}"),
                        "method": method if method != entry["recurrence"] else "",
                    },
                )
                if entry["args"]:
                    d = merge(d, {"model": {"recurrence_args": entry["args"]}})
                if data_dir and not d.get("data", {}).get("data_dir"):
                    d = merge(d, {"data": {"data_dir": str(data_dir)}})
                cfg = config_from_dict(d)
                # the path fit stores (absolute), so a rerun recognises its own checkpoints
                cfg.data.dataset = absolute_dataset(cfg.data.dataset)
                proto = protocol_name(cfg, raw.get("protocol"))
                if vname:
                    proto = f"{proto}-{vname}"
                runs.append(RunPlan(method, seed, vname, cfg, proto, model_hash(cfg)))
    if raw.get("run_order", "method") == "seed":  # every method at the first seeds first
        runs.sort(key=lambda r: seeds.index(r.seed))  # stable: variant and method order kept
    return runs


def _evaluate_section(raw: dict[str, Any]) -> dict[str, Any]:
    """The ``evaluate`` section with its depths parsed, every kind's settings validated."""
    from looplm.evaluate.kinds import configure_kinds, evaluate_keys

    ev = dict(check_keys(raw.get("evaluate") or {}, evaluate_keys(), "evaluate"))
    common = {
        k: v for k, v in ev.items() if k in {f.name for f in dataclasses.fields(EvaluateSettings)}
    }
    check_settings(EvaluateSettings, common, "evaluate")
    ev["depths"] = depth_list(ev.get("depths", DEFAULT_DEPTHS), "evaluate.depths")
    configure_kinds(ev)
    return ev


def load_experiment(
    path: str | os.PathLike, data_dir: str | None = None, *, full: bool = False
) -> Experiment:
    """Parse and validate an experiment YAML; every run's RunConfig is built (and validated).

    ``full``: apply the config's ``full:`` section (a larger grid, e.g. for a GPU) on top."""
    p, raw = _read_yaml(path, full)
    name = str(raw.get("name") or p.stem)
    out_root = Path(raw.get("out_root") or f"runs/{name}")
    data_dir = data_dir or raw.get("data_dir") or os.environ.get("LOOPLM_DATA_DIR")
    runs = _run_plans(raw, p, out_root, data_dir)
    ev = _evaluate_section(raw)
    rep = build_settings(ReportSettings, raw.get("report") or {}, "report")
    check_report(rep, runs)
    threads = raw.get("torch_threads")
    if threads is not None and (not isinstance(threads, int) or threads < 1):
        raise LoopLMError(f"torch_threads={threads!r} must be a positive integer or null")
    return Experiment(
        name=name,
        path=p,
        out_root=out_root,
        store=Path(raw.get("store") or out_root / "results.sqlite"),
        report_dir=Path(raw.get("report_dir") or out_root / "report"),
        data_dir=str(data_dir) if data_dir else None,
        torch_threads=threads,
        runs=runs,
        evaluate=ev,
        report=rep,
    )


# ----------------------------------------------------------------------------- training
def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def train_run(plan: RunPlan, *, progress: bool | None = None) -> str:
    """Train ``plan`` unless its checkpoint is complete: returns 'skipped', 'resumed' or 'trained'
    ('stopped' when ``train.max_wall_s`` ended it, 'interrupted:<signal>' on SIGTERM/SIGINT).

    A checkpoint whose config hashes differently from the plan is an error (the YAML changed
    under an existing run folder): delete the folder or change ``out_root``.
    """
    from looplm.evaluate.records import model_hash
    from looplm.model.checkpoint import read_meta
    from looplm.training.loop import fit

    resume = False
    if plan.has_checkpoint:
        meta = read_meta(plan.ckpt)
        saved = config_from_dict(meta["config"])
        if model_hash(saved) != plan.model_hash or saved.train.seed != plan.seed:
            raise LoopLMError(
                f"{plan.ckpt} was trained with a different config than the experiment now asks "
                f"for ({model_hash(saved)} vs {plan.model_hash}); delete {plan.run_dir} or change "
                "out_root"
            )
        if int(meta["state"].get("step", 0)) >= plan.cfg.train.steps:
            return "skipped"
        resume = True
    last = fit(plan.cfg, resume=resume, progress=progress_enabled(progress), quiet=True)
    if last.get("stopped") == "signal":
        return f"interrupted:{last['signal']}"
    if last.get("stopped"):  # train.max_wall_s: the checkpoint is unfinished, evaluation waits
        return "stopped"
    return "resumed" if resume else "trained"


# ----------------------------------------------------------------------------- evaluation
def eval_kinds() -> list[str]:
    """The registered evaluation kinds (``--redo`` names), in running order."""
    from looplm.evaluate.kinds import kind_names

    return kind_names()


def eval_job(exp: Any, plan: Any, **kw: Any) -> Any:
    """The evaluation job of one grid cell (``plan``) of experiment ``exp``; ``kw`` sets the
    job's other fields (device, progress)."""
    from looplm.evaluate.kinds import EvalJob

    return EvalJob(
        cfg=plan.cfg,
        protocol=plan.protocol,
        checkpoint=plan.ckpt,
        model_hash=plan.model_hash,
        evaluate=exp.evaluate,
        data_dir=exp.data_dir,
        sweep_protocol=plan.sweep_protocol,
        **kw,
    )


def evaluate_run(
    plan: RunPlan,
    exp: Experiment,
    store,
    *,
    progress: bool = False,
    redo: frozenset[str] | set[str] = frozenset(),
) -> dict[str, int]:
    """Every configured evaluation kind of one run, for the identities the store lacks; returns
    ``{"written", "skipped"}``.

    ``redo`` names evaluation kinds (:func:`eval_kinds`) to run again even when stored; their rows
    are replaced (same identities), e.g. to re-measure wall clock.
    """
    import torch

    from looplm.evaluate.kinds import configure_kinds

    job = eval_job(exp, plan, progress=progress)
    written = skipped = 0
    with torch.no_grad():
        for kind in configure_kinds(exp.evaluate):
            ids = kind.identities(job)
            todo = ids if kind.name in redo else [i for i in ids if store.get(**i) is None]
            skipped += len(ids) - len(todo)
            if todo:
                recs = kind.records(job, todo)
                store.put_many(recs)
                written += len(recs)
    return {"written": written, "skipped": skipped}


# ----------------------------------------------------------------------------- driver
def _train_all(exp: Experiment, summary: dict[str, Any], show: bool) -> bool:
    """Train every run (skipping finished ones, each under its cell lock); False when a signal
    interrupted training (an interrupted cell resumes from its checkpoint on the next run)."""
    n = len(exp.runs)
    # finished cells are passed over without their lock: another process may hold it to evaluate;
    # so are cells with no checkpoint whose every evaluation is stored (e.g. imported from a
    # committed export): training them again would only recompute stored rows
    stored = _fully_stored(exp)
    cells = [(i, p) for i, p in enumerate(exp.runs, 1) if not _trained(p) and i not in stored]
    summary["skipped_training"] = summary.get("skipped_training", 0) + n - len(cells)
    return each_cell_locked("train", cells, n, lambda i, p: _train_one(i, n, p, summary, show))


def _fully_stored(exp: Experiment) -> set[int]:
    """Indices (from 1) of the cells without a checkpoint whose every evaluation identity is in
    the store already (said once per cell)."""
    if not exp.store.is_file():
        return set()
    from looplm.evaluate.kinds import configure_kinds
    from looplm.results.store import ResultsStore

    out: set[int] = set()
    with ResultsStore(exp.store) as store:
        for i, plan in enumerate(exp.runs, 1):
            if plan.has_checkpoint:
                continue
            job = eval_job(exp, plan)
            ids = [x for kind in configure_kinds(exp.evaluate) for x in kind.identities(job)]
            if ids and all(store.get(**x) is not None for x in ids):
                _log(f"[train {i}/{len(exp.runs)}] {plan.label}: all {len(ids)} evaluations "
                     "stored, no checkpoint needed")  # fmt: skip
                out.add(i)
    return out


def _trained(plan: RunPlan) -> bool:
    """Whether the cell's checkpoint holds all its training steps."""
    from looplm.model.checkpoint import read_meta

    if not plan.has_checkpoint:
        return False
    return int(read_meta(plan.ckpt)["state"].get("step", 0)) >= plan.cfg.train.steps


def _train_one(i: int, n: int, plan: RunPlan, summary: dict[str, Any], show: bool) -> bool:
    """Train one cell (its lock held); False when a signal interrupted it."""
    t0 = time.perf_counter()
    _log(f"[train {i}/{n}] {plan.label} ({plan.cfg.train.steps} steps) → {plan.run_dir}")
    status = train_run(plan, progress=show)
    dt = time.perf_counter() - t0
    summary["timings"][f"train {plan.label}"] = dt
    _log(f"[train {i}/{n}] {plan.label}: {status} in {dt:.1f} s")
    if status.startswith("interrupted:"):  # the checkpoint is written; rerun to resume
        summary["interrupted"] = int(status.split(":")[1])
        return False
    key = "skipped_training" if status == "skipped" else status
    summary[key] = summary.get(key, 0) + 1
    return True


def _evaluate_all(
    exp: Experiment, summary: dict[str, Any], show: bool, redo: frozenset[str]
) -> None:
    """Evaluate every finished run into the store (what it already holds is skipped), each
    under its cell lock as in training, so two sweep processes split the evaluations; a cell
    the other process is evaluating is left to it (rerun the sweep if that process stopped)."""
    from looplm.results.store import ResultsStore

    n = len(exp.runs)
    cells = [(i, p) for i, p in enumerate(exp.runs, 1) if _evaluable(i, n, p)]
    with ResultsStore(exp.store) as store:

        def one(i: int, plan: RunPlan) -> bool:
            t0 = time.perf_counter()
            _log(f"[eval {i}/{n}] {plan.label} …")
            res = evaluate_run(plan, exp, store, progress=show, redo=redo)
            dt = summary["timings"][f"eval {plan.label}"] = time.perf_counter() - t0
            summary["rows_written"] += res["written"]
            summary["evals_skipped"] += res["skipped"]
            written, skipped = res["written"], res["skipped"]
            _log(
                f"[eval {i}/{n}] {plan.label}: {written} rows written, {skipped} already ({dt:.1f} s)"
            )
            return True

        each_cell_locked("eval", cells, n, one, wait=False)


def _evaluable(i: int, n: int, plan: RunPlan) -> bool:
    """Whether the cell has a finished checkpoint (else say why it is skipped)."""
    from looplm.model.checkpoint import read_meta

    if not plan.has_checkpoint:
        _log(f"[eval {i}/{n}] {plan.label}: no checkpoint, skipped")
        return False
    if not _trained(plan):  # never store results of a half-trained model
        step = int(read_meta(plan.ckpt)["state"].get("step", 0))
        _log(f"[eval {i}/{n}] {plan.label}: checkpoint at step {step} (unfinished), skipped")
        return False
    return True


def run_experiment(
    path: str | os.PathLike,
    *,
    data_dir: str | None = None,
    dry_run: bool = False,
    report: bool = True,
    train: bool = True,
    progress: bool | None = None,
    redo: Sequence[str] = (),
    full: bool = False,
) -> dict[str, Any]:
    """Train, evaluate, store and report an experiment grid (resumable; see module docstring).

    ``redo``: evaluation kinds (``fixed``, ``adaptive``, ``transfer``, ``lambada``, …) to
    recompute even where the store has them (their rows are replaced, never duplicated)."""
    kinds = eval_kinds()
    bad = sorted(set(redo) - set(kinds))
    if bad:
        raise LoopLMError(f"unknown --redo kind {bad[0]!r}; allowed: {', '.join(kinds)}")
    exp = load_experiment(path, data_dir, full=full)
    show = progress_enabled(progress)
    n = len(exp.runs)
    summary: dict[str, Any] = {
        "experiment": exp.name,
        "runs": n,
        "store": str(exp.store),
        "trained": 0,
        "resumed": 0,
        "skipped_training": 0,
        "rows_written": 0,
        "evals_skipped": 0,
        "timings": {},
    }
    if dry_run:
        for i, plan in enumerate(exp.runs, 1):
            done = plan.has_checkpoint
            _log(
                f"[{i}/{n}] {plan.label}: {plan.run_dir} (hash {plan.model_hash}, protocol "
                f"{plan.protocol}){' — checkpoint exists' if done else ''}"
            )
        return summary
    if exp.torch_threads:
        import torch

        torch.set_num_threads(exp.torch_threads)
    t_all = time.perf_counter()
    if train and not _train_all(exp, summary, show):
        return summary
    _evaluate_all(exp, summary, show, frozenset(redo))
    if report:
        summary["report"] = write_experiment_report(exp)
        _log(f"report: {summary['report']['report_md']}")
    summary["wall_s"] = time.perf_counter() - t_all
    return summary


def write_experiment_report(exp: Experiment) -> dict[str, Any]:
    """``looplm report`` on the experiment's store, plus ``supplement.md``."""
    from looplm.results.report import write_report
    from looplm.results.supplement import write_supplement

    rep = exp.report
    if rep.train_depth_max is None:  # the grid's runs say how deep they were trained
        rep = replace(rep, train_depth_max=max(r.cfg.train.depth_max for r in exp.runs))
    res = write_report(exp.store, exp.report_dir, rep)
    sup = write_supplement(exp.store, exp.report_dir)
    return {
        "report_md": str(res.report_md),
        "supplement_md": str(sup["md"]),
        "figures": [str(f) for f in res.figures] + [str(f) for f in sup["figures"]],
        "incomplete": res.incomplete,
    }
