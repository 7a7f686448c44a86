"""`looplm adaptive CHECKPOINT`: adaptive loop depth under a ceiling (three stopping rules).

    looplm adaptive runs/x/ckpt --rules maxtoken,kl,router --ceiling 48 --budgets 8,16,24 \\
        --split test --calib-split validation --max-tokens 8192 --store runs/results.sqlite

``maxtoken``: the paper's per-example max-token hidden-update rule, thresholds calibrated on the
calibration split to each target mean budget; ``kl``: the per-token convergence study's KL halting, one row per
threshold; ``router``: the learned linear router, one row per probability threshold. Prints a
table (PPL, achieved mean depth, FLOP proxy, wall clock) and, with ``--store``, writes one row per
rule setting (depth = the ceiling, adaptive_mode = the rule setting).
"""

from __future__ import annotations

import argparse
import json

from looplm.errors import LoopLMError, check_positive_int


def _floats(text: str, what: str) -> list[float]:
    try:
        vals = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise LoopLMError(f"{what} {text!r}: expected comma-separated numbers") from None
    if not vals:
        raise LoopLMError(f"{what} is empty")
    return vals


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "adaptive",
        help="adaptive depth: max-token stopping, per-token KL halting, linear router",
        description="Evaluate adaptive loop depth of one checkpoint under a loop ceiling; prints "
        "a table and writes results-store rows with --store.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    # Defaults live in looplm.evaluate.adaptive (not imported here: keeps `looplm --help` fast).
    p.add_argument("--rules", default="maxtoken,kl,router", help="subset of maxtoken,kl,router")
    p.add_argument("--ceiling", type=int, default=48, help="loop ceiling C (48)")
    p.add_argument("--budgets", help="maxtoken: target mean budgets (default 8,16,24)")
    p.add_argument(
        "--kl-thresholds", help="kl: halting thresholds on KL(p_t||p_{t-1}) (default 0.1..0.001)"
    )
    p.add_argument("--router-probs", help="router: halt when P(converged) >= p (0.5,0.7,0.9)")
    p.add_argument(
        "--label-threshold",
        type=float,
        help="router: convergence label = KL(p_t||p_{t-1}) below this (0.01)",
    )
    p.add_argument("--dataset", help="evaluate on another corpus (default: the run's)")
    p.add_argument("--split", default="test", help="evaluation split (test)")
    p.add_argument("--calib-split", default="validation", help="calibration split (validation)")
    p.add_argument("--data-dir", help="folder with local corpora")
    p.add_argument("--max-tokens", type=int, help="cap on evaluated tokens")
    p.add_argument("--calib-max-tokens", type=int, help="cap on calibration tokens")
    p.add_argument("--batch-size", type=int)
    p.add_argument(
        "--no-skip",
        action="store_true",
        help="per-token rules: run the dense block for every token (no work skipping)",
    )
    p.add_argument(
        "--timing-depths",
        default="",
        help="also time the uniform fixed-depth forward at these depths (e.g. 8,16,24,48)",
    )
    p.add_argument(
        "--timing-repeats", type=int, default=1, help="wall clock = min over this many passes"
    )
    p.add_argument(
        "--time-dense",
        action="store_true",
        help="per-token rules: also time the dense path (no skipping) for comparison",
    )
    p.add_argument("--device", default="auto")
    p.add_argument("--store", help="results store (.sqlite) to write the rows into")
    p.add_argument("--tag", default="", help="evaluation tag (part of the evaluation identity)")
    p.add_argument("--protocol", help="training-protocol name (default: <train dataset>-<steps>)")
    p.add_argument("--out", help="also write the JSON here (atomically)")
    p.set_defaults(func=run)


def format_table(result: dict) -> str:
    """A plain-text table of one :func:`evaluate_adaptive_checkpoint` result."""
    nan = float("nan")
    lines = [
        f"{'mode':<24} {'PPL':>10} {'mean depth':>10} {'target':>7} {'body FLOPs/tok':>15} "
        f"{'wall s':>8} {'dense s':>8}"
    ]
    for r in result["results"]:
        target = r.get("target")
        lines.append(
            f"{r['mode']:<24} {r['ppl']:>10.3f} {r['mean_depth']:>10.2f} "
            f"{(f'{target:g}' if target is not None else '-'):>7} "
            f"{r.get('flops_per_token_body', nan):>15.4g} {r['wall_clock_s']:>8.2f} "
            f"{r.get('wall_clock_dense_s', nan):>8.2f}"
        )
    for T, w in sorted(result.get("uniform_wall_clock_s", {}).items()):
        lines.append(f"{f'uniform T={T}':<24} {'':>10} {T:>10.2f} {'':>7} {'':>15} {w:>8.2f}")
    return "\n".join(lines)


def run(args: argparse.Namespace) -> int:
    if args.batch_size is not None:
        check_positive_int("--batch-size", args.batch_size)
    from looplm.device import parse_depths
    from looplm.evaluate.adaptive import evaluate_adaptive_checkpoint
    from looplm.evaluate.records import adaptive_records, eval_tag
    from looplm.io import atomic_write_json

    rules = [r.strip() for r in args.rules.split(",") if r.strip()]
    optional = {}
    if args.budgets:
        optional["budgets"] = _floats(args.budgets, "--budgets")
    if args.kl_thresholds:
        optional["kl_thresholds"] = _floats(args.kl_thresholds, "--kl-thresholds")
    if args.router_probs:
        optional["router_probs"] = _floats(args.router_probs, "--router-probs")
    if args.label_threshold is not None:
        optional["label_threshold"] = args.label_threshold
    result = evaluate_adaptive_checkpoint(
        args.checkpoint,
        rules=rules,
        ceiling=args.ceiling,
        **optional,
        dataset=args.dataset,
        split=args.split,
        calib_split=args.calib_split,
        data_dir=args.data_dir,
        max_tokens=args.max_tokens,
        calib_max_tokens=args.calib_max_tokens,
        batch_size=args.batch_size,
        skip=not args.no_skip,
        timing_repeats=args.timing_repeats,
        time_dense=args.time_dense,
        timing_depths=parse_depths(args.timing_depths) if args.timing_depths else (),
        device=args.device,
        progress=True,
    )
    cfg = result.pop("config")
    print(format_table(result))
    if args.store:
        from looplm.evaluate.kinds import get_kind
        from looplm.results.store import ResultsStore

        records = get_kind("adaptive").stamp(
            adaptive_records(
                result,
                cfg,
                tag=eval_tag(args.tag, max_tokens=args.max_tokens),
                protocol=args.protocol,
                extra={"checkpoint": str(args.checkpoint)},
            )
        )
        with ResultsStore(args.store) as store:
            store.put_many(records)
        print(f"wrote {len(records)} rows to {args.store}")
    if args.out:
        atomic_write_json(args.out, result)
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))
    return 0
