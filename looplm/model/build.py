"""Building a model: from a validated :class:`~looplm.settings.config.ModelConfig`, or from a preset
name and a method with keyword overrides."""

from __future__ import annotations

import dataclasses
from typing import Any

from looplm.model.lm import LanguageModelBase, LoopedLM
from looplm.model.unshared import UnsharedLM
from looplm.settings.config import ModelConfig, model_config

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
