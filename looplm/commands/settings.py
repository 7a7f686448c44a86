"""`looplm settings [--out docs/configuration.md]`: the reference of every setting, written from
the settings dataclasses (:mod:`looplm.experiments.reference`)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "settings",
        help="every setting (run configs, methods, grids, commands) with type, default, meaning",
        description="Print the configuration reference (markdown) generated from the settings "
        "dataclasses; --out writes it to a file (docs/configuration.md).",
    )
    p.add_argument("--out", help="write the reference here (atomically) instead of printing it")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.reference import configuration_markdown

    text = configuration_markdown()
    if args.out:
        from looplm.io import atomic_write_text

        atomic_write_text(args.out, text)
        print(f"wrote {args.out}")
    else:
        print(text, end="")
    return 0
