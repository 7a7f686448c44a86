"""`looplm sweep CONFIG`: train and evaluate a methods × seeds × variants grid, then report.

    looplm sweep configs/experiments/wt2_tiny.yaml --data-dir ../shared/data

Resumable: finished runs (complete checkpoints) are not retrained, interrupted ones resume, and
evaluations already in the results store are skipped. See :mod:`looplm.experiments.runner` for the
config format.
"""

from __future__ import annotations

import argparse
import json


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "sweep",
        help="train + evaluate an experiment grid into a results store, then report (resumable)",
        description="Run an experiment config (methods × seeds × training variants × fixed, "
        "adaptive, transfer and LAMBADA evaluations). Finished work is skipped.",
    )
    p.add_argument("config", help="experiment YAML (e.g. configs/experiments/wt2_tiny.yaml)")
    p.add_argument(
        "--data-dir", help="folder with local corpora (default: config / $LOOPLM_DATA_DIR)"
    )
    p.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    p.add_argument(
        "--full", action="store_true", help="the config's larger grid (its 'full:' section)"
    )
    p.add_argument("--no-train", action="store_true", help="evaluate existing checkpoints only")
    p.add_argument("--no-report", action="store_true", help="skip the report at the end")
    p.add_argument(
        "--report-only", action="store_true", help="only (re)write the report from the store"
    )
    p.add_argument(
        "--redo",
        default="",
        help="comma-separated evaluation kinds to recompute even if stored (rows are replaced): "
        "fixed, adaptive, transfer, lambada, frontier, propagation, lens, scaling, diagnostics",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.runner import load_experiment, run_experiment, write_experiment_report

    if args.report_only:
        exp = load_experiment(args.config, args.data_dir, full=args.full)
        out = write_experiment_report(exp)
        print(json.dumps(out, indent=2))
        return 0
    summary = run_experiment(
        args.config,
        data_dir=args.data_dir,
        dry_run=args.dry_run,
        report=not args.no_report,
        train=not args.no_train,
        redo=[k.strip() for k in args.redo.split(",") if k.strip()],
        full=args.full,
    )
    print(json.dumps(summary, indent=2, default=str))
    if "interrupted" in summary:  # a signal stopped training: the shell's convention
        return 128 + int(summary["interrupted"])
    return 0
