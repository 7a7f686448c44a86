"""`looplm demo [--out DIR] [--quick] [--methods …]`: the main job on an embedded default (the
options are :class:`~looplm.experiments.settings.DemoSettings`)."""

from __future__ import annotations

import argparse

from looplm.errors import LoopLMError
from looplm.experiments.settings import DemoSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (DemoSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "demo",
        help="train tiny scse/looped/tuned_adapter models on nested boolean logic (no download)",
        description="Train tiny looped models on a synthetic task on the CPU, evaluate each at "
        "T in {1..48}, measure the forcing bias, and write report.md, results.json and "
        "depth_response.png.",
    )
    add_options(p, DemoSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.demo import run_demo
    from looplm.model.recurrences import recurrence_names

    s, names = from_args(DemoSettings, args), recurrence_names()
    methods = names if list(s.methods) == ["all"] else list(s.methods)
    for m in methods:
        if m not in names:
            raise LoopLMError(f"unknown method {m!r}; allowed: {', '.join(names)}, or all")
    run_demo(s.out, quick=s.quick, methods=methods, seed=s.seed, task=s.task)
    return 0
