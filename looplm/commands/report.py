"""`looplm report STORE`: tables (markdown), figures (PNG) and results.json from a results store.

The options are :class:`~looplm.results.settings.ReportSettings` (the ``report:`` section of a
grid reads the same dataclass); the work is :func:`looplm.results.report.write_report`.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from looplm.errors import LoopLMError
from looplm.results.settings import DEFAULT_REFERENCE, ReportOutput, ReportSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ReportSettings, ReportOutput)


def _parse_seeds(text: str) -> str | list[int]:
    text = text.strip()
    if text in ("default", "expanded", "auto", "all"):
        return text
    try:
        seeds = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise LoopLMError(
            f"bad --seeds {text!r}; allowed: default, expanded, auto, all, or ids like 0,1,2"
        ) from None
    if not seeds:
        raise LoopLMError("--seeds is empty; give ids like 0,1,2 or default/expanded/auto/all")
    return seeds


def run(args: argparse.Namespace) -> int:
    """Build the report; prints its paired-delta and φ tables and the paths written."""
    from looplm.results.report import key_tables, report_folder, write_report

    settings = from_args(ReportSettings, args, seeds=_parse_seeds(args.seeds))
    output = from_args(ReportOutput, args)
    out = report_folder(args.store, output.out)  # says when it replaces an earlier report
    # a reference in neither the store nor the default is a typo, refused before any work
    result = write_report(args.store, out, settings, known_methods=[DEFAULT_REFERENCE])
    if not output.quiet:
        tables = key_tables(Path(result.report_md).read_text(encoding="utf-8"))
        if tables:
            print(tables + "\n")
    print(f"wrote {result.report_md}")
    print(f"wrote {result.results_json}")
    for fig in result.figures:
        print(f"wrote {fig}")
    if result.incomplete:
        print(f"warning: {len(result.incomplete)} incomplete summaries (marked ⚠ in the report)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` command."""
    p = subparsers.add_parser(
        "report",
        help="tables, figures and results.json from a results store",
        description="Turn a results store (SQLite, or its JSON export) into paper-style markdown "
        "tables, PNG figures and a results.json summary.",
    )
    p.add_argument("store", help="results store (.sqlite) or a JSON export of one")
    for cls in SETTINGS:
        add_options(p, cls)
    p.set_defaults(func=run)
