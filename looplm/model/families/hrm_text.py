"""HRM-Text (``HrmTextForCausalLM``, Sapient's HRM-Text-1B): its published ``config.json`` and
safetensors names mapped onto looplm's model.

No prelude or coda: the looped core holds the low-level stack's layers then the high-level
stack's (``core_layers`` = 2 × ``num_layers_per_stack``), and the two-state cycle is
:mod:`looplm.model.recurrences.hrm_text` (``L_cycles`` inner steps per loop step; the loop count
is ``H_cycles``). The embedding is scaled by ``embedding_scale``; the untied head reads z_H, which
the high-level stack's closing norm has already normalised (no final norm). Blocks: pre-norm,
RMSNorms without gain, output-gated attention (``gate_proj``), SwiGLU, rotate-half RoPE, plain
multi-head attention, no biases.

The config's trap: a saved config's ``num_hidden_layers`` is the number of attention
invocations per pass (``num_layers_per_stack · H_cycles · (L_cycles + 1)``, the reference's KV
slot count), not a layer count; the layers per stack are ``num_layers_per_stack`` (a config
without it is one never constructed by the reference, whose ``num_hidden_layers`` is then the
per-stack count, as the reference reads it). ``prefix_lm`` only matters with ``token_type_ids``
(a bidirectional prompt block), which looplm does not take: looplm runs the causal model, which
is what the reference runs on plain token ids.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.model.families.base import (
    FAMILY_CLASSES,
    Family,
    Weight,
    WeightPlan,
    hf_rope_base,
    need,
)
from looplm.settings.config import ModelConfig

STACKS = ("L_module", "H_module")  # looplm's core: the low-level layers first


@FAMILY_CLASSES.register
class HrmTextFamily(Family):
    name = "hrm_text"
    loops_key = "H_cycles"
    published_keys = {  # noqa: RUF012
        "model.d_model": "hidden_size",
        "model.n_heads": "num_attention_heads",
        "model.d_ff": "intermediate_size",
        "model.context": "max_position_embeddings",
        "model.vocab_size": "vocab_size",
        "model.core_layers": "num_hidden_layers",
        "model.norm_eps": "rms_norm_eps",
    }
    architecture = "HrmTextForCausalLM"
    known_keys = frozenset(
        """attention_bias attention_dropout embedding_scale head_dim hidden_act hidden_size
        intermediate_size max_position_embeddings mlp_bias num_attention_heads
        num_hidden_layers num_key_value_heads num_layers_per_stack prefix_lm rms_norm_eps
        rope_parameters rope_scaling rope_theta tie_word_embeddings vocab_size H_cycles
        L_cycles L_bp_cycles L_bp_steps""".split()
    )  # L_bp_*: which inner steps train with gradients (no effect at inference)

    def detects(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("model_type") == "hrm_text" or "HrmTextForCausalLM" in (
            cfg.get("architectures") or []
        )

    @staticmethod
    def layers_per_stack(cfg: dict[str, Any], path: Path | str) -> int:
        """The real layer count of each stack (see the module docstring's trap)."""
        if cfg.get("num_layers_per_stack") is not None:
            return int(need(cfg, "num_layers_per_stack", path))
        return int(need(cfg, "num_hidden_layers", path))

    @staticmethod
    def rope_base(cfg: dict[str, Any], path: Path | str) -> float:
        rope = cfg.get("rope_parameters")
        if rope is None:
            return hf_rope_base(cfg, path)
        need(rope, "rope_type", path, "default")
        return float(need(rope, "rope_theta", path))

    def model_config(
        self, cfg: dict[str, Any], names: set[str] | None, path: Path | str = "config.json"
    ) -> ModelConfig:
        d = need(cfg, "hidden_size", path)
        heads = need(cfg, "num_attention_heads", path)
        need(cfg, "head_dim", path, d // heads) if "head_dim" in cfg else None
        if cfg.get("num_key_value_heads") is not None:
            need(cfg, "num_key_value_heads", path, heads)
        need(cfg, "hidden_act", path, "silu")
        for key in ("attention_bias", "mlp_bias"):
            if key in cfg:
                need(cfg, key, path, False)
        layers = self.layers_per_stack(cfg, path)
        if layers < 1:
            raise LoopLMError(f"{path}: num_layers_per_stack={layers} must be >= 1")
        scale = cfg.get("embedding_scale")
        if scale is None:  # the reference's default: the inverse of the init std
            scale = 1.0 / float(cfg.get("initializer_range", 0.02))
        eps = float(need(cfg, "rms_norm_eps", path))
        return ModelConfig(
            preset="tiny",
            recurrence="hrm_text",
            recurrence_args={"inner_steps": int(cfg.get("L_cycles", 3)), "norm_eps": eps},
            vocab_size=need(cfg, "vocab_size", path),
            tokenizer="gpt2",
            d_model=d,
            n_heads=heads,
            d_ff=need(cfg, "intermediate_size", path),
            context=need(cfg, "max_position_embeddings", path),
            dropout=0.0,
            reference_rounding=True,
            norm_eps=eps,
            positions="rope",
            rope_base=self.rope_base(cfg, path),
            core_layers=2 * layers,
            norm_placement="pre",
            attn_gate=True,
            norm_weight=False,
            emb_scale=float(scale),
            tie_head=bool(cfg.get("tie_word_embeddings", False)),
            final_norm=False,
        )

    def weights(self, cfg: dict[str, Any], names: set[str], mc: ModelConfig) -> WeightPlan:
        d, V, ff = mc.d_model, mc.vocab_size, mc.d_ff
        n = mc.core_layers // 2
        out = [
            Weight("tok_emb.weight", {"model.embed_tokens.weight": (V, d)}),
            Weight("recurrence.z_L_init", {"model.z_L_init": (d,)}),
        ]
        ignored: set[str] = set()
        if mc.tie_head:
            ignored.add("lm_head.weight")  # a tied head's copy, when saved
        else:
            out.append(Weight("lm_head.weight", {"lm_head.weight": (V, d)}))
        for s, stack in enumerate(STACKS):
            for i in range(n):
                src, dst = f"model.{stack}.layers.{i}.", f"block.layers.{s * n + i}."
                # The published attention input projection is fused: rows [gate; q; k; v].
                gqkv = {f"{src}attn.gqkv_proj.weight": (4 * d, d)}
                (fused,) = gqkv
                out += [
                    Weight(f"{dst}attn.gate.weight", gqkv, {fused: (0, d)}),
                    Weight(f"{dst}attn.qkv.weight", gqkv, {fused: (d, 4 * d)}),
                    Weight(f"{dst}attn.proj.weight", {f"{src}attn.o_proj.weight": (d, d)}),
                    Weight(
                        f"{dst}mlp.gate_up.weight", {f"{src}mlp.gate_up_proj.weight": (2 * ff, d)}
                    ),
                    Weight(f"{dst}mlp.down.weight", {f"{src}mlp.down_proj.weight": (d, ff)}),
                ]
        return WeightPlan(out, ignored)

    def loops(self, cfg: dict[str, Any]) -> int:
        return int(cfg.get("H_cycles", 2))
