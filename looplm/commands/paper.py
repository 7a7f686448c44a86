"""`looplm paper`: the SCSE paper's tables and figures as experiment grids.

    looplm paper                          # catalogue: config, needs, cost (2 CPU cores / H200), status
    looplm paper run table02 [--full]     # train + evaluate its grid (looplm sweep; resumable)
    looplm paper run table02 --dry-run    # list the grid's runs
    looplm paper report [--full] [--out FILE] [--data DIR] [ENTRY …]   # paper values beside measured

Each entry is ``configs/paper/<entry>.yaml`` (:mod:`looplm.experiments.paper`); ``--full`` is the paper's
protocol, the default its CPU analogue; a table reusing a shared grid trains nothing new."""

from __future__ import annotations

import argparse
import json
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "paper",
        help="the SCSE paper's tables and figures: catalogue, run, paper-vs-measured report",
        description="List the paper's tables and figures with their configs, needs, estimated "
        "cost and status (no action), run one as a sweep (run), or write the side-by-side report "
        "(report).",
    )
    p.add_argument("--data-dir", help="folder with local corpora (default: $LOOPLM_DATA_DIR)")
    p.add_argument("--json", action="store_true", help="catalogue as JSON")
    ps = p.add_subparsers(dest="action")
    r = ps.add_parser("run", help="train and evaluate one entry's grid (looplm sweep)")
    r.add_argument("entry", help="table01 … table22, figure3 … figure5, convergence")
    r.add_argument(
        "--full", action="store_true", help="the paper's protocol (default: CPU analogue)"
    )
    r.add_argument("--dry-run", action="store_true", help="list the runs and exit")
    r.add_argument("--no-train", action="store_true", help="evaluate existing checkpoints only")
    r.add_argument("--no-report", action="store_true", help="skip the sweep report at the end")
    rep = ps.add_parser("report", help="paper values beside measured ones (Markdown)")
    rep.add_argument("entries", nargs="*", help="entries to include (default: all)")
    rep.add_argument("--full", action="store_true", help="measured values of the full protocol")
    rep.add_argument(
        "--out", help="also write the Markdown to this file (diagnostics figures beside it)"
    )
    rep.add_argument(
        "--data",
        help="read each grid's rows from its committed export in this folder "
        "(<folder>/<grid>.jsonl, see `looplm results export`) instead of its run folder",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments import paper

    if args.action == "run":
        from looplm.experiments.runner import run_experiment

        entry = paper.find_entry(args.entry)
        entry.experiment(full=args.full, data_dir=args.data_dir)  # nothing to run: a clear error
        summary = run_experiment(
            entry.path,
            data_dir=args.data_dir,
            dry_run=args.dry_run,
            report=not args.no_report,
            train=not args.no_train,
            full=args.full,
        )
        print(json.dumps(summary, indent=2, default=str))
        return 128 + int(summary["interrupted"]) if "interrupted" in summary else 0
    if args.action == "report":
        from looplm.io import atomic_write_text

        entries = [paper.find_entry(e) for e in args.entries] if args.entries else None
        figures = Path(args.out).with_suffix("") if args.out else None
        text = paper.paper_report(
            entries,
            full=args.full,
            data_dir=args.data_dir,
            figures_dir=figures,
            link_base=Path(args.out).parent if args.out else None,
            data=args.data,
        )
        if args.out:
            atomic_write_text(args.out, text)
        print(text, end="")
        return 0
    rows = paper.catalogue_rows(data_dir=args.data_dir)
    if args.json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(paper.format_catalogue(rows))
    return 0
