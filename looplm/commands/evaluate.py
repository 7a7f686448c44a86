"""`looplm eval CHECKPOINT --depths 4,8,12,16,24,32,48`."""

from __future__ import annotations

import argparse
import json

from looplm.errors import LoopLMError


def parse_depths(text: str) -> list[int]:
    """'4,8,12' → [4, 8, 12]; every depth must be an integer >= 1."""
    try:
        depths = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoopLMError(f"--depths {text!r}: expected comma-separated integers") from None
    bad = [d for d in depths if d < 1]
    if not depths or bad:
        raise LoopLMError(f"--depths {text!r}: loop depths must be integers >= 1")
    return depths


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="fixed-depth sweep of one checkpoint (PPL or task accuracy per T)",
        description="Evaluate one set of weights at several loop depths; prints JSON.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    p.add_argument("--depths", default="4,8,12,16,24,32,48", help="comma-separated loop depths")
    p.add_argument("--dataset", help="evaluate on another dataset (held-out transfer)")
    p.add_argument("--split", help="evaluation split (default: the run's eval split)")
    p.add_argument("--data-dir", help="folder with local corpora")
    p.add_argument("--max-tokens", type=int, help="cap on evaluated tokens")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="also write the JSON here (atomically)")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.evaluate import evaluate_checkpoint
    from looplm.io import atomic_write_json

    result = evaluate_checkpoint(
        args.checkpoint,
        parse_depths(args.depths),
        dataset=args.dataset,
        split=args.split,
        data_dir=args.data_dir,
        max_tokens=args.max_tokens,
        batch_size=args.batch_size,
        device=args.device,
        progress=True,
    )
    if args.out:
        atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2))
    return 0
