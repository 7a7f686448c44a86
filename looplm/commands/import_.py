"""`looplm import SRC OUT`: a published looped checkpoint (Parcae, Huginn-0125, Ouro) written as
a looplm checkpoint folder that every command reads."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "import",
        help="import a Parcae / Huginn-0125 / Ouro / HRM-Text checkpoint as a looplm checkpoint",
        description="Read SRC — a folder in the model's published layout (config.json + "
        "safetensors shards or a .bin/.pt state dict) of Parcae, Huginn-0125, Ouro or HRM-Text, "
        "or a hub id such as SandyResearch/parcae-140m (fetched through huggingface_hub when a "
        "network exists) — and write OUT, a looplm checkpoint folder (model.safetensors + "
        "state.json, with the tokenizer: --tokenizer, else SRC's tokenizer.json). An existing "
        "OUT is refused unless --overwrite (which replaces only a looplm checkpoint folder); OUT "
        "never lies inside SRC nor SRC inside OUT. Tensors keep their stored dtype unless "
        "--dtype. See docs/pretrained.md.",
    )
    p.add_argument("src", help="published checkpoint folder, or a hub id owner/name")
    p.add_argument("out", help="looplm checkpoint folder to write")
    p.add_argument(
        "--dtype",
        default=None,
        choices=["float32", "bfloat16", "float16"],
        help="convert the weights (default: keep the stored dtype)",
    )
    p.add_argument(
        "--tokenizer",
        default=None,
        metavar="PATH",
        help="the model's tokenizer.json (or a folder holding one), or gpt2 (default: SRC's "
        "tokenizer.json; without one, GPT-2's when the vocabulary holds it, else an error)",
    )
    p.add_argument(
        "--overwrite", action="store_true", help="replace OUT when it is a looplm checkpoint"
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.model.families import import_pretrained

    out = import_pretrained(
        args.src, args.out, dtype=args.dtype, overwrite=args.overwrite, tokenizer=args.tokenizer
    )
    print(f"imported {args.src} -> {out}")
    return 0
