"""`looplm demo [--out DIR] [--quick] [--methods …]`: the main job on an embedded default."""

from __future__ import annotations

import argparse

from looplm.errors import LoopLMError


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train tiny scse/looped/tuned_adapter models on nested boolean logic (no download)",
        description="Train tiny looped models on a synthetic task on the CPU, evaluate each at "
        "T in {1..48}, measure the forcing bias, and write report.md, results.json and "
        "depth_response.png.",
    )
    p.add_argument("--out", default="demo_out", help="output folder (default demo_out)")
    p.add_argument(
        "--quick",
        action="store_true",
        help="short schedule: 150 training steps per method instead of 500",
    )
    p.add_argument(
        "--methods",
        default="scse,looped,tuned_adapter",
        help="comma-separated recurrence names, or 'all' for every registered method",
    )
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--task",
        default="bool_logic",
        choices=["bool_logic", "graph_reach", "relational_text"],
        help="synthetic task (default: nested boolean logic)",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.demo import run_demo
    from looplm.model.recurrences import recurrence_names

    names = recurrence_names()
    methods = names if args.methods == "all" else [m.strip() for m in args.methods.split(",")]
    for m in methods:
        if m not in names:
            raise LoopLMError(f"unknown method {m!r}; allowed: {', '.join(names)}, or all")
    run_demo(args.out, quick=args.quick, methods=methods, seed=args.seed, task=args.task)
    return 0
