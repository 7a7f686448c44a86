"""What each paper entry costs (Eq. 20-21 FLOPs at a CPU and an H200 rate) and where its grid
stands (finished checkpoints, stored evaluations); the catalogue table."""

from __future__ import annotations

import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from looplm.experiments.paper.entries import (
    CPU_FLOPS,
    H200_MFU,
    H200_PEAK,
    SPLIT_TOKENS,
    _default_data_dir,
    catalogue,
)
from looplm.settings import load_yaml


def _eval_tokens(cap: int | None, dataset: str) -> int:
    return int(cap) if cap else SPLIT_TOKENS.get(dataset, 280_000)


def run_flops(plan: Any, evaluate: dict[str, Any]) -> dict[str, float]:
    """Training and evaluation FLOPs (Eq. 20–21 proxy) of one run of a grid."""
    from looplm.model.accounting import model_flops

    cfg = plan.cfg
    t = cfg.train
    m = cfg.model
    mean_depth = (t.depth_min + t.depth_max) / 2
    tokens = t.steps * t.batch_size * t.grad_accum * m.context
    train = 3.0 * tokens * model_flops(m, mean_depth)["body_head"]
    dataset = cfg.data.dataset
    n = _eval_tokens(evaluate.get("max_tokens"), dataset)
    ev = sum(n * model_flops(m, d)["body_head"] for d in evaluate.get("depths", []))
    if m.is_looped and evaluate.get("adaptive"):
        a = evaluate["adaptive"]
        ceiling = int(a.get("ceiling", 48))
        calib = _eval_tokens(a.get("calib_max_tokens"), dataset)
        ev += (n + calib) * model_flops(m, ceiling)["body_head"]
    for tr in evaluate.get("transfer") or []:
        k = _eval_tokens(tr.get("max_tokens"), tr["dataset"])
        ev += sum(k * model_flops(m, d)["body_head"] for d in tr.get("depths") or [8])
    return {"train": train, "eval": ev}


def _step_rate(metrics: Path) -> tuple[int, float]:
    """(steps, seconds) between consecutive logged lines of one training process (a resumed
    run restarts its clock: pairs whose elapsed time does not grow are left out)."""
    steps, secs = 0, 0.0
    prev = None
    for line in metrics.read_text().splitlines():
        try:
            rec = json.loads(line)
        except json.JSONDecodeError:
            continue
        if "elapsed_s" not in rec or "step" not in rec:
            continue
        if prev and rec["elapsed_s"] > prev["elapsed_s"] and rec["step"] > prev["step"]:
            steps += int(rec["step"]) - int(prev["step"])
            secs += float(rec["elapsed_s"]) - float(prev["elapsed_s"])
        prev = rec
    return steps, secs


def measured_cpu_rate(out_roots: list[Path]) -> float | None:
    """FLOP/s of the Eq. 20–21 training proxy measured from the logged steps of CPU runs under
    ``out_roots`` (``metrics.jsonl``), or None when none has logged two lines yet."""
    from looplm.model.accounting import model_flops
    from looplm.settings.config import config_from_dict

    flops = secs = 0.0
    for root in out_roots:
        for cfg_path in sorted(root.glob("**/config.yaml")):
            metrics = cfg_path.parent / "metrics.jsonl"
            if not metrics.is_file():
                continue
            cfg = config_from_dict(load_yaml(cfg_path.read_text()))
            if cfg.train.device != "cpu":
                continue
            n, dt = _step_rate(metrics)
            t, m = cfg.train, cfg.model
            per_tok = 3.0 * model_flops(m, (t.depth_min + t.depth_max) / 2)["body_head"]
            flops += per_tok * n * t.batch_size * t.grad_accum * m.context
            secs += dt
    return flops / secs if secs > 0 else None


@dataclass
class Cost:
    runs: int
    train_flops: float
    eval_flops: float

    @property
    def flops(self) -> float:
        return self.train_flops + self.eval_flops

    def hours(self, rate: float) -> float:
        return self.flops / rate / 3600.0


def grid_cost(exp: Any) -> Cost:
    """FLOPs of every run of an experiment (training + its evaluations)."""
    train = ev = 0.0
    for plan in exp.runs:
        f = run_flops(plan, exp.evaluate)
        train += f["train"]
        ev += f["eval"]
    return Cost(len(exp.runs), train, ev)


# ----------------------------------------------------------------------------- status
def grid_status(exp: Any) -> dict[str, Any]:
    """How far an experiment's grid is: finished checkpoints and stored evaluations."""
    from looplm.evaluate.kinds import configure_kinds
    from looplm.experiments.runner import eval_job
    from looplm.model.checkpoint import read_meta
    from looplm.results.store import ResultsStore

    kinds = configure_kinds(exp.evaluate)
    trained = rows = wanted = 0
    have: set[tuple] = set()
    if exp.store.is_file():
        with ResultsStore(exp.store) as store:
            have = {r.identity() for r in store.query()}
    from looplm.results.store import EvalRecord

    started = False
    for plan in exp.runs:
        done = False
        log = plan.run_dir / "metrics.jsonl"
        started = started or (log.is_file() and log.stat().st_size > 0)  # training has begun
        if plan.has_checkpoint:
            started = True
            step = int(read_meta(plan.ckpt)["state"].get("step", 0))
            done = step >= plan.cfg.train.steps
        trained += done
        job = eval_job(exp, plan, device="cpu")
        for kind in kinds:
            for ident in kind.identities(job):
                wanted += 1
                rows += EvalRecord(**ident).identity() in have
    n = len(exp.runs)
    if not started and rows == 0:
        state = "not run"
    elif trained == n and rows == wanted:
        state = "done"
    else:
        state = "partial"
    return {"state": state, "trained": trained, "runs": n, "rows": rows, "rows_wanted": wanted}


