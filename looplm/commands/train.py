"""`looplm train CONFIG [key=value …] [--resume]`."""

from __future__ import annotations

import argparse
import json
import os

from looplm.settings.options import add_options, from_args
from looplm.training.settings import TrainSettings

SETTINGS = (TrainSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    from looplm.settings.config import config_names

    p = sub.add_parser(
        "train",
        help="train a model from a YAML config (+ key=value overrides)",
        description="Train a looped LM. CONFIG is a YAML file or the name of one shipped with "
        "looplm; override any setting (docs/configuration.md) with key=value, e.g. train.steps=200"
        " out_dir=runs/x; init=CKPT fine-tunes a checkpoint (docs/finetune.md). A folder that "
        "already holds a checkpoint is refused unless --resume (continue it) or --overwrite "
        "(replace it) is given.",
    )
    p.add_argument("config", help=f"YAML config path, or one of: {', '.join(config_names())}")
    p.add_argument("overrides", nargs="*", help="dotted key=value overrides")
    add_options(p, TrainSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.training.finetune import finetune_report, load_run_config
    from looplm.training.loop import fit
    from looplm.training.run_folder import check_out_dir

    s = from_args(TrainSettings, args)  # --resume with --overwrite: one line naming both
    cfg = load_run_config(args.config, args.overrides)
    check_out_dir(cfg, resume=s.resume, overwrite=s.overwrite)
    last = fit(cfg, resume=s.resume, progress=None if s.progress else False)
    if last.get("stopped") == "signal":  # the shell's convention for a run ended by a signal
        return 128 + int(last["signal"])
    if int(os.environ.get("RANK", "0")) != 0:  # under torchrun only rank 0 reports
        return 0
    keys = ("step", "loss", "val_loss", "val_accuracy", "val_loops")
    print(json.dumps({k: last[k] for k in keys if k in last}))
    print(f"checkpoint: {cfg.out_dir}/ckpt")
    if cfg.init:  # the depth response (and an exit gate's distribution) before and after
        print(f"report: {finetune_report(cfg)}")
    return 0
