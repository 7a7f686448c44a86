"""The settings of ``looplm import`` and :func:`looplm.model.families.import_pretrained`, one
dataclass (the command line is made from it)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.settings import setting


@dataclass
class ImportSettings:
    """How a published checkpoint is written as a looplm checkpoint folder."""

    # convert the weights (default: keep the stored dtype)
    dtype: str | None = setting(None, choices=("float32", "bfloat16", "float16"))
    # the model's tokenizer.json (or a folder holding one), or gpt2 (default: SRC's
    # tokenizer.json; without one, GPT-2's when the vocabulary holds it, else an error)
    tokenizer: str | None = None
    overwrite: bool = False  # replace OUT when it is a looplm checkpoint folder (never other files)
