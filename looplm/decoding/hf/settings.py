"""The settings of ``looplm export`` and :func:`looplm.decoding.hf.export_checkpoint`, one dataclass (the
command line is made from it)."""

from __future__ import annotations

from dataclasses import dataclass

from looplm.settings import setting


@dataclass
class ExportSettings:
    """How a checkpoint is exported as a Hugging Face ``transformers`` folder."""

    # default loop depth T of the exported model (default: the training ceiling train.depth_max)
    loops: int | None = setting(None, lo=1, cap=4096, what="the loop depth T")
    # replace a previous export in OUT (its own files only; other files stay)
    overwrite: bool = False
    standalone: bool = False  # model code that loads without looplm (only torch and transformers)
