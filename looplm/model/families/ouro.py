"""Ouro (``OuroForCausalLM``, ByteDance Ouro-1.4B / 2.6B): its published ``config.json`` and
safetensors names mapped onto looplm's model.

No prelude or coda: the whole layer stack is the looped core, the final norm closes every loop
step and the exit gate reads each step's state (:mod:`looplm.model.recurrences.ouro`); the untied
head reads the last state without a further norm. Blocks: ``sandwich`` norm placement (the
sublayer outputs are normalised), SwiGLU, rotate-half RoPE (``rope_theta``), grouped-query heads
when ``num_key_value_heads`` < ``num_attention_heads``, no biases.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looplm.model.families.base import (
    FAMILY_CLASSES,
    Family,
    Weight,
    WeightPlan,
    hf_rope_base,
    layer_prefixes,
    need,
)
from looplm.settings.config import ModelConfig


@FAMILY_CLASSES.register
class OuroFamily(Family):
    name = "ouro"
    loops_key = "total_ut_steps"
    published_keys = {  # noqa: RUF012
        "model.d_model": "hidden_size",
        "model.n_heads": "num_attention_heads",
        "model.n_kv_heads": "num_key_value_heads",
        "model.d_ff": "intermediate_size",
        "model.context": "max_position_embeddings",
        "model.vocab_size": "vocab_size",
        "model.core_layers": "num_hidden_layers",
        "model.norm_eps": "rms_norm_eps",
    }
    architecture = "OuroForCausalLM"
    known_keys = frozenset(
        """attention_dropout early_exit_threshold early_exit_step head_dim hidden_act hidden_size
        intermediate_size layer_types max_position_embeddings max_window_layers
        num_attention_heads num_hidden_layers num_key_value_heads rms_norm_eps rope_scaling
        rope_theta sliding_window tie_word_embeddings total_ut_steps use_sliding_window
        vocab_size chunk_size""".split()
    )

    def detects(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("model_type") == "ouro" or "OuroForCausalLM" in (
            cfg.get("architectures") or []
        )

    def model_config(
        self, cfg: dict[str, Any], names: set[str] | None, path: Path | str = "config.json"
    ) -> ModelConfig:
        d = need(cfg, "hidden_size", path)
        heads = need(cfg, "num_attention_heads", path)
        if "head_dim" in cfg:
            need(cfg, "head_dim", path, d // heads)
        need(cfg, "hidden_act", path, "silu")
        need(
            cfg, "use_sliding_window", path, (False, None)
        ) if "use_sliding_window" in cfg else None
        kinds = set(cfg.get("layer_types") or ["full_attention"])
        if kinds != {"full_attention"}:
            need({"layer_types": sorted(kinds)}, "layer_types", path, ["full_attention"])
        eps = float(need(cfg, "rms_norm_eps", path))
        return ModelConfig(
            preset="tiny",
            recurrence="ouro",
            recurrence_args={"norm_eps": eps},
            vocab_size=need(cfg, "vocab_size", path),
            tokenizer="gpt2",
            d_model=d,
            n_heads=heads,
            n_kv_heads=cfg.get("num_key_value_heads") or heads,
            d_ff=need(cfg, "intermediate_size", path),
            context=need(cfg, "max_position_embeddings", path),
            dropout=0.0,
            reference_rounding=True,
            norm_eps=eps,
            positions="rope",
            rope_base=hf_rope_base(cfg, path),
            core_layers=need(cfg, "num_hidden_layers", path),
            norm_placement="sandwich",
            tie_head=bool(cfg.get("tie_word_embeddings", False)),
            final_norm=False,
        )

    def weights(self, cfg: dict[str, Any], names: set[str], mc: ModelConfig) -> WeightPlan:
        d, V, ff = mc.d_model, mc.vocab_size, mc.d_ff
        hs = d // mc.n_heads
        q, kv = mc.n_heads * hs, mc.kv_heads * hs
        out = [
            Weight("tok_emb.weight", {"model.embed_tokens.weight": (V, d)}),
            Weight("recurrence.norm.weight", {"model.norm.weight": (d,)}),
            Weight("recurrence.exit_gate.weight", {"model.early_exit_gate.weight": (1, d)}),
            Weight("recurrence.exit_gate.bias", {"model.early_exit_gate.bias": (1,)}),
        ]
        ignored: set[str] = set()
        if mc.tie_head:
            ignored.add("lm_head.weight")
        else:
            out.append(Weight("lm_head.weight", {"lm_head.weight": (V, d)}))
        for i, dst in enumerate(layer_prefixes(mc)):
            src = f"model.layers.{i}."
            a, m = f"{src}self_attn.", f"{src}mlp."
            out += [
                Weight(f"{dst}norm1.weight", {f"{src}input_layernorm.weight": (d,)}),
                Weight(f"{dst}norm3.weight", {f"{src}input_layernorm_2.weight": (d,)}),
                Weight(f"{dst}norm2.weight", {f"{src}post_attention_layernorm.weight": (d,)}),
                Weight(f"{dst}norm4.weight", {f"{src}post_attention_layernorm_2.weight": (d,)}),
                Weight(
                    f"{dst}attn.qkv.weight",
                    {
                        f"{a}q_proj.weight": (q, d),
                        f"{a}k_proj.weight": (kv, d),
                        f"{a}v_proj.weight": (kv, d),
                    },
                ),  # fmt: skip
                Weight(f"{dst}attn.proj.weight", {f"{a}o_proj.weight": (d, q)}),
                Weight(
                    f"{dst}mlp.gate_up.weight",
                    {f"{m}gate_proj.weight": (ff, d), f"{m}up_proj.weight": (ff, d)},
                ),
                Weight(f"{dst}mlp.down.weight", {f"{m}down_proj.weight": (d, ff)}),
            ]
        return WeightPlan(out, ignored)

    def loops(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("total_ut_steps", 4))
