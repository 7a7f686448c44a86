"""`looplm generate CHECKPOINT --prompt TEXT`: continue a prompt with a KV-cached looped model,
at a fixed loop depth or with per-token adaptive depth (``--halt kl|update|gate --threshold X``).

`looplm generate CHECKPOINT --prompts FILE`: many prompts (one per line, or JSONL with per-prompt
settings) streamed through ``--slots`` batch slots (continuous batching); one JSON line per
prompt, in input order, on stdout or in ``--out``. Options: ``GenerateSettings``."""

from __future__ import annotations

import argparse
import sys

from looplm.decoding.generate import GenerateSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (GenerateSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "generate",
        help="continue a text prompt (KV cache per loop step; greedy or sampled)",
        description="Generate from a checkpoint with its own tokenizer. --loops is the depth T "
        "(the ceiling with --halt); the prompt runs T loops (or, with --prefill-halt, halts token "
        "by token too), each new token stops early when the halting rule says so. Past the "
        "model's context the window slides (the last context - slide + 1 tokens are re-read). "
        "--prompts FILE streams many prompts through --slots batch slots (continuous batching: "
        "a slot takes the next prompt when its sequence ends; each sequence gets the tokens it "
        "would get alone) and prints one JSON line per prompt plus a tokens/s summary.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--prompt", help="text to continue")
    which.add_argument(
        "--prompts",
        metavar="FILE",
        help="many prompts: one per line, or a .jsonl file of objects with prompt and optionally "
        "max_tokens, temperature, top_k, seed (defaults: the options below)",
    )
    add_options(p, GenerateSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.data import get_tokenizer
    from looplm.decoding.generate import generate_file, generate_text
    from looplm.model.checkpoint import load_checkpoint
    from looplm.settings.limits import check_output_file

    settings = from_args(GenerateSettings, args)  # --loops under the loop ceiling (--max-loops)
    check_output_file("--out", settings.out)  # before any decoding
    model, cfg, _ = load_checkpoint(args.checkpoint)
    settings.loops = settings.loops or cfg.train.depth_max  # the model's own, as serve's
    tok = get_tokenizer(cfg.model.tokenizer)
    if args.prompts is not None:
        print(generate_file(model, tok, args.prompts, settings), file=sys.stderr)
    else:
        print(generate_text(model, tok, args.prompt, settings))
    return 0
