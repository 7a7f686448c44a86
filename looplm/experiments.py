"""Experiments as code: a YAML grid of methods × seeds × training variants × evaluations.

``run_experiment("configs/experiments/wt2_tiny.yaml")`` (CLI: ``looplm sweep CONFIG``) trains every
run of the grid (skipping runs whose checkpoint is complete, resuming interrupted ones), evaluates
each run (skipping evaluations whose identity is already in the results store), then writes the
report (``looplm report``) plus ``supplement.md`` (adaptive-depth runtime, LAMBADA exact-word).
Re-running the same command after an interruption finishes the missing work only.

Config keys (all but ``base``, ``methods`` optional)::

    name: wt2_tiny
    out_root: runs/wt2_tiny            # run folders: <out_root>/[<variant>/]<method>/seed<seed>
    store: runs/wt2_tiny/results.sqlite   # default <out_root>/results.sqlite
    report_dir: runs/wt2_tiny/report       # default <out_root>/report
    data_dir: null                     # corpora folder (default: $LOOPLM_DATA_DIR)
    torch_threads: 1                   # torch.set_num_threads for the whole sweep (null: leave)
    protocol: wt2-tiny                 # protocol identity (default <dataset>-<steps>)
    base: {model: {...}, data: {...}, train: {...}, eval: {...}}   # a RunConfig, as configs/*.yaml
    methods: [scse, looped]           # or {name, recurrence, args, overrides} entries:
      # - {name: looped_alpha, recurrence: looped, args: {learn_gain: true, injection_gain: 0.15}}
    seeds: [0, 1, 2]
    variants:                          # training overrides (key=value); default one unnamed variant
      - {name: "", overrides: []}
    evaluate:
      split: test                      # fixed-depth and adaptive evaluation split
      max_tokens: 4096                 # cap on scored tokens (part of the eval tag)
      depths: 1-48                     # list or "a-b,c" string
      batch_size: 64
      tag: ""
      adaptive:                        # omit to skip
        ceiling: 48
        rules: [maxtoken, kl, router]
        budgets: [8, 16, 24]
        kl_thresholds: [0.1, 0.01, 0.001]
        router_probs: [0.5, 0.7, 0.9]
        label_threshold: 0.01
        calib_split: validation
        calib_max_tokens: 8192
        timing_depths: [8, 16, 24, 48]  # uniform fixed-depth wall clock, for comparison
        timing_repeats: 3              # wall clock = min over repeated passes
        time_dense: true               # per-token rules: also time the no-skipping path
      transfer:                        # held-out corpora, no training on them
        - {dataset: c4, split: train, max_tokens: 4096, depths: [1, 2, 4, 8, 16, 32, 48]}
      lambada: {path: lambada, max_examples: 200, depths: [1, 2, 4, 8, 16, 32, 48]}
    report: {seeds: default, train_depth_max: 8, allow_incomplete: false, reference: scse}

``lambada.path`` is resolved against ``data_dir`` when it is not an existing path.
"""

from __future__ import annotations

import copy
import math
import os
import re
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from looplm.config import UNSHARED, RunConfig, config_from_dict, parse_overrides
from looplm.device import depth_list, progress_enabled
from looplm.errors import LoopLMError

_TOP_KEYS = {
    "name",
    "out_root",
    "store",
    "report_dir",
    "data_dir",
    "torch_threads",
    "protocol",
    "base",
    "methods",
    "seeds",
    "variants",
    "evaluate",
    "report",
}
_EVAL_KEYS = {
    "split",
    "max_tokens",
    "depths",
    "batch_size",
    "tag",
    "adaptive",
    "transfer",
    "lambada",
}
_ADAPTIVE_KEYS = {
    "ceiling",
    "rules",
    "budgets",
    "kl_thresholds",
    "router_probs",
    "label_threshold",
    "calib_split",
    "calib_max_tokens",
    "timing_depths",
    "timing_repeats",
    "time_dense",
    "skip",
}
_TRANSFER_KEYS = {"dataset", "split", "max_tokens", "depths"}
_LAMBADA_KEYS = {"path", "max_examples", "depths", "batch_size"}
_REPORT_KEYS = {"seeds", "train_depth_max", "allow_incomplete", "reference", "n_boot"}


def _check_keys(d: Any, allowed: set[str], where: str) -> dict[str, Any]:
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


_METHOD_KEYS = {"name", "recurrence", "args", "overrides"}


