"""The embedded demo: train tiny looped models on nested boolean logic, sweep depth, report.

No download: the task is generated on the fly. For each method the demo trains a tiny byte-level
model (loop depth sampled from 1–8), evaluates one set of weights at T ∈ {1, 2, 4, 8, …, 48} on
fresh expressions of the training difficulty (1–3; that space is small, so most of them also occur
in the training stream) and on harder ones (4–5, none seen in training), measures the forcing bias ``b_t(e) = T_t(0; e)`` at the anchor, and writes
``report.md``, ``results.json`` and ``depth_response.png``.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch

from looplm.data.sources import make_source
from looplm.evaluate.sweep import depth_sweep
from looplm.io import atomic_write_json, atomic_write_text
from looplm.settings.config import load_config
from looplm.signals import Interrupted, raise_if_stopped, stop_on_signals

DEPTHS = [1, 2, 4, 8, 12, 16, 24, 32, 48]
DEFAULT_METHODS = ["scse", "looped", "tuned_adapter"]
TASK_TITLES = {
    "bool_logic": "nested boolean logic",
    "graph_reach": "graph reachability",
    "relational_text": "relational reasoning in text",
}
HARDER = (4, 5)  # evaluation difficulty beyond the training range 1–3
TEST_DEPTH = 8  # depth at which "above chance" is tested (fixed in advance, not the best depth)
# (steps, eval examples); measured times: benchmarks/RESULTS.md, "Documented run times".
BUDGETS = {"default": (500, 1024), "quick": (150, 256)}


@torch.no_grad()
def forcing_bias(model: torch.nn.Module, x: torch.Tensor, steps: int = 48) -> dict[str, float]:
    """max_t ‖b_t(e)‖_F / ‖h*‖_F and max |b_t| over t < ``steps``, b_t = step(h*) − h*."""
    if not getattr(model, "is_looped", False):
        return {"max_abs": float("nan"), "max_rel": float("nan")}
    model.eval()
    out = model(x, loops=1, return_states=True)
    max_abs = max_rel = 0.0
    for t in range(steps):
        b = model.step(out.anchor, out.context, t) - out.anchor
        max_abs = max(max_abs, float(b.abs().max()))
        max_rel = max(max_rel, float(b.norm() / out.anchor.norm()))
    return {"max_abs": max_abs, "max_rel": max_rel}


def above_chance_pvalue(n_correct: int, n: int, chance: float = 0.5) -> float:
    """One-sided exact binomial p-value of doing at least this well by guessing."""
    from scipy.stats import binomtest

    return float(binomtest(n_correct, n, chance, alternative="greater").pvalue)


# long: the demo's script: train, sweep, test and report each method in order
def run_demo(
    out_dir: str = "demo_out",
    quick: bool = False,
    methods: list[str] | None = None,
    seed: int = 0,
    progress: bool | None = None,
    task: str = "bool_logic",
) -> dict[str, Any]:
    """Train, sweep and report every method; returns the results dict also saved as JSON.

    SIGTERM or Ctrl-C stop the whole demo (:class:`looplm.signals.Interrupted`): the methods
    finished by then are kept in ``results.json`` (marked ``interrupted``)."""
    methods = methods or DEFAULT_METHODS
    steps, n_eval = BUDGETS["quick" if quick else "default"]
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    results: dict[str, Any] = {
        "depths": DEPTHS,
        "chance": 0.5,
        "methods": {},
        "steps": steps,
        "task": task,
    }
    t_all = time.perf_counter()
    try:
        with stop_on_signals():  # SIGTERM / Ctrl-C stop the whole demo, not one training
            _train_and_sweep(methods, results, out, steps, n_eval, seed, progress, task)
    except Interrupted as exc:
        if results["methods"]:  # what was finished is kept
            atomic_write_json(out / "results.json", {**results, "interrupted": True})
            exc.kept = f"finished methods ({', '.join(results['methods'])}) kept in {out}"
        raise
    results["seconds"] = time.perf_counter() - t_all
    atomic_write_json(out / "results.json", results)
    plot_depth_response(results, out / "depth_response.png")
    report = render_report(results)
    atomic_write_text(out / "report.md", report)
    print(report)
    return results


def _train_and_sweep(
    methods: list[str],
    results: dict[str, Any],
    out: Path,
    steps: int,
    n_eval: int,
    seed: int,
    progress: bool | None,
    task: str,
) -> None:
    """Train, sweep and test each method in turn, filling ``results["methods"]``."""
    from looplm.training.loop import fit

    for method in methods:
        t0 = time.perf_counter()
        cfg = load_config(
            "tiny_bool",
            [
                f"model.recurrence={method}",
                f"train.steps={steps}",
                f"train.seed={seed}",
                f"eval.n_examples={n_eval}",
                f"out_dir={out / method}",
                f"data.dataset={task}",
            ],
        )
        print(f"[demo] training {method}: {steps} steps, T ~ U{{1..8}}", flush=True)
        # a bar on a terminal, else a line every train.log_every steps
        raise_if_stopped(fit(cfg, progress=progress))
        from looplm.model.checkpoint import load_checkpoint

        model, cfg, _ = load_checkpoint(out / method / "ckpt")
        source = make_source(cfg.data, cfg.model, cfg.train.seed)
        rows = depth_sweep(model, source, DEPTHS, batch_size=256, n_examples=n_eval)
        cfg.data.eval_difficulty = list(HARDER)
        harder = depth_sweep(
            model,
            make_source(cfg.data, cfg.model, cfg.train.seed),
            DEPTHS,
            batch_size=256,
            n_examples=n_eval,
        )
        x, _ = next(iter(source.eval_batches(32, None, 32)))
        fb = forcing_bias(model, x)
        results["methods"][method] = {
            "params": model.num_parameters(),
            "sweep": rows,
            "sweep_harder": harder,
            "forcing_bias": fb,
            "train_seconds": time.perf_counter() - t0,
        }
        for r in rows + harder:
            r["p_above_chance"] = above_chance_pvalue(r["n_correct"], r["n_examples"])
        best = max(rows, key=lambda r: r["accuracy"])
        print(
            f"[demo] {method}: accuracy {best['accuracy']:.3f} at best T={best['depth']} "
            f"(chance 0.5); max |b_t| = {fb['max_abs']:.3g}  ({time.perf_counter() - t0:.0f}s)",
            flush=True,
        )


def render_report(results: dict[str, Any]) -> str:
    """Markdown: accuracy per method × depth (best per column in bold), forcing bias, verdict."""
    depths = results["depths"]
    methods = results["methods"]
    lines = [
        f"# looplm demo: {TASK_TITLES[results.get('task', 'bool_logic')]}, tiny looped models",
        "",
        f"Each model trained {results['steps']} steps with loop depth T ~ U{{1..8}}; the same "
        "weights are evaluated at every T on freshly drawn examples of the training "
        "difficulty (1–3). That expression space is small, so most evaluation expressions also "
        "occur in the training stream: this table measures how well the function was learned "
        "on the training distribution. The harder table below (difficulty 4–5) contains no "
        "expression seen in training. Accuracy is the argmax over the whole byte vocabulary at "
        "the answer position; chance is 0.50. T > 8 is extra-loop evaluation (beyond the "
        "training depths).",
        "",
        "| method | params | " + " | ".join(f"T={d}" for d in depths) + " |",
        "|---|---:|" + "---:|" * len(depths),
    ]
    best_per_depth = {
        d: max(m["sweep"][i]["accuracy"] for m in methods.values()) for i, d in enumerate(depths)
    }
    for name, m in methods.items():
        cells = []
        for i, d in enumerate(depths):
            a = m["sweep"][i]["accuracy"]
            cells.append(f"**{a:.3f}**" if a == best_per_depth[d] else f"{a:.3f}")
        lines.append(f"| {name} | {m['params'] / 1e3:.0f}k | " + " | ".join(cells) + " |")
    lines += [
        "",
        "## Forcing bias at the anchor",
        "",
        "`b_t(e) = T_t(0; e) = step(h*) − h*`, measured for t = 0 … 47 on 32 evaluation inputs.",
        "",
        "| method | max abs b_t | max ‖b_t‖ / ‖h*‖ |",
        "|---|---:|---:|",
    ]
    for name, m in methods.items():
        fb = m["forcing_bias"]
        if fb["max_abs"] != fb["max_abs"]:  # NaN: an unshared model has no shared one-step map
            lines.append(f"| {name} | n/a (no shared step) | n/a |")
        else:
            lines.append(f"| {name} | {fb['max_abs']:.3g} | {fb['max_rel']:.3g} |")
    lines += [
        "",
        f"## Harder expressions (difficulty {HARDER[0]}–{HARDER[1]}, beyond the training range)",
        "",
        "| method | " + " | ".join(f"T={d}" for d in depths) + " |",
        "|---|" + "---:|" * len(depths),
    ]
    for name, m in methods.items():
        lines.append(
            f"| {name} | " + " | ".join(f"{r['accuracy']:.3f}" for r in m["sweep_harder"]) + " |"
        )
    return "\n".join(lines + _findings(results))


def _findings(results: dict[str, Any]) -> list[str]:
    """The report's closing section: per method the test at T = 8, best depth, ranking."""
    methods = results["methods"]
    lines = ["", "## What this run shows", ""]
    for name, m in methods.items():
        in_range = [r["accuracy"] for r in m["sweep"] if r["depth"] <= 8]
        beyond = [r["accuracy"] for r in m["sweep"] if r["depth"] > 8]
        mean = lambda xs: f"{sum(xs) / len(xs):.3f}" if xs else "n/a"  # noqa: E731
        best = max(m["sweep"], key=lambda r: r["accuracy"])
        # The test uses the pre-specified depth T = 8 (the deepest trained), not the best depth.
        ref = next((r for r in m["sweep"] if r["depth"] == TEST_DEPTH), m["sweep"][-1])
        verdict = "above chance" if ref["p_above_chance"] < 0.01 else "NOT above chance"
        lines.append(
            f"- **{name}**: {ref['accuracy']:.3f} at T={ref['depth']} (chance 0.50, one-sided "
            f"exact binomial p = {ref['p_above_chance']:.2g}: {verdict}); best "
            f"{best['accuracy']:.3f} at T={best['depth']}; mean over T ≤ 8 {mean(in_range)}, "
            f"over T > 8 {mean(beyond)}."
        )
    ranking = sorted(methods, key=lambda n: -max(r["accuracy"] for r in methods[n]["sweep"]))
    lines += [
        "",
        f"Ranking by best accuracy: {' > '.join(ranking)}. This is one seed at a tiny scale and a "
        "short schedule; the paper's ordering need not hold here, and this report states what "
        "this run found.",
        "",
        f"Total time: {results['seconds']:.0f} s.",
        "",
        "![depth response](depth_response.png)",
        "",
    ]
    return lines


