"""`looplm eval CHECKPOINT --depths 4,8,12,16,24,32,48` (fixed-depth sweep, LAMBADA, transfer).

    looplm eval runs/x/ckpt --depths 1-48 --split test --store runs/results.sqlite
    looplm eval runs/x/ckpt --dataset c4 --split train --max-tokens 8192 --store runs/results.sqlite
    looplm eval runs/x/ckpt --lambada ../shared/data/lambada --max-examples 500 --store ...

With ``--store`` every depth becomes one row of the results store, keyed by its evaluation identity
(see :mod:`looplm.evaluate.records`); re-running replaces the rows, never duplicates them.
"""

from __future__ import annotations

import argparse
import json
import sys

from looplm.device import parse_depths
from looplm.errors import LoopLMError, check_positive_int


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "eval",
        help="fixed-depth sweep of one checkpoint (PPL or task accuracy per T; LAMBADA)",
        description="Evaluate one set of weights at several loop depths; prints JSON. With "
        "--store, writes one results-store row per depth (keyed by evaluation identity).",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    p.add_argument(
        "--depths",
        default="4,8,12,16,24,32,48",
        help="comma-separated loop depths or ranges (1-48)",
    )
    p.add_argument("--dataset", help="evaluate on another dataset (held-out transfer)")
    p.add_argument("--split", help="evaluation split (default: the run's eval split)")
    p.add_argument("--data-dir", help="folder with local corpora")
    p.add_argument("--max-tokens", type=int, help="cap on evaluated tokens")
    p.add_argument("--batch-size", type=int)
    p.add_argument("--device", default="auto")
    p.add_argument("--out", help="also write the JSON here (atomically)")
    p.add_argument("--store", help="results store (.sqlite) to write one row per depth into")
    p.add_argument("--tag", default="", help="evaluation tag (part of the evaluation identity)")
    p.add_argument("--protocol", help="training-protocol name (default: <train dataset>-<steps>)")
    p.add_argument(
        "--lambada",
        metavar="PATH",
        help="evaluate LAMBADA completion instead (lambada_test.jsonl or its folder)",
    )
    p.add_argument("--max-examples", type=int, help="LAMBADA: evaluate the first N passages only")
    p.set_defaults(func=run)


# long: one command's linear flow (fixed depths, LAMBADA, store, JSON), read top to bottom
def run(args: argparse.Namespace) -> int:
    from looplm.evaluate import evaluate_checkpoint
    from looplm.evaluate.records import eval_tag
    from looplm.io import atomic_write_json

    depths = parse_depths(args.depths)
    for flag, value in (("--batch-size", args.batch_size), ("--max-tokens", args.max_tokens)):
        if value is not None:
            check_positive_int(flag, value)
    if args.lambada:
        if args.dataset or args.split:
            raise LoopLMError("--lambada evaluates LAMBADA's test split; drop --dataset/--split")
        from looplm.evaluate.completion import evaluate_lambada_checkpoint

        result = evaluate_lambada_checkpoint(
            args.checkpoint,
            args.lambada,
            depths,
            max_examples=args.max_examples,
            batch_size=args.batch_size,
            device=args.device,
            progress=True,
        )
        cfg = result.pop("config")
        tag = eval_tag(args.tag, max_examples=args.max_examples)
    else:
        if args.max_examples is not None:
            raise LoopLMError("--max-examples applies to --lambada; use --max-tokens for corpora")
        result = evaluate_checkpoint(
            args.checkpoint,
            depths,
            dataset=args.dataset,
            split=args.split,
            data_dir=args.data_dir,
            max_tokens=args.max_tokens,
            batch_size=args.batch_size,
            device=args.device,
            progress=True,
        )
        from looplm.checkpoint import read_meta
        from looplm.config import config_from_dict

        cfg = config_from_dict(read_meta(args.checkpoint)["config"])
        tag = eval_tag(args.tag, max_tokens=result.get("max_tokens"))
        _add_per_byte(result, cfg, args)
    # The results are printed and written before the store is touched: a store that cannot be
    # written (full disk, read-only) loses nothing that was computed.
    if args.out:
        atomic_write_json(args.out, result)
    print(json.dumps(result, indent=2), flush=True)
    if args.store:
        stored = _store(args, result, cfg, tag)
        print(
            f"stored {stored['rows']} rows in {stored['path']} (eval_tag {tag!r}, model_hash "
            f"{stored['model_hash']}, protocol {stored['protocol']})",
            file=sys.stderr,
        )
    return 0


def _store(args: argparse.Namespace, result: dict, cfg, tag: str) -> dict:
    """Write one store row per depth through the kind that owns them: LAMBADA, another corpus
    (transfer) or the run's own (fixed); returns what the printed JSON says about them."""
    from looplm.evaluate.kinds import get_kind
    from looplm.results.store import ResultsStore

    kind = "lambada" if args.lambada else "fixed"
    if not args.lambada and result["dataset"] != cfg.data.dataset:
        kind = "transfer"
    records = get_kind(kind).depth_records(
        result["results"],
        cfg,
        dataset=result["dataset"],
        split=result["split"],
        tag=tag,
        protocol=args.protocol,
        extra={"checkpoint": str(args.checkpoint), "step": result.get("step")},
    )
    with ResultsStore(args.store) as store:
        store.put_many(records)
    return {
        "path": str(args.store),
        "rows": len(records),
        "eval_tag": tag,
        "model_hash": records[0].model_hash,
        "protocol": records[0].protocol,
    }


def _add_per_byte(result: dict, cfg, args: argparse.Namespace) -> None:
    """Loss per byte of text next to the loss per token of every depth (``nll_per_byte``), so
    models with different tokenizers compare; corpora only (a task has no text bytes)."""
    from looplm.data.cache import get_split_tokens, predicted_bytes
    from looplm.data.synthetic import TASKS

    data = cfg.data
    dataset = args.dataset or data.dataset
    if dataset in TASKS or any("accuracy" in r for r in result["results"]):
        return
    tokens = get_split_tokens(
        dataset,
        args.split or data.eval_split,
        cfg.model.tokenizer,
        args.data_dir or data.data_dir,
        data.cache_dir,
    )
    n_bytes = predicted_bytes(tokens, cfg.model.tokenizer, result.get("max_tokens"))
    for row in result["results"]:
        row["n_bytes"] = n_bytes
        row["nll_per_byte"] = row["sum_nll"] / max(n_bytes, 1)
