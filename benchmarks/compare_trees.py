"""Throughput of two looplm source trees, measured alternately: training steps and generation.

    python benchmarks/compare_trees.py BEFORE_TREE [AFTER_TREE] [--rounds 8] [--no-write]
    python benchmarks/compare_trees.py --report benchmarks/compare_trees_last.json

Each round runs one fresh worker process per tree (imports come from that tree only), the order
alternating between rounds, so that load from other work on a shared machine hits both trees
alike. A worker measures, with one torch thread:

* **training**: looplm's own ``train_step`` (forward, backward, clip, AdamW) of SCSE at the 22m
  preset's width, T = 8, batch 2 × 128 random tokens, dropout 0 — one warm-up step, then
  ``--steps`` timed steps;
* **generation**: greedy cached decoding (``looplm.decoding.decoder.decode``) of a randomly initialised
  tiny SCSE model (d 128, bytes), 8 prompts × 32 tokens → 96 new tokens at T = 8: fixed depth,
  per-token KL halting (threshold 1e-3) and per-token update halting (maxtoken, 0.3); the best of
  ``--repeats`` calls per round (the tiny model makes per-step Python overhead visible).

Process CPU time is the primary figure (wall clock on a loaded machine mostly measures the
neighbours); tokens/s are computed from the per-round values and reported as medians over rounds
with the after/before ratio. The halting decisions are deterministic, so both trees decode the
same tokens at the same depths (checked: the mean loops per token must agree).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
TRAIN_TOKENS = 2 * 128
GEN = dict(batch=8, prompt=32, new=96, loops=8)
MODES = {"fixed": ("none", 0.0), "kl": ("kl", 1e-3), "maxtoken": ("maxtoken", 0.3)}


def _timed(fn) -> tuple[float, float, object]:
    t0, c0 = time.perf_counter(), time.process_time()
    out = fn()
    return time.process_time() - c0, time.perf_counter() - t0, out


def worker(tree: str, steps: int, repeats: int) -> dict:
    """Measure one tree in this process (its looplm first on the path)."""
    sys.path.insert(0, tree)
    os.environ["LOOPLM_NO_PROGRESS"] = "1"
    import torch

    import looplm
    from looplm.decoding.decoder import decode
    from looplm.settings.config import load_config
    from looplm.training.loop import setup, train_step

    assert Path(looplm.__file__).resolve().is_relative_to(Path(tree).resolve()), looplm.__file__
    torch.set_num_threads(1)
    sys.path.insert(0, str(HERE))
    from throughput import random_source

    over = [
        "model.preset=22m", "model.recurrence=scse", "model.dropout=0.0", "train.depth_min=8",
        "train.depth_max=8", "train.batch_size=2", "train.warmup=0", "train.steps=1000000",
        "train.device=cpu", "out_dir=/tmp/looplm-compare-trees",
    ]  # fmt: skip
    ts = setup(load_config(None, over))
    ts.source = random_source(ts.cfg.model.vocab_size, ts.cfg.model.context)
    train_step(ts)  # warm-up
    train = [_timed(lambda: train_step(ts))[:2] for _ in range(steps)]
    torch.manual_seed(0)
    model = looplm.build_model("tiny", "scse", dropout=0.0).eval()
    g = torch.Generator().manual_seed(1)
    prompt = torch.randint(0, 257, (GEN["batch"], GEN["prompt"]), generator=g)
    gen = {}
    for mode, (rule, thr) in MODES.items():
        runs = [
            _timed(lambda r=rule, t=thr: decode(model, prompt, GEN["new"], GEN["loops"], halt=r,
                                                threshold=t))
            for _ in range(repeats + 1)
        ][1:]  # fmt: skip
        best = min(runs, key=lambda r: r[0])
        gen[mode] = {"cpu": best[0], "wall": best[1], "mean_loops": best[2].mean_loops}
    return {"train": train, "gen": gen}


def run_worker(tree: str, args) -> dict:
    cmd = [sys.executable, __file__, tree, "--worker", f"--steps={args.steps}"]
    cmd.append(f"--repeats={args.repeats}")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(cmd, capture_output=True, text=True, env=env, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _med(values: list[float]) -> float:
    return statistics.median(values)


def report(trees: dict[str, str], rounds: dict[str, list[dict]], meta: dict) -> str:
    """The RESULTS.md section: per-measure medians over rounds, after/before ratios."""
    from _results import machine_line

    rows = []
    for label, fn in [
        ("training step (tokens/s)", lambda r: TRAIN_TOKENS / _med([c for c, _ in r["train"]])),
        *[
            (f"generation, {m} (tokens/s)", lambda r, m=m: GEN["batch"] * GEN["new"] / r["gen"][m]["cpu"])
            for m in MODES
        ],
    ]:  # fmt: skip
        cpu = {k: [fn(r) for r in v] for k, v in rounds.items()}
        rows.append((label, _med(cpu["before"]), _med(cpu["after"])))
    walls = {
        k: [_med([w for _, w in r["train"]]) for r in v] for k, v in rounds.items()
    }  # per-round median train-step wall
    loops = {m: rounds["after"][0]["gen"][m]["mean_loops"] for m in MODES}
    lines = [
        "## Before / after: training and generation throughput of two source trees",
        "",
        f"`python benchmarks/compare_trees.py` · {machine_line()} (workers: 1 thread) · "
        f"{meta['rounds']} alternating rounds, {meta['wall']:.0f} s in all · load average "
        f"before {meta['load_before']}, after {meta['load_after']}",
        "",
        f"before: `{trees['before']}` ({meta['rev_before']}); after: `{trees['after']}` "
        f"({meta['rev_after']}). Training: SCSE 22m width, T = 8, batch 2 × 128, "
        f"{meta['steps']} timed `train_step`s per round (median). Generation: tiny SCSE, "
        f"{GEN['batch']} × {GEN['prompt']} prompt → {GEN['new']} new tokens at T = {GEN['loops']}, "
        f"best of {meta['repeats']} calls per round; mean loops per decoded token "
        + ", ".join(f"{m} {v:.2f}" for m, v in loops.items())
        + " (identical in both trees).",
        "",
        "| measure (process CPU time) | before | after | after / before |",
        "| --- | ---: | ---: | ---: |",
    ]
    worst = 1.0
    for label, b, a in rows:
        lines.append(f"| {label} | {b:,.0f} | {a:,.0f} | {a / b:.3f} |")
        worst = min(worst, a / b)
    wb, wa = _med(walls["before"]), _med(walls["after"])
    lines += [
        "",
        f"Training step wall clock (median of rounds): before {wb:.3f} s, after {wa:.3f} s "
        f"({wb / wa:.3f} tokens/s ratio). Lowest after/before tokens/s ratio in CPU time: "
        f"**{worst:.3f}** ({'within' if worst >= 0.97 else 'outside'} the 3% tolerance).",
    ]
    return "\n".join(lines)


def _rev(tree: str) -> str:
    try:
        out = subprocess.run(
            ["git", "-C", tree, "rev-parse", "--short", "HEAD"], capture_output=True, text=True
        )
        dirty = subprocess.run(
            ["git", "-C", tree, "status", "--porcelain", "--untracked-files=no"],
            capture_output=True,
            text=True,
        ).stdout.strip()
        return out.stdout.strip() + (" + uncommitted changes" if dirty else "")
    except OSError:
        return "?"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("before", nargs="?", help="source tree measured as 'before'")
    ap.add_argument("after", nargs="?", default=str(HERE.parent), help="default: this tree")
    ap.add_argument("--rounds", type=int, default=8)
    ap.add_argument("--steps", type=int, default=3, help="timed training steps per round")
    ap.add_argument("--repeats", type=int, default=3, help="generation calls per mode and round")
    ap.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--no-write", action="store_true", help="print only; leave RESULTS.md alone")
    ap.add_argument("--report", metavar="JSON", help="write the section of a saved run's JSON")
    args = ap.parse_args(argv)
    if args.report:
        saved = json.loads(Path(args.report).read_text())
        sys.path.insert(0, str(HERE))
        from _results import update_section

        text = report(saved["trees"], saved["rounds"], saved["meta"])
        print(text)
        if not args.no_write:
            update_section("compare_trees", text)
        return 0
    if not args.before:
        ap.error("the 'before' source tree is required")
    if args.worker:
        print(json.dumps(worker(args.before, args.steps, args.repeats)))
        return 0
    trees = {"before": args.before, "after": args.after}
    load_before = "/".join(f"{x:.2f}" for x in os.getloadavg())
    t0 = time.perf_counter()
    rounds: dict[str, list[dict]] = {"before": [], "after": []}
    for r in range(args.rounds):
        order = ["before", "after"] if r % 2 == 0 else ["after", "before"]
        for k in order:
            rounds[k].append(run_worker(trees[k], args))
        print(f"round {r + 1}/{args.rounds} done ({time.perf_counter() - t0:.0f} s)", flush=True)
    for m in MODES:
        seen = {rr["gen"][m]["mean_loops"] for v in rounds.values() for rr in v}
        assert len(seen) == 1, f"{m}: the trees decode at different depths {seen}"
    meta = {
        "rounds": args.rounds,
        "steps": args.steps,
        "repeats": args.repeats,
        "wall": time.perf_counter() - t0,
        "load_before": load_before,
        "load_after": "/".join(f"{x:.2f}" for x in os.getloadavg()),
        "rev_before": _rev(args.before),
        "rev_after": _rev(args.after),
    }
    sys.path.insert(0, str(HERE))
    text = report(trees, rounds, meta)
    print(text)
    raw = HERE / "compare_trees_last.json"
    raw.write_text(json.dumps({"trees": trees, "meta": meta, "rounds": rounds}, indent=1))
    if not args.no_write:
        from _results import update_section

        update_section("compare_trees", text)
    return 0


if __name__ == "__main__":
    sys.exit(main())
