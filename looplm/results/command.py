"""`looplm results export|import`: a results store as a committed data file and back.

    looplm results export runs/paper/wt2_bytes/results.sqlite --out docs/data/wt2_bytes.jsonl
    looplm results import docs/data/wt2_bytes.jsonl --store /tmp/wt2_bytes.sqlite

The format (one sorted JSON line per evaluation row) is :mod:`looplm.results.export`'s.
"""

from __future__ import annotations

import argparse
import json

from looplm.results.settings import ResultsExportSettings, ResultsImportSettings
from looplm.settings.options import add_options, from_args

SETTINGS = {"results export": (ResultsExportSettings,), "results import": (ResultsImportSettings,)}


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``results`` command."""
    p = subparsers.add_parser(
        "results",
        help="export a results store as a diff-friendly data file, or import one back",
        description="export: every row of a SQLite results store as one sorted JSON line "
        "(.jsonl, or .jsonl.gz compressed), the form committed under docs/data/; import: those "
        "rows back into a store (created when missing; rows with the same identity replaced).",
    )
    ps = p.add_subparsers(dest="action", metavar="ACTION")
    ps.required = True
    ex = ps.add_parser("export", help="a store's rows as a .jsonl (or .jsonl.gz) file")
    ex.add_argument("store", help="the results store (.sqlite)")
    add_options(ex, ResultsExportSettings)
    im = ps.add_parser("import", help="an export's rows into a store")
    im.add_argument("export", help="the export file (.jsonl or .jsonl.gz)")
    add_options(im, ResultsImportSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.results.export import export_store, import_export

    if args.action == "export":
        out = from_args(ResultsExportSettings, args).out
        print(json.dumps(export_store(args.store, out)))
        return 0
    store = from_args(ResultsImportSettings, args).store
    n = import_export(args.export, store)
    print(json.dumps({"rows": n, "store": store}))
    return 0
