"""`looplm eval CHECKPOINT --depths 4,8,12,16,24,32,48` (fixed-depth sweep, LAMBADA, transfer).

    looplm eval runs/x/ckpt --depths 1-48 --split test --store runs/results.sqlite
    looplm eval runs/x/ckpt --dataset c4 --split train --max-tokens 8192 --store runs/results.sqlite
    looplm eval runs/x/ckpt --lambada ../shared/data/lambada --max-examples 500 --store ...

The options are :class:`~looplm.evaluate.settings.EvalSettings`; the work is ``evaluate_one``.
"""

from __future__ import annotations

import argparse
import json
import sys

from looplm.evaluate.settings import EvalSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (EvalSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="fixed-depth sweep of one checkpoint (PPL or task accuracy per T; LAMBADA)",
        description="Evaluate one set of weights at several loop depths; prints JSON. With "
        "--store, writes one results-store row per depth (keyed by evaluation identity).",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    add_options(p, EvalSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.evaluate.checkpoint import evaluate_one, store_rows
    from looplm.io import atomic_write_json
    from looplm.settings.limits import check_output_file

    settings = from_args(EvalSettings, args)  # depths under the loop ceiling (--max-loops)
    check_output_file("--out", settings.out)  # before the evaluation, not after it
    result, cfg, tag = evaluate_one(args.checkpoint, settings)  # NaN written as null
    # The results are printed and written before the store is touched: a store that cannot be
    # written (full disk, read-only) loses nothing that was computed.
    if settings.out:
        atomic_write_json(settings.out, result)
    print(json.dumps(result, indent=2), flush=True)
    if settings.store:
        stored = store_rows(args.checkpoint, settings, result, cfg, tag)
        print(
            f"stored {stored['rows']} rows in {stored['path']} (eval_tag {tag!r}, model_hash "
            f"{stored['model_hash']}, protocol {stored['protocol']})",
            file=sys.stderr,
        )
    return 0