def _method_entry(m: Any, i: int) -> dict[str, Any]:
    """A ``methods`` entry: a recurrence name, or ``{name, recurrence, args, overrides}`` — a
    named method built from a recurrence with its own settings (``args``: recurrence settings;
    ``overrides``: other ``key=value`` config overrides for this method only)."""
    from looplm.model.recurrences import get_recurrence_class

    if isinstance(m, str):
        m = {"name": m}
    m = _check_keys(m, _METHOD_KEYS, f"methods[{i}]")
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
    return {"name": name, "recurrence": rec, "args": args, "overrides": [str(o) for o in overrides]}


def _merge(base: dict[str, Any], upd: dict[str, Any]) -> dict[str, Any]:
    out = copy.deepcopy(base)
    for k, v in upd.items():
        if isinstance(v, dict) and isinstance(out.get(k), dict):
            out[k] = _merge(out[k], v)
        else:
            out[k] = copy.deepcopy(v)
    return out


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
        from looplm.checkpoint import checkpoint_exists

        return checkpoint_exists(self.ckpt)

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
    report: dict[str, Any] = field(default_factory=dict)


def load_experiment(path: str | os.PathLike, data_dir: str | None = None) -> Experiment:
    """Parse and validate an experiment YAML; every run's RunConfig is built (and validated)."""
    from looplm.evaluate.records import model_hash, protocol_name

    p = Path(path)
    if not p.is_file():
        cand = Path(__file__).resolve().parent.parent / "configs" / "experiments" / f"{path}.yaml"
        if not cand.is_file():
            raise LoopLMError(f"experiment config {str(path)!r} not found")
        p = cand
    try:
        raw = yaml.safe_load(p.read_text()) or {}
    except yaml.YAMLError as exc:
        raise LoopLMError(f"experiment config {p}: not valid YAML ({exc})") from None
    raw = _check_keys(raw, _TOP_KEYS, "experiment")
    name = str(raw.get("name") or p.stem)
    out_root = Path(raw.get("out_root") or f"runs/{name}")
    data_dir = data_dir or raw.get("data_dir") or os.environ.get("LOOPLM_DATA_DIR")
    base = raw.get("base")
    if not isinstance(base, dict):
        raise LoopLMError(f"experiment config {p}: 'base' (a RunConfig mapping) is required")
    methods = raw.get("methods")
    if not methods or not isinstance(methods, list):
        raise LoopLMError(f"experiment config {p}: 'methods' must be a non-empty list")
    methods = [_method_entry(m, i) for i, m in enumerate(methods)]
    labels = [m["name"] for m in methods]
    dup = sorted({x for x in labels if labels.count(x) > 1})
    if dup:
        raise LoopLMError(f"experiment config {p}: method name {dup[0]!r} appears twice")
    seeds = raw.get("seeds", [0])
    if not isinstance(seeds, list) or not all(isinstance(s, int) for s in seeds):
        raise LoopLMError(f"experiment config {p}: 'seeds' must be a list of integers")
    variants = raw.get("variants") or [{"name": "", "overrides": []}]
    runs = []
    for i, var in enumerate(variants):
        var = _check_keys(var, {"name", "overrides"}, f"variants[{i}]")
        vname = str(var.get("name") or "")
        overrides = var.get("overrides") or []
        if not isinstance(overrides, list):
            raise LoopLMError(f"variants[{i}].overrides must be a list of key=value strings")
        for entry in methods:
            method = entry["name"]
            for seed in seeds:
                sub = (
                    Path(vname) / method / f"seed{seed}" if vname else Path(method) / f"seed{seed}"
                )
                d = _merge(base, parse_overrides([str(o) for o in overrides]))
                d = _merge(d, parse_overrides(entry["overrides"]))
                d = _merge(
                    d,
                    {
                        "model": {"recurrence": entry["recurrence"]},
                        "train": {"seed": seed},
                        "out_dir": str(out_root / sub),
                        "method": method if method != entry["recurrence"] else "",
                    },
                )
                if entry["args"]:
                    d = _merge(d, {"model": {"recurrence_args": entry["args"]}})
                if data_dir and not d.get("data", {}).get("data_dir"):
                    d = _merge(d, {"data": {"data_dir": str(data_dir)}})
                cfg = config_from_dict(d)
                proto = protocol_name(cfg, raw.get("protocol"))
                if vname:
                    proto = f"{proto}-{vname}"
                runs.append(RunPlan(method, seed, vname, cfg, proto, model_hash(cfg)))
    ev = _check_keys(raw.get("evaluate") or {}, _EVAL_KEYS, "evaluate")
    ev = dict(ev)
    ev["depths"] = depth_list(ev.get("depths", [4, 8, 12, 16, 24, 32, 48]), "evaluate.depths")
    if "adaptive" in ev:
        _check_keys(ev["adaptive"], _ADAPTIVE_KEYS, "evaluate.adaptive")
    for i, t in enumerate(ev.get("transfer") or []):
        _check_keys(t, _TRANSFER_KEYS, f"evaluate.transfer[{i}]")
        if "dataset" not in t:
            raise LoopLMError(f"evaluate.transfer[{i}] needs a dataset")
    if ev.get("lambada"):
        _check_keys(ev["lambada"], _LAMBADA_KEYS, "evaluate.lambada")
        if "path" not in ev["lambada"]:
            raise LoopLMError("evaluate.lambada needs a path (lambada_test.jsonl or its folder)")
    rep = _check_keys(raw.get("report") or {}, _REPORT_KEYS, "report")
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
        report=dict(rep),
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
    from looplm.checkpoint import read_meta
    from looplm.evaluate.records import model_hash
    from looplm.train import fit

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
class _ListSource:
    """A DataSource over precomputed evaluation batches (for ``depth_sweep``)."""

    def __init__(self, batches: list, is_task: bool) -> None:
        self.batches, self.is_task = batches, is_task

    def eval_batches(self, batch_size, max_tokens=None, n_examples=0):
        yield from self.batches


