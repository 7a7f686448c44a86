"""``transformers`` wrapper of a looplm model (written into every ``looplm export`` folder).

    model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True)
    logits = model(input_ids, loops=12).logits          # the loop depth is a call-time argument
    out = model.generate(input_ids, max_new_tokens=20, loops=12)

This file holds no model code. A plain export copies it as it is, and the model is built by the
installed ``looplm`` package (a version that knows the exported config's fields). ``looplm export
--standalone`` instead writes this wrapper with looplm's model code pasted above it
(:mod:`looplm.decoding.hf.standalone`), so that folder needs only torch and transformers. Either way there
is one implementation. ``generate()`` uses looplm's own per-block-application KV cache (exact for
looped models; passed through ``past_key_values``) for greedy and sampled decoding;
``use_cache=False`` recomputes the prefix every step (needed for beam search; the only path for
unshared models). Past the context window generation slides: the last ``max_position_embeddings``
tokens are re-read. Padding is not supported (the model has no attention mask): batch prompts of
equal length.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from transformers import GenerationMixin, PreTrainedModel
from transformers.modeling_outputs import CausalLMOutputWithPast

from .configuration_looplm import LoopLMConfig

try:
    from looplm.decoding.decoder import StaticKVCache, cached_hidden
    from looplm.model import model_from_config
    from looplm.settings.config import model_config
    from looplm.targets import IGNORE_INDEX
except ImportError as exc:  # pragma: no cover - depends on the loading environment
    raise ImportError(
        "this exported model runs on the looplm package: pip install looplm (from the repository "
        "the model was exported with)"
    ) from exc


class LoopLMCache(StaticKVCache):
    """looplm's KV cache (one slot per block application, ``capacity`` positions) plus the
    window start: the cached positions are ``tokens[start:]``."""

    def __init__(self, capacity: int, start: int = 0) -> None:
        super().__init__(capacity)
        self.start = start

    def get_seq_length(self, layer_idx: int = 0) -> int:
        return self.start + self.length

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        self.index_rows(beam_idx)


class LoopLMForCausalLM(PreTrainedModel, GenerationMixin):
    config_class = LoopLMConfig
    base_model_prefix = "model"
    main_input_name = "input_ids"
    supports_gradient_checkpointing = False

    def __init__(self, config: LoopLMConfig) -> None:
        super().__init__(config)
        m = dict(config.looplm_model or {})
        if "preset" not in m or "recurrence" not in m:
            raise ValueError("config.looplm_model must hold a looplm ModelConfig (preset, ...)")
        self.model = model_from_config(model_config(m.pop("preset"), m.pop("recurrence"), **m))
        self.post_init()

    def _init_weights(self, module: torch.nn.Module) -> None:
        """looplm initialises its own modules; exported weights replace them."""

    def get_input_embeddings(self) -> torch.nn.Module:
        return self.model.tok_emb

    def get_output_embeddings(self) -> None:
        return None  # the readout is tied to the token embedding inside looplm

    @classmethod
    def _supports_default_dynamic_cache(cls) -> bool:
        return False  # looplm's cache has one slot per block application, not per layer

    def forward(
        self,
        input_ids: torch.LongTensor,
        attention_mask: torch.Tensor | None = None,
        loops: int | None = None,
        past_key_values: LoopLMCache | None = None,
        use_cache: bool | None = None,
        labels: torch.LongTensor | None = None,
        logits_to_keep: int = 0,
        **kwargs,
    ) -> CausalLMOutputWithPast:
        """input_ids (B, L) → logits (B, L, V) at loop depth ``loops`` (default ``config.loops``).

        With ``past_key_values`` (a :class:`LoopLMCache`) ``input_ids`` are only the new tokens;
        ``use_cache=True`` returns the cache. ``labels`` (B, L) give the mean next-token loss.
        """
        T = int(self.config.loops if loops is None else loops)
        if attention_mask is not None and not bool(attention_mask.bool().all()):
            raise ValueError("looplm models take no padding: batch prompts of equal length")
        cache = past_key_values
        if cache is None and use_cache and getattr(self.model, "is_looped", False):
            cache = LoopLMCache(self.model.config.context)
        if cache is not None:
            h = cached_hidden(self.model, input_ids, T, cache)
        else:
            (h,) = self.model.hidden_states(input_ids, T)
        if logits_to_keep:
            h = h[:, -logits_to_keep:]
        logits = self.model.readout(h)
        loss = None
        if labels is not None:
            loss = F.cross_entropy(
                logits[:, :-1].flatten(0, 1).float(),
                labels[:, 1:].flatten(),
                ignore_index=IGNORE_INDEX,
            )
        return CausalLMOutputWithPast(loss=loss, logits=logits, past_key_values=cache)

    def prepare_inputs_for_generation(
        self,
        input_ids: torch.LongTensor,
        past_key_values: LoopLMCache | None = None,
        attention_mask: torch.Tensor | None = None,
        use_cache: bool | None = None,
        loops: int | None = None,
        **kwargs,
    ) -> dict:
        """Feed only the tokens the cache lacks; re-read the last window when the context is
        full (a fresh cache from position 0: looplm's positions are absolute)."""
        context = self.model.config.context
        n = input_ids.shape[1]
        cached = use_cache is not False and getattr(self.model, "is_looped", False)
        inputs = {"attention_mask": attention_mask, "loops": loops, "use_cache": bool(cached)}
        if not cached:
            return {**inputs, "input_ids": input_ids[:, -context:]}
        cache = past_key_values
        if cache is None or cache.length >= context or cache.start + cache.length >= n:
            cache = LoopLMCache(context, start=max(0, n - context))
        return {
            **inputs,
            "input_ids": input_ids[:, cache.start + cache.length :],
            "past_key_values": cache,
        }
