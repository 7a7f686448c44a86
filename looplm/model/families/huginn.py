"""Huginn-0125 (``RavenForCausalLM``, model type ``huginn_raven``): its published ``config.json``
and safetensors names mapped onto looplm's model.

embedding × √E → 2 prelude blocks → loop of the concatenation adapter and a 4-block core →
final norm → 2 coda blocks → the same final norm → tied head
(:mod:`looplm.model.recurrences.huginn` holds the loop). Blocks: ``sandwich_sum`` norm placement
(the residual sums are normalised), SwiGLU, a learned bias on queries and keys, interleaved RoPE
(``rope_base``), RMSNorm ε = ``norm_eps``, no other biases.
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from looplm.model.families.base import (
    FAMILY_CLASSES,
    Family,
    Weight,
    WeightPlan,
    layer_prefixes,
    need,
)
from looplm.settings.config import ModelConfig


@FAMILY_CLASSES.register
class HuginnFamily(Family):
    name = "huginn"
    loops_key = "mean_recurrence"
    published_keys = {  # noqa: RUF012
        "model.d_model": "n_embd",
        "model.n_heads": "n_heads",
        "model.d_ff": "intermediate_size",
        "model.context": "block_size",
        "model.vocab_size": "vocab_size",
        "model.prelude_layers": "n_layers_in_prelude",
        "model.core_layers": "n_layers_in_recurrent_block",
        "model.coda_layers": "n_layers_in_coda",
        "model.norm_eps": "norm_eps",
        "model.rope_base": "rope_base",
    }
    architecture = "RavenForCausalLM"
    known_keys = frozenset(
        """activation_checkpoint_impl architecture_class_name bias block_class_name block_size
        effective_expected_depth head_dim init_orthogonal init_strategy init_values
        injection_type intermediate_size mean_backprop_depth mean_recurrence mlp_class_name
        n_embd n_heads n_layers n_layers_in_coda n_layers_in_prelude n_layers_in_recurrent_block
        nonlin_name norm_class_name norm_eps num_key_value_heads padded_vocab_size
        padding_multiple qk_bias rope_base sampling_scheme state_init tie_embeddings
        tie_word_embeddings vocab_size num_attention_heads hidden_size num_hidden_layers
        test_time_noise test_time_noise_type""".split()
    )

    def detects(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("model_type") == "huginn_raven" or "RavenForCausalLM" in (
            cfg.get("architectures") or []
        )

    def model_config(
        self, cfg: dict[str, Any], names: set[str] | None, path: Path | str = "config.json"
    ) -> ModelConfig:
        d = need(cfg, "n_embd", path)
        heads = need(cfg, "n_heads", path)
        need(cfg, "num_key_value_heads", path, (heads, None))
        need(cfg, "head_dim", path, (d // heads, None)) if "head_dim" in cfg else None
        need(cfg, "block_class_name", path, "SandwichBlock")
        need(cfg, "mlp_class_name", path, "GatedMLP")
        need(cfg, "nonlin_name", path, "SiLU")
        need(cfg, "injection_type", path, "linear")
        need(cfg, "bias", path, False)
        need(cfg, "tie_embeddings", path, True)
        if cfg.get("test_time_noise", 0):
            need(cfg, "test_time_noise", path, 0)
        need(cfg, "state_init", path, ("like-init",))
        std = math.sqrt(2 / (5 * d))  # init_values.std, times the embedding scale √E
        return ModelConfig(
            preset="tiny",
            recurrence="huginn",
            recurrence_args={
                # zero: deterministic analyses; "random" is the reference's draw (σ below)
                "state_init": "zero",
                "init_std": std * math.sqrt(d),
            },
            vocab_size=cfg.get("padded_vocab_size") or need(cfg, "vocab_size", path),
            tokenizer="gpt2",
            d_model=d,
            n_heads=heads,
            d_ff=need(cfg, "intermediate_size", path),
            context=need(cfg, "block_size", path),
            dropout=0.0,
            reference_rounding=True,
            norm_eps=float(need(cfg, "norm_eps", path)),
            positions="rope",
            rope_base=float(need(cfg, "rope_base", path)),
            rope_layout="interleaved",
            prelude_layers=need(cfg, "n_layers_in_prelude", path),
            core_layers=need(cfg, "n_layers_in_recurrent_block", path),
            coda_layers=need(cfg, "n_layers_in_coda", path),
            norm_placement="sandwich_sum",
            qk_bias=bool(need(cfg, "qk_bias", path)),
            emb_scale=math.sqrt(d),
            coda_norm=True,
        )

    def weights(self, cfg: dict[str, Any], names: set[str], mc: ModelConfig) -> WeightPlan:
        d, V, ff = mc.d_model, mc.vocab_size, mc.d_ff
        p, k, c = mc.prelude_layers, mc.core_layers, mc.coda_layers
        sources = (
            [f"transformer.prelude.{i}." for i in range(p)]
            + [f"transformer.core_block.{j}." for j in range(k)]
            + [f"transformer.coda.{i}." for i in range(c)]
        )
        out = [
            Weight("tok_emb.weight", {"transformer.wte.weight": (V, d)}),
            Weight("norm_f.weight", {"transformer.ln_f.weight": (d,)}),
            Weight("recurrence.adapter.weight", {"transformer.adapter.weight": (d, 2 * d)}),
        ]
        for dst, src in zip(layer_prefixes(mc), sources, strict=True):
            out += [
                Weight(f"{dst}norm1.weight", {f"{src}norm_1.weight": (d,)}),
                Weight(f"{dst}norm3.weight", {f"{src}norm_2.weight": (d,)}),
                Weight(f"{dst}norm2.weight", {f"{src}norm_3.weight": (d,)}),
                Weight(f"{dst}norm4.weight", {f"{src}norm_4.weight": (d,)}),
                Weight(f"{dst}attn.qkv.weight", {f"{src}attn.Wqkv.weight": (3 * d, d)}),
                Weight(f"{dst}attn.proj.weight", {f"{src}attn.proj.weight": (d, d)}),
                Weight(f"{dst}mlp.gate_up.weight", {f"{src}mlp.fc.weight": (2 * ff, d)}),
                Weight(f"{dst}mlp.down.weight", {f"{src}mlp.proj.weight": (d, ff)}),
            ]
            if mc.qk_bias:
                heads = mc.n_heads
                bias = {f"{src}attn.qk_bias": (2, 1, heads, d // heads)}
                out.append(Weight(f"{dst}attn.qk_bias", bias))
        # the RoPE table, and the tied head's stored copy
        return WeightPlan(out, {"freqs_cis", "lm_head.weight"})

    def loops(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("mean_recurrence", 32))