EVAL_KINDS = ("fixed", "adaptive", "transfer", "lambada")


def _missing(store, identities: list[dict[str, Any]], redo: bool = False) -> list[dict[str, Any]]:
    return list(identities) if redo else [i for i in identities if store.get(**i) is None]


def evaluate_run(
    plan: RunPlan,
    exp: Experiment,
    store,
    *,
    progress: bool = False,
    redo: frozenset[str] | set[str] = frozenset(),
) -> dict[str, int]:
    """All evaluations of one run that the store lacks; returns ``{"written", "skipped"}``.

    ``redo`` names evaluation kinds (:data:`EVAL_KINDS`) to run again even when stored; their rows
    are replaced (same identities), e.g. to re-measure wall clock.
    """
    import torch

    from looplm.checkpoint import load_checkpoint
    from looplm.data.synthetic import TASKS
    from looplm.device import resolve_device
    from looplm.evaluate import adaptive as ad
    from looplm.evaluate.records import (
        adaptive_calibration,
        adaptive_records,
        eval_tag,
        fixed_depth_identities,
        fixed_depth_records,
        model_hash,
    )
    from looplm.evaluate.sweep import depth_sweep

    ev = exp.evaluate
    cfg = plan.cfg
    dev = resolve_device(cfg.train.device)
    bs = int(ev.get("batch_size") or cfg.eval.batch_size)
    split = ev.get("split", "test")
    cap = ev.get("max_tokens")
    tag = eval_tag(ev.get("tag", ""), max_tokens=cap)
    written = skipped = 0
    model = None
    extra = {"checkpoint": str(plan.ckpt)}

    def load():
        nonlocal model
        if model is None:
            model, saved, meta = load_checkpoint(plan.ckpt, map_location=dev)
            if model_hash(saved) != plan.model_hash:
                raise LoopLMError(f"{plan.ckpt}: config hash changed since training")
            extra["step"] = meta["state"].get("step")
        return model

    def fixed(dataset: str, sp: str, depths: list[int], max_tokens, tg: str, kind: str) -> None:
        nonlocal written, skipped
        ids = fixed_depth_identities(
            cfg, depths, dataset=dataset, split=sp, tag=tg, protocol=plan.protocol
        )
        todo = sorted(i["depth"] for i in _missing(store, ids, kind in redo))
        skipped += len(depths) - len(todo)
        if not todo:
            return
        m = load()
        data = ad.evaluation_batches(cfg, sp, max_tokens, bs, dataset)
        rows = depth_sweep(
            m,
            _ListSource(data, dataset in TASKS),
            todo,
            batch_size=bs,
            device=dev,
            progress=progress,
        )
        recs = fixed_depth_records(
            rows, cfg, dataset=dataset, split=sp, tag=tg, protocol=plan.protocol, extra=extra
        )
        store.put_many(recs)
        written += len(recs)

    with torch.no_grad():
        # 1. fixed-depth sweep on the training corpus
        fixed(cfg.data.dataset, split, ev["depths"], cap, tag, "fixed")
        # 2. adaptive depth (shared-block models only)
        a = ev.get("adaptive")
        if a is not None and cfg.model.is_looped:
            rules = a.get("rules", list(ad.RULES))
            kw = {
                "ceiling": int(a.get("ceiling", ad.DEFAULT_CEILING)),
                "budgets": a.get("budgets", list(ad.DEFAULT_BUDGETS)),
                "kl_thresholds": a.get("kl_thresholds", list(ad.DEFAULT_KL_THRESHOLDS)),
                "router_probs": a.get("router_probs", list(ad.DEFAULT_ROUTER_PROBS)),
            }
            label = float(a.get("label_threshold", ad.DEFAULT_LABEL_THRESHOLD))
            calib_split = a.get("calib_split", "validation")
            calib_cap = a.get("calib_max_tokens")
            modes = ad.adaptive_modes(rules, kw["budgets"], kw["kl_thresholds"], kw["router_probs"])
            want = set()
            for rule, ms in modes.items():
                cal = adaptive_calibration(rule, calib_split, calib_cap, label)
                for mode in ms:
                    ident = {
                        **fixed_depth_identities(
                            cfg,
                            [kw["ceiling"]],
                            dataset=cfg.data.dataset,
                            split=split,
                            tag=tag,
                            protocol=plan.protocol,
                        )[0],
                        "adaptive_mode": mode,
                        "calibration": cal,
                    }
                    if "adaptive" in redo or store.get(**ident) is None:
                        want.add(mode)
                    else:
                        skipped += 1
            if want:
                res = ad.evaluate_adaptive(
                    load(),
                    cfg,
                    rules=rules,
                    label_threshold=label,
                    split=split,
                    calib_split=calib_split,
                    max_tokens=cap,
                    calib_max_tokens=calib_cap,
                    batch_size=bs,
                    skip=bool(a.get("skip", True)),
                    timing_depths=a.get("timing_depths", []),
                    timing_repeats=int(a.get("timing_repeats", 1)),
                    time_dense=bool(a.get("time_dense", False)),
                    device=dev,
                    progress=progress,
                    want=want,
                    **kw,
                )
                recs = adaptive_records(res, cfg, tag=tag, protocol=plan.protocol, extra=extra)
                store.put_many(recs)
                written += len(recs)
        # 3. held-out transfer
        for t in ev.get("transfer") or []:
            tcap = t.get("max_tokens", cap)
            fixed(
                t["dataset"],
                t.get("split", "test"),
                depth_list(t.get("depths", ev["depths"]), "transfer.depths"),
                tcap,
                eval_tag(ev.get("tag", ""), max_tokens=tcap),
                "transfer",
            )
        # 4. LAMBADA
        lam = ev.get("lambada")
        if lam:
            from looplm.data.corpora import lambada_examples
            from looplm.data.tokenizers import get_tokenizer
            from looplm.evaluate.completion import lambada_items, lambada_sweep

            n_ex = lam.get("max_examples")
            ltag = eval_tag(ev.get("tag", ""), max_examples=n_ex)
            depths = depth_list(lam.get("depths", ev["depths"]), "lambada.depths")
            ids = fixed_depth_identities(
                cfg, depths, dataset="lambada", split="test", tag=ltag, protocol=plan.protocol
            )
            todo = sorted(i["depth"] for i in _missing(store, ids, "lambada" in redo))
            skipped += len(depths) - len(todo)
            if todo:
                path = Path(lam["path"])
                if not path.exists() and exp.data_dir:
                    path = Path(exp.data_dir) / lam["path"]
                items = lambada_items(
                    lambada_examples(path)[:n_ex],
                    get_tokenizer(cfg.model.tokenizer),
                    cfg.model.context,
                )
                rows = lambada_sweep(
                    load(),
                    items,
                    todo,
                    batch_size=int(lam.get("batch_size", bs)),
                    device=dev,
                    progress=progress,
                )
                recs = fixed_depth_records(
                    rows,
                    cfg,
                    dataset="lambada",
                    split="test",
                    tag=ltag,
                    protocol=plan.protocol,
                    extra=extra,
                )
                store.put_many(recs)
                written += len(recs)
    return {"written": written, "skipped": skipped}