def corpus_present(name: str, data_dir: str | None) -> bool:
    """Whether the shared data folder holds corpus ``name`` (its training split for WikiText)."""
    from looplm.data.cache import SHARED_FOLDERS

    if not data_dir:
        return False
    folder = Path(data_dir) / SHARED_FOLDERS.get(name, name)
    if name.startswith("wikitext"):
        return any(folder.glob("wiki.train.*"))
    return folder.is_dir() and any(folder.iterdir())


def catalogue_rows(
    config_dir: str | os.PathLike | None = None, data_dir: str | None = None
) -> list[dict[str, Any]]:
    """One row per entry: config, needs, estimated cost (CPU / H200), status (CPU / full)."""
    data_dir = data_dir or _default_data_dir()
    entries = catalogue(config_dir)
    roots = set()
    exps: dict[tuple[str, bool], Any] = {}
    for e in entries:
        if e.is_experiment:
            for full in (False, True):
                exps[(e.id, full)] = e.experiment(full=full, data_dir=data_dir)
            roots.add(exps[(e.id, False)].out_root)
    measured = measured_cpu_rate(sorted(roots))
    cpu_rate = max(measured or 0.0, CPU_FLOPS)  # a loaded machine logs slower rates
    out = []
    for e in entries:
        row: dict[str, Any] = {
            "id": e.id,
            "title": e.title,
            "config": str(e.path),
            "reuses": e.meta.get("reuses"),
            "gpu_only": bool(e.meta.get("gpu_only", False)),
            "claim": e.meta.get("claim", ""),
            "n_reported": len(e.reported),
        }
        if not e.is_experiment:
            row.update(status_cpu="nothing to run", status_full="nothing to run")
            out.append(row)
            continue
        cpu, full = exps[(e.id, False)], exps[(e.id, True)]
        cpu_needs = sorted({p.cfg.data.dataset for p in cpu.runs})
        full_needs = sorted({p.cfg.data.dataset for p in full.runs} | set(e.meta.get("needs", [])))
        c_cpu, c_full = grid_cost(cpu), grid_cost(full)
        row.update(
            needs_cpu={n: corpus_present(n, data_dir) for n in cpu_needs},
            needs_full={n: corpus_present(n, data_dir) for n in full_needs},
            runs_cpu=c_cpu.runs,
            runs_full=c_full.runs,
            cpu_hours=c_cpu.hours(cpu_rate),
            full_cpu_hours=c_full.hours(cpu_rate),
            full_h200_hours=c_full.hours(H200_PEAK * H200_MFU),
            cpu_rate=cpu_rate,
            cpu_rate_measured=measured is not None and measured > CPU_FLOPS,
            status_cpu=grid_status(cpu),
            status_full=grid_status(full),
        )
        out.append(row)
    return out


def _hours(h: float) -> str:
    if h < 1 / 60:
        return f"{h * 3600:.0f} s"
    if h < 1:
        return f"{h * 60:.0f} min"
    if h < 48:
        return f"{h:.1f} h"
    return f"{h / 24:.0f} d"


def _status(s: Any) -> str:
    if isinstance(s, str):
        return s
    return f"{s['state']} ({s['trained']}/{s['runs']} runs, {s['rows']}/{s['rows_wanted']} rows)"


def format_catalogue(rows: list[dict[str, Any]]) -> str:
    """The catalogue as a Markdown table."""
    lines = [
        "| entry | title | needs (CPU; full) | runs CPU / full | CPU analogue on the CPU | "
        "full on the CPU | full on one H200 | status CPU | status full |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if "runs_cpu" not in r:
            lines.append(
                f"| {r['id']} | {r['title']} | – | – | – | – | – | {r['status_cpu']} | – |"
            )
            continue

        def needs(d: dict[str, bool]) -> str:
            return ", ".join(n + ("" if ok else " (missing)") for n, ok in d.items())

        gpu = " (GPU measurement)" if r["gpu_only"] else ""
        lines.append(
            f"| {r['id']} | {r['title']}{gpu} | {needs(r['needs_cpu'])}; "
            f"{needs(r['needs_full'])} | {r['runs_cpu']} / {r['runs_full']} | "
            f"{_hours(r['cpu_hours'])} | {_hours(r['full_cpu_hours'])} | "
            f"{_hours(r['full_h200_hours'])} | {_status(r['status_cpu'])} | "
            f"{_status(r['status_full'])} |"
        )
    rate = next((r for r in rows if "cpu_rate" in r), None)
    if rate:
        how = (
            "logged by the paper grids' runs on this machine"
            if rate["cpu_rate_measured"]
            else "CPU time of one float32 training step on one thread"
        )
        lines.append("")
        lines.append(
            f"Costs: Eq. 20-21 FLOPs (training 3x at the mean sampled depth, evaluation at each "
            f"depth) at {rate['cpu_rate'] / 1e9:.1f} GFLOP/s on the CPU ({how}) and at "
            f"{H200_MFU:.0%} of an H200's {H200_PEAK / 1e12:.0f} bf16 TFLOP/s (assumed, not "
            "measured). A table that reuses a shared grid lists that grid's runs it reads: they "
            "are trained once."
        )
    return "\n".join(lines)
