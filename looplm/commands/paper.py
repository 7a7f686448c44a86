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

from looplm.experiments.settings import PaperReportSettings, PaperRunSettings, PaperSettings
from looplm.settings.options import add_options, from_args

SETTINGS = {
    "paper": (PaperSettings,),
    "paper run": (PaperRunSettings,),
    "paper report": (PaperReportSettings,),
}


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "paper",
        help="the SCSE paper's tables and figures: catalogue, run, paper-vs-measured report",
        description="List the paper's tables and figures with their configs, needs, estimated "
        "cost and status (no action), run one as a sweep (run), or write the side-by-side report "
        "(report).",
    )
    add_options(p, PaperSettings)
    ps = p.add_subparsers(dest="action")
    r = ps.add_parser("run", help="train and evaluate one entry's grid (looplm sweep)")
    r.add_argument("entry", help="table01 … table22, figure3 … figure5, convergence")
    add_options(r, PaperRunSettings)
    rep = ps.add_parser("report", help="paper values beside measured ones (Markdown)")
    rep.add_argument("entries", nargs="*", help="entries to include (default: all)")
    add_options(rep, PaperReportSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments import paper

    data_dir = from_args(PaperSettings, args).data_dir
    if args.action == "run":
        from looplm.experiments.runner import run_experiment

        s, entry = from_args(PaperRunSettings, args), paper.find_entry(args.entry)
        entry.experiment(full=s.full, data_dir=data_dir)  # nothing to run: a clear error
        summary = run_experiment(
            entry.path,
            data_dir=data_dir,
            dry_run=s.dry_run,
            report=s.report,
            train=s.train,
            full=s.full,
        )
        print(json.dumps(summary, indent=2, default=str))
        return 128 + int(summary["interrupted"]) if "interrupted" in summary else 0
    if args.action == "report":
        from looplm.io import atomic_write_text

        s = from_args(PaperReportSettings, args)
        entries = [paper.find_entry(e) for e in args.entries] if args.entries else None
        figures = Path(s.out).with_suffix("") if s.out else None
        text = paper.paper_report(
            entries,
            full=s.full,
            data_dir=data_dir,
            figures_dir=figures,
            link_base=Path(s.out).parent if s.out else None,
            data=s.data,
        )
        if s.out:
            atomic_write_text(s.out, text)
        print(text, end="")
        return 0
    rows = paper.catalogue_rows(data_dir=data_dir)
    if from_args(PaperSettings, args).json:
        print(json.dumps(rows, indent=2, default=str))
    else:
        print(paper.format_catalogue(rows))
    return 0
