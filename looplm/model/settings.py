"""The options of the model layer's commands as settings dataclasses (``looplm import``,
``looplm methods``, ``looplm params``): :mod:`looplm.settings.options` makes each command line
from its dataclass. Light on purpose: the command line imports it at start-up (no torch)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.settings import setting

DTYPES = ("float32", "bfloat16", "float16")


@dataclass
class ImportSettings:
    """``looplm import SRC OUT``: how the weights are written."""

    # convert the weights (default: keep the stored dtype)
    dtype: str | None = setting(None, choices=DTYPES)
    # the model's tokenizer.json (or a folder holding one), or gpt2 (default: SRC's
    # tokenizer.json; without one, GPT-2's when the vocabulary holds it, else an error)
    tokenizer: str | None = None
    overwrite: bool = False  # replace OUT when it is a looplm checkpoint folder (never other files)


@dataclass
class MethodsSettings:
    """``looplm methods``: the preset the parameter counts are taken at, and the format."""

    preset: str = "22m"  # preset for the parameter counts (22m)
    json: bool = False  # print JSON instead of a table


@dataclass
class ParamsSettings:
    """``looplm params [key=value …]``: which model is counted, and the format."""

    preset: str = "22m"  # model preset (22m)
    method: str = "scse"  # recurrence name (scse); see `looplm methods`
    json: bool = False  # print JSON
