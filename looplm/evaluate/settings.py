"""The settings of ``looplm eval``: one checkpoint at several loop depths (the fixed-depth sweep,
held-out transfer or LAMBADA), read by the command and by :func:`looplm.evaluate.checkpoint.
evaluate_one` alike (:mod:`looplm.settings.options` makes the command line from it). Light (no torch)."""

from __future__ import annotations

from dataclasses import dataclass, field

from looplm.device import DEVICES
from looplm.errors import LoopLMError, check_positive_int
from looplm.settings import parse_depths, setting

DEFAULT_DEPTHS = [4, 8, 12, 16, 24, 32, 48]  # the fixed-depth sweep every run gets


@dataclass
class EvaluateSettings:
    """The common keys under ``evaluate`` (the fixed-depth sweep every run gets)."""

    split: str = "test"  # evaluation split of the fixed-depth and adaptive evaluations
    # cap on scored tokens (part of the eval tag); null: the whole split
    max_tokens: int | None = None
    # loop depths, a list or a string like "1-8,16"
    depths: list[int] | str = field(default_factory=lambda: list(DEFAULT_DEPTHS))
    batch_size: int | None = None  # evaluation batch size (default: the run's eval.batch_size)
    tag: str = ""  # evaluation tag, part of every row's identity


@dataclass
class EvalSettings:
    """``looplm eval``: which depths, on which data, where the rows go."""

    # loop depths, comma-separated or as ranges (1-48)
    depths: list[int] = setting(list(DEFAULT_DEPTHS), lo=1, loops=True, parse=parse_depths)
    # the largest loop depth accepted (default: the usual ceiling, 256, or $LOOPLM_MAX_LOOPS)
    max_loops: int | None = setting(None, lo=1, raises_ceiling=True)
    # evaluate on another dataset (held-out transfer): a corpus name (wikitext-2, c4, …) or
    # text:PATH, a local .txt / .jsonl file
    dataset: str | None = None
    split: str | None = None  # evaluation split (default: the run's eval split)
    data_dir: str | None = None  # folder with local corpora
    # cap on evaluated tokens (>= 1, checked with the option's name)
    max_tokens: int | None = setting(None, hi=10**12)
    # sequences per batch (>= 1; default: the run's eval batch size)
    batch_size: int | None = setting(None, hi=65_536)
    device: str = setting("auto", choices=DEVICES)  # auto | cpu | cuda
    # run every full batch through one compiled graph (torch.compile: the unroll and every
    # depth's readout, compiled once, the last partial batch eager); off by default: compiling
    # costs tens of seconds, which only a long sweep (a GPU, many batches) earns back
    compile: bool = False
    out: str | None = None  # also write the JSON here (atomically)
    store: str | None = None  # results store (.sqlite) to write one row per depth into
    tag: str = ""  # evaluation tag (part of the evaluation identity)
    protocol: str | None = None  # training-protocol name (default: <train dataset>-<steps>)
    # evaluate LAMBADA completion instead (lambada_test.jsonl or its folder)
    lambada: str | None = None
    max_examples: int | None = setting(None, lo=1)  # LAMBADA: evaluate the first N passages only

    def validate(self) -> None:
        if not self.depths:
            raise LoopLMError("--depths is empty; give loop depths like 1,2,4 or 1-48")
        # named as options: the eval settings are the command's (``--batch-size=0``)
        for flag, value in (("--batch-size", self.batch_size), ("--max-tokens", self.max_tokens)):
            if value is not None:
                check_positive_int(flag, value)
        if self.lambada and (self.dataset or self.split):
            raise LoopLMError("--lambada evaluates LAMBADA's test split; drop --dataset/--split")
        if self.lambada and self.compile:
            raise LoopLMError("--compile applies to the fixed-depth sweep, not to --lambada")
        if not self.lambada and self.max_examples is not None:
            raise LoopLMError("--max-examples applies to --lambada; use --max-tokens for corpora")


@dataclass
class DataSettings:
    """The data a checkpoint analysis (``looplm diagnose``, ``looplm lens``) draws its inputs
    from: the checkpoint's own unless given."""

    # corpus (e.g. wikitext-2, a local text file) or synthetic task (bool_logic); default: the
    # checkpoint's own data config
    data: str | None = None
    data_dir: str | None = None  # folder with local corpora (e.g. ../shared/data)
    cache_dir: str | None = None  # token cache folder
    split: str | None = None  # split to draw inputs from (default: the run's eval split)
    # window length for corpora (default: context)
    seq_len: int | None = setting(None, lo=1, hi=1_048_576)