def plot_depth_response(results: dict[str, Any], path: Path) -> None:
    """Accuracy vs loop depth (log2 axis), chance line, extra-loop region shaded."""
    from looplm.results.plotting import new_figure, save_png

    fig, ax = new_figure((9.5, 4.2), layout=None)
    ax.axvspan(8, max(results["depths"]) * 1.2, color="0.92", label="T > 8 (extra loops)")
    for name, m in results["methods"].items():
        d = [r["depth"] for r in m["sweep"]]
        a = [r["accuracy"] for r in m["sweep"]]
        ax.plot(d, a, marker="o", label=f"{name} (difficulty 1–3)")
        color = ax.lines[-1].get_color()
        i = max(range(len(a)), key=a.__getitem__)
        ax.plot(d[i], a[i], marker="*", markersize=14, color=color)
        hard = [r["accuracy"] for r in m.get("sweep_harder", [])]
        if hard:
            ax.plot(
                d,
                hard,
                marker=".",
                linestyle=":",
                color=color,
                label=f"{name} ({HARDER[0]}–{HARDER[1]})",
            )
    ax.axhline(results["chance"], color="k", linestyle="--", linewidth=1, label="chance")
    ax.set_xscale("log", base=2)
    ax.set_xticks(results["depths"], [str(d) for d in results["depths"]])
    ax.set_xlim(0.9, max(results["depths"]) * 1.1)
    ax.set_xlabel("loop depth T at evaluation (trained on T ~ U{1..8})")
    ax.set_ylabel("accuracy (fresh expressions)")
    ax.set_title(
        f"{TASK_TITLES[results.get('task', 'bool_logic')]}: one set of weights at every depth"
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    ax.grid(alpha=0.3)
    fig.tight_layout()
    save_png(fig, path, dpi=120)