# ----------------------------------------------------------------------------- driver
def run_experiment(
    path: str | os.PathLike,
    *,
    data_dir: str | None = None,
    dry_run: bool = False,
    report: bool = True,
    train: bool = True,
    progress: bool | None = None,
    redo: Sequence[str] = (),
) -> dict[str, Any]:
    """Train, evaluate, store and report an experiment grid (resumable; see module docstring).

    ``redo``: evaluation kinds (``fixed``, ``adaptive``, ``transfer``, ``lambada``) to recompute
    even where the store has them (their rows are replaced, never duplicated)."""
    from looplm.checkpoint import read_meta
    from looplm.results.store import ResultsStore

    bad = sorted(set(redo) - set(EVAL_KINDS))
    if bad:
        raise LoopLMError(f"unknown --redo kind {bad[0]!r}; allowed: {', '.join(EVAL_KINDS)}")
    exp = load_experiment(path, data_dir)
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
    if train:
        for i, plan in enumerate(exp.runs, 1):
            t0 = time.perf_counter()
            _log(f"[train {i}/{n}] {plan.label} ({plan.cfg.train.steps} steps) → {plan.run_dir}")
            status = train_run(plan, progress=show)
            dt = time.perf_counter() - t0
            summary["timings"][f"train {plan.label}"] = dt
            _log(f"[train {i}/{n}] {plan.label}: {status} in {dt:.1f} s")
            if status.startswith("interrupted:"):  # the checkpoint is written; rerun to resume
                summary["interrupted"] = int(status.split(":")[1])
                return summary
            key = "skipped_training" if status == "skipped" else status
            summary[key] = summary.get(key, 0) + 1
    with ResultsStore(exp.store) as store:
        for i, plan in enumerate(exp.runs, 1):
            if not plan.has_checkpoint:
                _log(f"[eval {i}/{n}] {plan.label}: no checkpoint, skipped")
                continue
            step = int(read_meta(plan.ckpt)["state"].get("step", 0))
            if step < plan.cfg.train.steps:  # never store results of a half-trained model
                _log(
                    f"[eval {i}/{n}] {plan.label}: checkpoint at step {step} of "
                    f"{plan.cfg.train.steps} (unfinished), skipped"
                )
                continue
            t0 = time.perf_counter()
            _log(f"[eval {i}/{n}] {plan.label} …")
            res = evaluate_run(plan, exp, store, progress=show, redo=frozenset(redo))
            dt = time.perf_counter() - t0
            summary["timings"][f"eval {plan.label}"] = dt
            summary["rows_written"] += res["written"]
            summary["evals_skipped"] += res["skipped"]
            _log(
                f"[eval {i}/{n}] {plan.label}: {res['written']} rows written, "
                f"{res['skipped']} already in the store ({dt:.1f} s)"
            )
    if report:
        summary["report"] = write_experiment_report(exp)
        _log(f"report: {summary['report']['report_md']}")
    summary["wall_s"] = time.perf_counter() - t_all
    return summary


