"""`looplm lm-eval ARGS`: lm-evaluation-harness's own command line with looplm checkpoints.

The one command without a settings dataclass: it has no options of its own, every argument is
lm-eval's and passes on unchanged (lm-eval's parser reads and checks them)."""

from __future__ import annotations

import argparse


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lm-eval",
        help="run lm-evaluation-harness's command line with the looplm model registered",
        description="Every argument goes to lm-eval unchanged (see `looplm lm-eval --help`), with "
        "the model name `looplm` registered: --model looplm --model_args "
        "pretrained=CHECKPOINT,loops=T. --tasks lambada_local without --include_path runs "
        "LAMBADA offline from $LOOPLM_DATA_DIR/lambada/lambada_test.jsonl.",
        prefix_chars="\0",  # no options of its own: every argument, dashes included, passes on
        add_help=False,
    )
    p.add_argument("args", nargs=argparse.REMAINDER, help="lm-eval's arguments")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.decoding.lmeval import cli

    return cli(args.args)
