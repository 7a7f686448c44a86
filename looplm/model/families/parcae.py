"""Parcae (``ParcaeConfig``; SandyResearch/parcae-140m … -1.3b): its published ``config.json``
and ``pytorch_model.bin`` names mapped onto looplm's model.

prelude → ``N_p`` → loop of the diagonal injection and a k-layer core → ``C`` → coda → final norm
→ tied head (:mod:`looplm.model.recurrences.parcae` holds the equations). Blocks: pre-norm,
ReLU² MLP (``½·relu(x)²``), qk-norm after an interleaved RoPE (base 50000), RMSNorm ε = 1e-5,
no biases, and value embeddings in the odd layers of each stage (the gate reads the first 32
channels of the normalised block input).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.model.families.base import (
    FAMILY_CLASSES,
    Family,
    Weight,
    WeightPlan,
    layer_prefixes,
    need,
)
from looplm.settings.config import ModelConfig

# The reference's rope_settings are ignored when it loads (its default base is used).
ROPE_BASE = 50000.0
INIT_SCALES = {  # init_strategy → (embedding scale, logit scale at width d)
    "scaled-zero": lambda d: (1.0, 1.0),
    "scaled": lambda d: (1.0, 1.0),
    "takase": lambda d: (math.sqrt(d), 1.0),
    "takase-scaled": lambda d: (math.sqrt(d), math.sqrt(2 / 5) / math.sqrt(d)),
}


@FAMILY_CLASSES.register
class ParcaeFamily(Family):
    name = "parcae"
    loops_key = "mean_recurrence"
    published_keys = {  # noqa: RUF012
        "model.d_model": "n_embd",
        "model.n_heads": "num_attention_heads",
        "model.d_ff": "intermediate_size",
        "model.context": "block_size",
        "model.vocab_size": "vocab_size",
        "model.prelude_layers": "n_layers_in_prelude",
        "model.core_layers": "n_layers_in_recurrent_block",
        "model.coda_layers": "n_layers_in_coda",
        "model.norm_eps": "norm_eps",
    }
    architecture = "ParcaeConfig"
    known_keys = frozenset(
        """_class_name _is_recurrent_block_config activation_checkpoint_impl attn_impl bias
        block_class_name block_size center_attention clip_qkv curriculum_target debias_attention
        hf_config init_orthogonal init_strategy injection_type intermediate_size lockstep_k
        lockstep_n logit_softcap mean_backprop_depth mean_recurrence mlp_class_name
        model_class_name mup_model_scaling_factor n_embd n_layers_in_coda n_layers_in_prelude
        n_layers_in_recurrent_block name nonlin_name norm_class_name norm_eps num_attention_heads
        num_key_value_heads padded_vocab_size padding_multiple prelude_norm qk_bias qk_norm
        randomize_positions_from recurrent_embedding_dimension
        recurrent_intermediation_embedding_dimension recurrent_iteration_method
        recurrent_num_attention_heads rope_settings sampling_scheme simple_ops skip_initialization
        state_init strategy tie_embeddings use_abacus use_fused_head vocab_size""".split()
    )

    def detects(self, cfg: dict[str, Any]) -> bool:
        return cfg.get("_class_name") == "ParcaeConfig" or cfg.get("model_class_name") == "Parcae"

    def model_config(
        self, cfg: dict[str, Any], names: set[str] | None, path: Path | str = "config.json"
    ) -> ModelConfig:
        d, heads = need(cfg, "n_embd", path), need(cfg, "num_attention_heads", path)
        mlp = self._check(cfg, path, d, heads)
        strategy = need(cfg, "init_strategy", path, tuple(INIT_SCALES))
        emb_scale, logit_scale = INIT_SCALES[strategy](d)
        need(cfg, "state_init", path, ("like-init", "zero"))
        return ModelConfig(
            preset="tiny",
            recurrence="parcae",
            recurrence_args={
                "prelude_norm": bool(cfg.get("prelude_norm", False)),
                "norm_eps": float(need(cfg, "norm_eps", path)),
                # zero: deterministic analyses; "random" is the reference's draw (σ below)
                "state_init": "zero",
                "init_std": math.sqrt(2 / (5 * d)) * emb_scale,
            },
            vocab_size=cfg.get("padded_vocab_size") or need(cfg, "vocab_size", path),
            tokenizer="gpt2",
            d_model=d,
            n_heads=heads,
            d_ff=need(cfg, "intermediate_size", path),
            context=need(cfg, "block_size", path),
            dropout=0.0,
            reference_rounding=True,
            norm_eps=float(cfg["norm_eps"]),
            positions="rope",
            rope_base=ROPE_BASE,
            rope_layout="interleaved",
            prelude_layers=need(cfg, "n_layers_in_prelude", path),
            core_layers=need(cfg, "n_layers_in_recurrent_block", path),
            coda_layers=need(cfg, "n_layers_in_coda", path),
            qk_norm=bool(cfg.get("qk_norm", False)),
            mlp=mlp,
            emb_scale=emb_scale,
            logit_scale=logit_scale,
            logit_softcap=float(cfg.get("logit_softcap") or 0.0),
            value_embed_layers=self.value_embed_layers(cfg, names),
        )

    @staticmethod
    def _check(cfg: dict[str, Any], path: Path | str, d: int, heads: int) -> str:
        """Refuse what looplm does not compute; the MLP kind."""
        need(cfg, "num_key_value_heads", path, (heads, None))
        need(cfg, "recurrent_embedding_dimension", path, d)
        need(
            cfg, "recurrent_intermediation_embedding_dimension", path, cfg.get("intermediate_size")
        )
        need(cfg, "recurrent_num_attention_heads", path, (None, heads))
        need(cfg, "injection_type", path, "diagonal")
        need(cfg, "block_class_name", path, "TransformerPreNormBlock")
        need(cfg, "norm_class_name", path, "RMSNorm")
        mlp = {("BaseMLP", "ReLU2"): "relu2", ("GatedMLP", "SiLU"): "swiglu"}.get(
            (cfg.get("mlp_class_name"), cfg.get("nonlin_name"))
        )
        if mlp is None:
            raise LoopLMError(
                f"{path}: mlp_class_name={cfg.get('mlp_class_name')!r} with "
                f"nonlin_name={cfg.get('nonlin_name')!r} is not supported; allowed: BaseMLP+ReLU2, "
                "GatedMLP+SiLU"
            )
        for key in ("bias", "qk_bias", "use_abacus", "debias_attention", "center_attention"):
            need(cfg, key, path, (False, None))
        for key in ("clip_qkv", "randomize_positions_from"):
            need(cfg, key, path, (None,))
        need(cfg, "mup_model_scaling_factor", path, (1, None))
        need(cfg, "tie_embeddings", path, True)
        return mlp

    def value_embed_layers(self, cfg: dict[str, Any], names: set[str] | None) -> list[int]:
        """Layers whose value embedding the reference uses: the table and the gate both exist.
        The file says which exist; without one (a meta build) the reference's two rules do —
        tables where n ≡ P+C+K−1 and gates where the layer id ≡ C·mean_backprop_depth − 1 (mod 2),
        the coda's layer ids counted after P + C·mean_recurrence."""
        p, k, c = (cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"],
                   cfg["n_layers_in_coda"])  # fmt: skip
        if names is not None:
            return [
                n
                for n, src in enumerate(self._sources(cfg))
                if f"value_embeds.{n}.weight" in names and f"{src}attn.ve_gate.weight" in names
            ]
        n_layer = k * cfg["mean_backprop_depth"]
        ids = list(range(p + k)) + [p + k * cfg["mean_recurrence"] + i for i in range(c)]
        return [
            n
            for n in range(p + k + c)
            if n % 2 == (p + k + c - 1) % 2 and ids[n] % 2 == (n_layer - 1) % 2
        ]

    @staticmethod
    def _sources(cfg: dict[str, Any]) -> list[str]:
        p, k, c = (cfg["n_layers_in_prelude"], cfg["n_layers_in_recurrent_block"],
                   cfg["n_layers_in_coda"])  # fmt: skip
        return (
            [f"transformer.prelude.{i}." for i in range(p)]
            + [f"transformer.core_block.{j}." for j in range(k)]
            + [f"transformer.coda.{i}." for i in range(c)]
        )

    def weights(self, cfg: dict[str, Any], names: set[str], mc: ModelConfig) -> WeightPlan:
        d, V, ff = mc.d_model, mc.vocab_size, mc.d_ff
        hs = d // mc.n_heads
        q, kv = mc.n_heads * hs, mc.kv_heads * hs
        out = [
            Weight("tok_emb.weight", {"transformer.wte.weight": (V, d)}),
            Weight("norm_f.weight", {"transformer.ln_f.weight": (d,)}),
            Weight("recurrence.A_log", {"transformer.adapter.A_log": (d,)}),
            Weight("recurrence.dt_bias", {"transformer.adapter.dt_bias": (d,)}),
            Weight("recurrence.B", {"transformer.adapter.B": (d, d)}),
            Weight("recurrence.C.weight", {"transformer.C.weight": (d, d)}),
        ]
        if mc.recurrence_args.get("prelude_norm"):
            out.append(
                Weight("recurrence.prelude_norm.weight", {"transformer.ln_prelude.weight": (d,)})
            )
        ignored = {"freqs_cis", "lm_head.weight"}  # the RoPE table; the tied head's copy
        for n, (dst, src) in enumerate(zip(layer_prefixes(mc), self._sources(cfg), strict=True)):
            a = f"{src}attn."
            out += [
                Weight(f"{dst}norm1.weight", {f"{src}norm_1.weight": (d,)}),
                Weight(f"{dst}norm2.weight", {f"{src}norm_2.weight": (d,)}),
                Weight(
                    f"{dst}attn.qkv.weight",
                    {
                        f"{a}c_q.weight": (q, d),
                        f"{a}c_k.weight": (kv, d),
                        f"{a}c_v.weight": (kv, d),
                    },
                ),
                Weight(f"{dst}attn.proj.weight", {f"{a}c_proj.weight": (d, q)}),
            ]
            if mc.mlp == "relu2":
                out += [
                    Weight(f"{dst}mlp.up.weight", {f"{src}mlp.fc.weight": (ff, d)}),
                    Weight(f"{dst}mlp.down.weight", {f"{src}mlp.proj.weight": (d, ff)}),
                ]
            else:
                out += [
                    Weight(f"{dst}mlp.gate_up.weight", {f"{src}mlp.fc.weight": (2 * ff, d)}),
                    Weight(f"{dst}mlp.down.weight", {f"{src}mlp.proj.weight": (d, ff)}),
                ]
            if n in mc.value_embed_layers:
                out += [
                    Weight(f"{dst}attn.value_embed.weight", {f"value_embeds.{n}.weight": (V, kv)}),
                    Weight(
                        f"{dst}attn.value_gate.weight", {f"{a}ve_gate.weight": (mc.kv_heads, 32)}
                    ),
                ]
            else:  # a table without its gate (or the reverse) is read by nothing in the reference
                ignored |= {f"value_embeds.{n}.weight", f"{a}ve_gate.weight"} & names
        return WeightPlan(out, ignored)

    def loops(self, cfg: dict[str, Any]) -> int:
        """The trained mean loop count (the reference's inference default)."""
        return int(cfg.get("mean_recurrence", 8))
