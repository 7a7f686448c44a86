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

from looplm.adaptive.settings import AdaptiveInputs, AdaptiveSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (AdaptiveSettings, AdaptiveInputs)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "adaptive",
        help="adaptive depth: max-token stopping, per-token KL halting, linear router",
        description="Evaluate adaptive loop depth of one checkpoint under a loop ceiling; prints "
        "a table and writes results-store rows with --store.",
    )
    p.add_argument("checkpoint", help="checkpoint folder (e.g. runs/x/ckpt)")
    for cls in SETTINGS:
        add_options(p, cls)
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
    from looplm.adaptive.depth import evaluate_adaptive_checkpoint, store_adaptive
    from looplm.io import atomic_write_json
    from looplm.progress import progress_enabled
    from looplm.settings.limits import check_output_file

    settings, inputs = from_args(AdaptiveSettings, args), from_args(AdaptiveInputs, args)
    check_output_file("--out", inputs.out)  # before the evaluation, not after it
    result = evaluate_adaptive_checkpoint(
        args.checkpoint,
        settings,
        dataset=inputs.dataset,
        split=inputs.split,
        data_dir=inputs.data_dir,
        max_tokens=inputs.max_tokens,
        batch_size=inputs.batch_size,
        device=inputs.device,
        progress=progress_enabled(),  # a terminal, unless LOOPLM_NO_PROGRESS=1
    )
    cfg = result.pop("config")
    print(format_table(result))
    if inputs.store:
        n = store_adaptive(result, cfg, inputs.store, tag=inputs.tag, protocol=inputs.protocol)
        print(f"wrote {n} rows to {inputs.store}")
    if inputs.out:
        atomic_write_json(inputs.out, result)
    else:
        print(json.dumps({k: v for k, v in result.items() if k != "results"}, indent=2))
    return 0