def write_experiment_report(exp: Experiment) -> dict[str, Any]:
    """``looplm report`` on the experiment's store, plus ``supplement.md``."""
    from looplm.results.report import write_report

    rep = exp.report
    depth_max = rep.get("train_depth_max") or max(r.cfg.train.depth_max for r in exp.runs)
    res = write_report(
        exp.store,
        exp.report_dir,
        reference=rep.get("reference", "scse"),
        seeds=rep.get("seeds", "auto"),
        train_depth_max=int(depth_max),
        allow_incomplete=bool(rep.get("allow_incomplete", False)),
        n_boot=int(rep.get("n_boot", 10_000)),
    )
    sup = write_supplement(exp.store, exp.report_dir)
    return {
        "report_md": str(res.report_md),
        "supplement_md": str(sup["md"]),
        "figures": [str(f) for f in res.figures] + [str(f) for f in sup["figures"]],
        "incomplete": res.incomplete,
    }


# ----------------------------------------------------------------------------- supplement
def _mean_std(vals: list[float]) -> tuple[float, float]:
    import numpy as np

    a = np.asarray([v for v in vals if v is not None and math.isfinite(v)], dtype=float)
    if a.size == 0:
        return math.nan, math.nan
    return float(a.mean()), float(a.std(ddof=1)) if a.size > 1 else math.nan


def _fmt(m: float, s: float, d: int = 2) -> str:
    if not math.isfinite(m):
        return "–"
    return f"{m:.{d}f}" + (f" ± {s:.{d}f}" if math.isfinite(s) else "")


def _uniform_ppl_at(fixed: dict[int, float], depth: float) -> float:
    """Uniform-depth PPL at a fractional depth: linear interpolation of log PPL between the
    evaluated depths (NaN outside their range)."""
    import numpy as np

    ds = sorted(fixed)
    if not ds or not ds[0] <= depth <= ds[-1]:
        return math.nan
    return float(np.exp(np.interp(depth, ds, [math.log(fixed[d]) for d in ds])))


