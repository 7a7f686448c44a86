"""`looplm import SRC OUT`: a published looped checkpoint (Parcae, Huginn-0125, Ouro) written as
a looplm checkpoint folder that every command reads (the options are
:class:`~looplm.model.settings.ImportSettings`)."""

from __future__ import annotations

import argparse

from looplm.model.settings import ImportSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ImportSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="import a Parcae / Huginn-0125 / Ouro checkpoint as a looplm checkpoint",
        description="Read SRC — a folder in the model's published layout (config.json + "
        "safetensors shards or a .bin/.pt state dict) or a hub id such as "
        "SandyResearch/parcae-140m (fetched through huggingface_hub when a network exists) — "
        "and write OUT, a looplm checkpoint folder (model.safetensors + state.json, with SRC's "
        "tokenizer files). Tensors keep their stored dtype unless --dtype. See docs/pretrained.md.",
    )
    p.add_argument("src", help="published checkpoint folder, or a hub id owner/name")
    p.add_argument("out", help="looplm checkpoint folder to write")
    add_options(p, ImportSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.model.families import import_pretrained

    out = import_pretrained(args.src, args.out, dtype=from_args(ImportSettings, args).dtype)
    print(f"imported {args.src} -> {out}")
    return 0
