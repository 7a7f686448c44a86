"""``transformers`` configuration of an exported looplm model (copied into every export folder).

``looplm_model`` is the looplm ``ModelConfig`` as a dict (the architecture: recurrence, widths,
context, …); ``loops`` is the default loop depth T, which ``model(input_ids, loops=T)`` and
``model.generate(input_ids, loops=T)`` override per call. The other fields mirror the model for
tools that read the usual names (``vocab_size``, ``hidden_size``, ``max_position_embeddings``).
"""

from __future__ import annotations

from typing import Any

try:  # transformers >= 5 names it PreTrainedConfig; 4.x only has the PretrainedConfig spelling
    from transformers import PreTrainedConfig
except ImportError:  # pragma: no cover - transformers 4.x
    from transformers import PretrainedConfig as PreTrainedConfig


class LoopLMConfig(PreTrainedConfig):
    model_type = "looplm"

    looplm_model: dict[str, Any] | None = None
    loops: int = 8
    vocab_size: int = 50257
    hidden_size: int = 384
    num_attention_heads: int = 6
    max_position_embeddings: int = 128
    tie_word_embeddings: bool = False  # the readout reuses the token embedding inside looplm
    use_cache: bool = True
