"""`looplm settings [--out docs/configuration.md]`: the reference of every setting, written from
the settings dataclasses (:mod:`looplm.experiments.reference`)."""

from __future__ import annotations

import argparse

from looplm.experiments.settings import ReferenceSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ReferenceSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "settings",
        help="every setting (run configs, methods, grids, commands) with type, default, meaning",
        description="Print the configuration reference (markdown) generated from the settings "
        "dataclasses; --out writes it to a file (docs/configuration.md).",
    )
    add_options(p, ReferenceSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.experiments.reference import configuration_markdown

    out = from_args(ReferenceSettings, args).out
    text = configuration_markdown()
    if out:
        from looplm.io import atomic_write_text

        atomic_write_text(out, text)
        print(f"wrote {out}")
    else:
        print(text, end="")
    return 0
