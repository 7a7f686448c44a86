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
