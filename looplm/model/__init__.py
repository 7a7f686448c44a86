"""Models: the shared block, the looped LM and its recurrences, the unshared control."""

from __future__ import annotations

import dataclasses
from typing import Any

from looplm.config import ModelConfig, model_config
from looplm.model.block import Block
from looplm.model.lm import LanguageModelBase, LoopedLM, LoopOutput, LoopStep
from looplm.model.recurrences import recurrence_names
from looplm.model.unshared import UnsharedLM

_MODEL_FIELDS = {f.name for f in dataclasses.fields(ModelConfig)}


def model_from_config(cfg: ModelConfig) -> LanguageModelBase:
    """Instantiate the model a validated ModelConfig describes."""
    if not cfg.is_looped:
        if cfg.recurrence_args:
            from looplm.errors import LoopLMError

            raise LoopLMError(
                f"recurrence 'unshared' takes no recurrence_args, got {sorted(cfg.recurrence_args)}"
            )
        return UnsharedLM(cfg)
    return LoopedLM(cfg)


def build_model(preset: str, recurrence: str = "scse", **overrides: Any) -> LanguageModelBase:
    """``build_model("22m", "scse", dropout=0.0, step_scale=0.4)``.

    Keyword overrides that name a ModelConfig field set it; any other keyword is a setting of the
    recurrence (validated against its Config; unknown names raise LoopLMError).
    """
    model_kw = {k: v for k, v in overrides.items() if k in _MODEL_FIELDS}
    rec_kw = {k: v for k, v in overrides.items() if k not in _MODEL_FIELDS}
    if rec_kw:
        model_kw["recurrence_args"] = {**model_kw.get("recurrence_args", {}), **rec_kw}
    cfg = model_config(preset, recurrence, **model_kw)
    if cfg.is_looped:
        from looplm.model.recurrences import get_recurrence_class

        get_recurrence_class(recurrence)  # clear error for unknown names
    return model_from_config(cfg)


__all__ = [
    "Block",
    "LoopOutput",
    "LoopStep",
    "LoopedLM",
    "UnsharedLM",
    "build_model",
    "model_from_config",
    "recurrence_names",
]
