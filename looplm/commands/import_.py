"""`looplm import SRC OUT`: a published looped checkpoint (Parcae, Huginn-0125, Ouro, HRM-Text)
written as a looplm checkpoint folder that every command reads (the options are
:class:`~looplm.model.settings.ImportSettings`)."""

from __future__ import annotations

import argparse

from looplm.model.settings import ImportSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ImportSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="import a Parcae / Huginn-0125 / Ouro / HRM-Text checkpoint as a looplm checkpoint",
        description="Read SRC (a Parcae, Huginn-0125, Ouro or HRM-Text folder in its published "
        "layout, config.json + weights; or a hub id such as SandyResearch/parcae-140m) and write "
        "OUT, a looplm checkpoint folder with the tokenizer. An existing OUT needs --overwrite; "
        "OUT and SRC never nest. See docs/pretrained.md.",
    )
    p.add_argument("src", help="published checkpoint folder, or a hub id owner/name")
    p.add_argument("out", help="looplm checkpoint folder to write")
    add_options(p, ImportSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.model.families import import_pretrained

    out = import_pretrained(args.src, args.out, **vars(from_args(ImportSettings, args)))
    print(f"imported {args.src} -> {out}")
    return 0
