"""`looplm sweep CONFIG`: train and evaluate a methods × seeds × variants grid, then report.

    looplm sweep configs/experiments/wt2_tiny.yaml --data-dir ../shared/data

Resumable: finished runs (complete checkpoints) are not retrained, interrupted ones resume, and
evaluations already in the results store are skipped. See :mod:`looplm.experiments.runner` for the
config format.
"""

from __future__ import annotations

import argparse
import json

from looplm.experiments.settings import SweepSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (SweepSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="train + evaluate an experiment grid into a results store, then report (resumable)",
        description="Run an experiment config (methods × seeds × training variants × fixed, "
        "adaptive, transfer and LAMBADA evaluations). Finished work is skipped.",
    )
    p.add_argument("config", help="experiment YAML (e.g. configs/experiments/wt2_tiny.yaml)")
    add_options(p, SweepSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.runner import load_experiment, run_experiment, write_experiment_report

    s = from_args(SweepSettings, args)
    if s.report_only:
        exp = load_experiment(args.config, s.data_dir, full=s.full)
        out = write_experiment_report(exp)
        print(json.dumps(out, indent=2))
        return 0
    summary = run_experiment(
        args.config,
        data_dir=s.data_dir,
        dry_run=s.dry_run,
        report=s.report,
        train=s.train,
        redo=s.redo,
        full=s.full,
    )
    print(json.dumps(summary, indent=2, default=str))
    if "interrupted" in summary:  # a signal stopped training: the shell's convention
        return 128 + int(summary["interrupted"])
    return 0