def write_supplement(store_path: str | os.PathLike, out_dir: str | os.PathLike) -> dict[str, Any]:
    """``supplement.md`` + figures: what the main report does not tabulate — per adaptive rule the
    achieved depth vs target, quality relative to uniform depth at the same average depth (paired
    by seed), the FLOP proxy and measured wall clock (with and without work skipping, and uniform
    fixed-depth timings), router fit statistics, and LAMBADA exact-word accuracy. Reads the store
    file only."""
    from looplm.io import atomic_write_text
    from looplm.results.store import group_by, load_records

    out = Path(out_dir)
    recs = load_records(store_path)
    md = [
        "# Supplement: adaptive-depth quality, runtime and LAMBADA exact-word accuracy",
        "",
        f"Source: `{store_path}`. Values are mean ± sample std over seeds (std omitted for one "
        "seed). Wall clock is measured on the evaluation machine, summed over the capped "
        "evaluation set (the minimum over the configured timing repeats); on a shared machine it "
        "is noisy.",
        "",
    ]
    figures: list[Path] = []
    adaptive = [r for r in recs if r.adaptive_mode]
    fixed_all = [r for r in recs if not r.adaptive_mode and not r.calibration]
    ctx_fields = ("protocol", "dataset", "split", "eval_tag")
    for key, crecs in sorted(group_by(adaptive, ctx_fields + ("depth",)).items()):
        proto, ds, sp, tg, ceiling = key
        # uniform-depth PPL per (method, model_hash, seed) in the same context
        uni_ppl: dict[tuple, dict[int, float]] = {}
        for r in fixed_all:
            if (r.protocol, r.dataset, r.split, r.eval_tag) == key[:4]:
                uni_ppl.setdefault((r.method, r.model_hash, r.seed), {})[r.depth] = r.ppl
        # uniform wall clock per (method, seed): from the latest adaptive record of that seed
        latest: dict[tuple, Any] = {}
        for r in crecs:
            k = (r.method, r.seed)
            if r.extra.get("uniform_wall_clock_s") and (
                k not in latest or (r.updated_at or "") > (latest[k].updated_at or "")
            ):
                latest[k] = r
        uni_wall: dict[str, dict[int, list[float]]] = {}
        for (m, _seed), r in sorted(latest.items()):
            for T, v in r.extra["uniform_wall_clock_s"].items():
                uni_wall.setdefault(m, {}).setdefault(int(T), []).append(float(v))
        md += [
            f"## Adaptive depth — {ds} / {sp}, protocol `{proto}`"
            + (f", tag `{tg}`" if tg else "")
            + f", ceiling {ceiling}",
            "",
            "| Method | mode | target | achieved mean depth | PPL | Δ vs uniform % "
            "| body FLOPs/token | wall s | wall s, no skipping | seeds |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|",
        ]
        rel_pts: dict[tuple[str, str], list[tuple[float, float, float, float]]] = {}
        wall_pts: dict[tuple[str, str], list[tuple[float, float]]] = {}
        dense_pts: dict[tuple[str, str], list[tuple[float, float]]] = {}
        rows = []
        for (method, mode), cell in group_by(crecs, ("method", "adaptive_mode")).items():
            depth = _mean_std([r.extra.get("mean_depth") for r in cell])
            rows.append((method, mode.split(":")[0], depth[0], mode, cell))
        for method, fam, _d, mode, cell in sorted(rows):
            depth = _mean_std([r.extra.get("mean_depth") for r in cell])
            ppl = _mean_std([r.ppl for r in cell])
            rel = []
            for r in cell:
                u = _uniform_ppl_at(
                    uni_ppl.get((r.method, r.model_hash, r.seed), {}), r.extra["mean_depth"]
                )
                rel.append(100.0 * (r.ppl / u - 1.0) if math.isfinite(u) else math.nan)
            relm = _mean_std(rel)
            fl, _ = _mean_std([r.extra.get("flops_per_token_body") for r in cell])
            wall = _mean_std([r.extra.get("wall_clock_s") for r in cell])
            dense = _mean_std([r.extra.get("wall_clock_dense_s") for r in cell])
            target = cell[0].extra.get("target")
            md.append(
                f"| {method} | `{mode}` | {f'{target:g}' if target else '–'} | "
                f"{_fmt(*depth)} | {_fmt(*ppl)} | {_fmt(*relm)} | {fl:.3g} | {_fmt(*wall)} | "
                f"{_fmt(*dense)} | {len(cell)} |"
            )
            rel_pts.setdefault((method, fam), []).append((depth[0], depth[1], *relm))
            wall_pts.setdefault((method, fam), []).append((depth[0], wall[0]))
            if math.isfinite(dense[0]):
                dense_pts.setdefault((method, fam), []).append((depth[0], dense[0]))
        md += [
            "",
            "*target*: calibrated mean budget (max-token rule, calibrated on validation). "
            "*achieved*: mean active loops per scored token on this split. *Δ vs uniform*: PPL "
            "relative to the same seed's uniform-depth PPL at the same (fractional) average depth, "
            "log-linearly interpolated between evaluated depths; negative = better than spending "
            "the same average depth uniformly. *body FLOPs/token*: Eq. 20 proxy at the achieved "
            "depth (idealised: the per-token rules still compute keys/values of halted tokens). "
            "*no skipping*: the per-token rule run with the dense block on every token.",
            "",
        ]
        if uni_wall:
            md += [
                "Uniform fixed-depth wall clock on the same tokens (s, mean over seeds): "
                + "; ".join(
                    f"{m}: "
                    + ", ".join(f"T={T} {sum(v) / len(v):.2f}" for T, v in sorted(d.items()))
                    for m, d in sorted(uni_wall.items())
                ),
                "",
            ]
        routers = [r for r in crecs if r.adaptive_mode.startswith("router") and "router" in r.extra]
        if routers:
            md += [
                "Router fit (validation, per seed): "
                + "; ".join(
                    sorted(
                        {
                            f"{r.method} s{r.seed}: positives "
                            f"{r.extra['router']['positive_rate']:.3f}, train acc "
                            f"{r.extra['router']['train_accuracy']:.3f} (majority "
                            f"{r.extra['router']['majority_accuracy']:.3f})"
                            for r in routers
                        }
                    )
                ),
                "",
            ]
        slug = _slug(ds, sp, proto, tg)
        fig = _plot_relative(
            rel_pts,
            out / "figures" / f"adaptive_vs_uniform_{slug}.png",
            f"{ds} / {sp}, ceiling {ceiling}",
        )
        if fig:
            figures.append(fig)
            md += [
                f"![adaptive quality relative to uniform depth](figures/{fig.name})",
                "",
                "*PPL of each adaptive rule relative to uniform depth at the same average depth "
                "(paired by seed; mean ± std over seeds, x error bars: std of the achieved "
                "depth). Below 0: the rule beats uniform depth at equal average compute.*",
                "",
            ]
        fig = _plot_wallclock(
            wall_pts,
            dense_pts,
            uni_wall,
            out / "figures" / f"adaptive_wallclock_{slug}.png",
            f"{ds} / {sp}, ceiling {ceiling}",
        )
        if fig:
            figures.append(fig)
            md += [
                f"![wall clock vs achieved depth](figures/{fig.name})",
                "",
                "*Measured wall clock (s, whole capped split, mean over seeds) vs achieved mean "
                "depth; dashed: uniform fixed depth; filled markers: adaptive rules; hollow "
                "markers, dotted: the per-token rules without work skipping.*",
                "",
            ]
    lam = [r for r in recs if r.dataset == "lambada" and not r.adaptive_mode]
    for (proto, tg), lrecs in sorted(group_by(lam, ("protocol", "eval_tag")).items()):
        md += [
            f"## LAMBADA — protocol `{proto}`" + (f", tag `{tg}`" if tg else ""),
            "",
            "| Method | T | completion PPL | target-token acc % | exact last-word acc % | seeds |",
            "|---|---:|---:|---:|---:|---:|",
        ]
        for (method, T), cell in sorted(group_by(lrecs, ("method", "depth")).items()):
            p = _mean_std([r.ppl for r in cell])
            a = _mean_std([100 * r.extra["n_correct"] / r.extra["n_examples"] for r in cell])
            e = _mean_std(
                [100 * r.extra["exact_word_correct"] / r.extra["n_passages"] for r in cell]
            )
            md.append(f"| {method} | {T} | {_fmt(*p, 1)} | {_fmt(*a)} | {_fmt(*e)} | {len(cell)} |")
        md += [
            "",
            "Completion PPL and target-token accuracy over the target word's tokens "
            "(teacher-forced); exact last-word = greedy decoding reproduces every target token.",
            "",
        ]
    path = out / "supplement.md"
    atomic_write_text(path, "\n".join(md) + "\n")
    return {"md": path, "figures": figures}


