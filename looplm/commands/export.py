"""`looplm export CHECKPOINT OUT`: write a Hugging Face ``transformers`` model folder (the options
are :class:`~looplm.decoding.hf.settings.ExportSettings`)."""

from __future__ import annotations

import argparse

from looplm.decoding.hf.settings import ExportSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ExportSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "export",
        help="write a Hugging Face transformers folder (AutoModelForCausalLM, trust_remote_code)",
        description="Export a checkpoint as config.json + model.safetensors + model code that "
        "transformers.AutoModelForCausalLM.from_pretrained(OUT, trust_remote_code=True) loads. "
        "The code files import looplm (install looplm wherever the folder is loaded) unless "
        "--standalone, which writes model code generated from looplm's source that needs only "
        "torch and transformers. A tokenizer.json is written for AutoTokenizer.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    p.add_argument("out", help="output folder")
    add_options(p, ExportSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.decoding.hf import export_checkpoint

    out = export_checkpoint(args.checkpoint, args.out, from_args(ExportSettings, args))
    print(f"exported {args.checkpoint} -> {out}")
    return 0