def _slug(*parts: Any) -> str:
    import re

    text = "_".join(str(p) for p in parts if p not in ("", None))
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "all"


_MARKERS = {"maxtoken": "s", "kl": "^", "router": "D"}


def _figure(figsize: tuple[float, float]):
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt, *plt.subplots(figsize=figsize, layout="constrained")


def _save(plt, fig, path: Path) -> Path:
    import io

    from looplm.io import atomic_write_bytes

    buf = io.BytesIO()
    fig.savefig(buf, format="png", dpi=130)
    plt.close(fig)
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_bytes(path, buf.getvalue())
    return path


def _plot_relative(
    points: dict[tuple[str, str], list[tuple[float, float, float, float]]],
    path: Path,
    title: str,
) -> Path | None:
    """ΔPPL % vs uniform depth at equal average depth, per (method, rule)."""
    pts = {
        k: sorted(p for p in v if math.isfinite(p[0]) and math.isfinite(p[2]))
        for k, v in points.items()
    }
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return None
    plt, fig, ax = _figure((7.8, 4.2))
    methods = sorted({m for m, _ in pts})
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    ax.axhline(0.0, color="0.3", lw=1.0, ls="--", label="uniform depth (reference)")
    for (m, fam), v in sorted(pts.items()):
        ax.errorbar(
            [p[0] for p in v],
            [p[2] for p in v],
            xerr=[p[1] if math.isfinite(p[1]) else 0.0 for p in v],
            yerr=[p[3] if math.isfinite(p[3]) else 0.0 for p in v],
            color=color[m],
            marker=_MARKERS.get(fam, "x"),
            ms=6,
            lw=1.4,
            capsize=2,
            elinewidth=0.8,
            label=f"{m} {fam}",
        )
    ax.set_xscale("log", base=2)
    from matplotlib.ticker import FixedLocator, FuncFormatter, NullLocator

    lo = min(p[0] for v in pts.values() for p in v)
    hi = max(p[0] for v in pts.values() for p in v)
    ticks = [t for t in (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 64, 96) if lo / 1.3 <= t <= hi * 1.3]
    ax.xaxis.set_major_locator(FixedLocator(ticks))
    ax.xaxis.set_major_formatter(FuncFormatter(lambda v, _p: f"{v:g}"))
    ax.xaxis.set_minor_locator(NullLocator())
    ax.set_xlim(lo / 1.3, hi * 1.3)
    ax.set_xlabel("achieved average active depth (loops per token, log2 axis)")
    ax.set_ylabel("PPL vs uniform depth at equal average depth (%)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    return _save(plt, fig, path)


def _plot_wallclock(
    points: dict[tuple[str, str], list[tuple[float, float]]],
    dense: dict[tuple[str, str], list[tuple[float, float]]],
    uniform: dict[str, dict[int, list[float]]],
    path: Path,
    title: str,
) -> Path | None:
    """Measured wall clock vs achieved mean depth, adaptive rules and uniform depth."""
    pts = {
        k: sorted(p for p in v if math.isfinite(p[0]) and math.isfinite(p[1]))
        for k, v in points.items()
    }
    pts = {k: v for k, v in pts.items() if v}
    if not pts:
        return None
    plt, fig, ax = _figure((7.6, 4.2))
    methods = sorted({m for m, _ in pts} | set(uniform))
    color = {m: f"C{i % 10}" for i, m in enumerate(methods)}
    for m, d in sorted(uniform.items()):
        ts = sorted(d)
        ax.plot(
            ts,
            [sum(d[t]) / len(d[t]) for t in ts],
            color=color[m],
            ls="--",
            marker="o",
            ms=3,
            lw=1.1,
            label=f"{m} uniform depth",
        )
    for (m, fam), v in sorted(pts.items()):
        ax.plot(
            [p[0] for p in v],
            [p[1] for p in v],
            color=color[m],
            marker=_MARKERS.get(fam, "x"),
            ms=6,
            lw=1.4,
            label=f"{m} {fam}",
        )
    for (m, fam), v in sorted(dense.items()):
        v = sorted(p for p in v if math.isfinite(p[0]) and math.isfinite(p[1]))
        if v and m in color:
            ax.plot(
                [p[0] for p in v],
                [p[1] for p in v],
                color=color[m],
                ls=":",
                lw=1.0,
                marker=_MARKERS.get(fam, "x"),
                ms=5,
                mfc="none",
                label=f"{m} {fam}, no skipping",
            )
    ax.set_xlabel("achieved mean active depth (loops per token)")
    ax.set_ylabel("measured wall clock (s)")
    ax.set_title(title, fontsize=10)
    ax.grid(True, color="0.9", lw=0.6)
    ax.set_ylim(bottom=0)
    fig.legend(fontsize=7, frameon=False, loc="outside right upper")
    return _save(plt, fig, path)
