"""looplm's model written with vLLM's layers, for checkpoints written by ``looplm export``.

The loop is looplm's own: the recurrence module (:mod:`looplm.model.recurrences`), unrolled by
:meth:`LoopedLM.unroll <looplm.model.lm.LoopedLM.unroll>` and finished (exit map, coda) by
:meth:`LoopedLM.finish <looplm.model.lm.LoopedLM.finish>` — the same methods, bound to this
model's modules — calls the shared core through looplm's :class:`~looplm.model.block.BlockCall`. What differs is the core: each Transformer layer here is a
:class:`VllmBlock` whose projections are vLLM's tensor-parallel linear layers, whose norms are
vLLM's ``RMSNorm``, whose rotation is vLLM's rotary embedding and whose attention is vLLM's paged
``Attention``.

Every block application of a forward pass (prelude layers, then each (loop step, core layer), then
coda layers: looplm's KV-cache slot order) has an ``Attention`` module — hence a paged KV cache —
of its own (``slots``); the projection weights of the core are stored once and shared by all its
applications. The number of applications is counted once at construction by running the
recurrence's own step on a stand-in core, so recurrences that call the core several times per
step (controls, HRM-Text's two stacks) get one cache per call.

vLLM hands the model a flat batch of tokens (N, d) from many requests; looplm's recurrences work
per token, so they see it as one row (1, N, d), and only attention mixes positions (vLLM's
attention keeps each request to its own keys). The readout is looplm's: ``final_norm``, the tied or
untied head, ``logit_scale``, then ``logit_softcap``.

The depth is fixed per served model: ``config.loops`` (the export's default, or vLLM's
``--hf-overrides '{"loops": T}'``). Per-token halting is not offered: vLLM schedules whole forward
passes.
"""

from __future__ import annotations

from collections.abc import Iterable

import torch
import torch.nn.functional as F
from torch import nn
from vllm.config import VllmConfig
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.model_executor.layers.activation import SiluAndMul
from vllm.model_executor.layers.attention import Attention
from vllm.model_executor.layers.layernorm import RMSNorm
from vllm.model_executor.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from vllm.model_executor.layers.logits_processor import LogitsProcessor
from vllm.model_executor.layers.rotary_embedding import get_rope
from vllm.model_executor.layers.vocab_parallel_embedding import (
    ParallelLMHead,
    VocabParallelEmbedding,
)
from vllm.model_executor.model_loader.weight_utils import default_weight_loader

from looplm.errors import LoopLMError
from looplm.model.block import BlockCall, Core, KVSlot
from looplm.model.lm import LanguageModelBase, LoopedLM, check_loops
from looplm.model.recurrences import build_recurrence
from looplm.settings.config import ModelConfig, model_config

__all__ = ["LoopLMForCausalLM", "VllmBlock", "looplm_config"]


def looplm_config(hf_config) -> tuple[ModelConfig, int]:
    """(the looplm ``ModelConfig``, the served depth T) from an export's ``config.json``."""
    m = dict(getattr(hf_config, "looplm_model", None) or {})
    if "preset" not in m or "recurrence" not in m:
        raise LoopLMError(
            "config.json has no looplm_model (preset, recurrence, …): serve a folder written by "
            "looplm export"
        )
    cfg = model_config(m.pop("preset"), m.pop("recurrence"), **m)
    loops = getattr(hf_config, "loops", None)
    if isinstance(loops, float) and loops.is_integer():
        loops = int(loops)
    try:
        T = check_loops(loops)
    except LoopLMError:
        raise LoopLMError(
            f"loops={loops!r} (config.json or --hf-overrides): the served loop depth must be an "
            "integer >= 1"
        ) from None
    if cfg.attention != "causal":
        raise LoopLMError(
            f"model.attention={cfg.attention!r}: vLLM serves causal attention only (a data-given "
            "attention mask cannot be paged)"
        )
    return cfg, T


class _Slots:
    """What looplm's :class:`BlockCall` takes as its KV cache: slot i is the i-th block
    application of the pass, here the i-th vLLM ``Attention`` module; ``positions`` the flat
    batch's token positions (read by the rotary embedding)."""

    row_subsets = False

    def __init__(self, attention: nn.ModuleList, positions: torch.Tensor) -> None:
        self.attention, self.positions = attention, positions


class _Stand(nn.Module):
    """A stand-in layer for counting block applications: G(x) = 0."""

    n_layers = 1

    def forward(self, x: torch.Tensor, **kw) -> torch.Tensor:
        return torch.zeros_like(x)

    def advance(self, x: torch.Tensor, **kw) -> torch.Tensor:
        return x


class VllmAttention(nn.Module):
    """looplm's ``CausalSelfAttention`` (its options: grouped-query heads, query/key bias, rotary
    layouts, query/key norm, output gate, value embeddings) on vLLM's layers; the KV cache is
    the ``Attention`` module of the slot each call is given."""

    def __init__(self, cfg: ModelConfig, value_embed: bool, prefix: str) -> None:
        super().__init__()
        tp = get_tensor_model_parallel_world_size()
        self.d = cfg.d_model
        self.total_heads = cfg.n_heads
        self.total_kv = cfg.kv_heads or cfg.n_heads
        if self.total_heads % tp or (self.total_kv % tp and tp % self.total_kv):
            raise LoopLMError(
                f"tensor parallel size {tp} must divide the {self.total_heads} query heads and "
                f"divide or be a multiple of the {self.total_kv} key/value heads"
            )
        self.hs = cfg.d_model // cfg.n_heads
        self.heads = self.total_heads // tp
        self.kv_heads = max(1, self.total_kv // tp)
        # key/value heads this rank holds: the block of kv_heads starting here
        self.kv_start = (get_tensor_model_parallel_rank() // max(1, tp // self.total_kv)) * (
            self.kv_heads
        )
        self.q_size, self.kv_size = self.heads * self.hs, self.kv_heads * self.hs
        self.qkv = QKVParallelLinear(
            self.d,
            self.hs,
            self.total_heads,
            self.total_kv,
            bias=cfg.qk_bias,  # the value rows' bias is loaded as zeros (looplm's has none)
            prefix=f"{prefix}.qkv",
        )
        self.proj = RowParallelLinear(self.d, self.d, bias=False, prefix=f"{prefix}.proj")
        self.gate = (
            ColumnParallelLinear(self.d, self.d, bias=False, prefix=f"{prefix}.gate")
            if cfg.attn_gate
            else None
        )
        self.rotary = None
        if cfg.positions == "rope":
            theta = {"rope_theta": float(cfg.rope_base)}
            self.rotary = get_rope(
                self.hs,
                max_position=cfg.context,
                is_neox_style=cfg.rope_layout == "half",
                rope_parameters=theta,
            )
        self.qk_norm = cfg.qk_norm
        self.gate_width = 32
        # Value embeddings: the whole table on every rank (this rank reads its own heads' part).
        self.value_embed = (
            nn.Embedding(cfg.vocab_size, self.total_kv * self.hs) if value_embed else None
        )
        self.value_gate = (
            nn.Linear(self.gate_width, self.total_kv, bias=False) if value_embed else None
        )

    def _norm_heads(self, z: torch.Tensor, heads: int) -> torch.Tensor:
        N = z.shape[0]
        return F.rms_norm(z.view(N, heads, self.hs), (self.hs,)).view(N, heads * self.hs)

    def forward(self, x: torch.Tensor, slot: KVSlot, tokens: torch.Tensor | None) -> torch.Tensor:
        """x (N, d), already normalised → the attention's output (N, d)."""
        qkv, _ = self.qkv(x)
        q, k, v = qkv.split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        if self.value_embed is not None:
            if tokens is None:
                raise LoopLMError("a block with value embeddings needs the pass's token ids")
            N, a, b = x.shape[0], self.kv_start, self.kv_start + self.kv_heads
            gate = 2 * torch.sigmoid(self.value_gate(x[:, : self.gate_width]))[:, a:b]
            ve = self.value_embed(tokens.reshape(-1)).view(N, self.total_kv, self.hs)[:, a:b]
            v = v + (gate[..., None] * ve).reshape(N, self.kv_size)
        if self.rotary is not None:
            q, k = self.rotary(slot.cache.positions, q, k)
        if self.qk_norm:  # after the rotation, as looplm's block
            q, k = self._norm_heads(q, self.heads), self._norm_heads(k, self.kv_heads)
        y = slot.cache.attention[slot.index](q, k, v)
        if self.gate is not None:
            g, _ = self.gate(x)
            y = torch.sigmoid(g) * y
        out, _ = self.proj(y)
        return out


class VllmMLP(nn.Module):
    """looplm's SwiGLU (``W_down(silu(W_gate x)·W_up x)``) or halved squared ReLU
    (``W_down(½·relu(W_up x)²)``), tensor-parallel."""

    def __init__(self, cfg: ModelConfig, prefix: str) -> None:
        super().__init__()
        d, f = cfg.d_model, cfg.d_ff
        self.kind = cfg.mlp
        if self.kind == "swiglu":
            self.gate_up = MergedColumnParallelLinear(
                d, [f, f], bias=False, prefix=f"{prefix}.gate_up"
            )
            self.act = SiluAndMul()
        else:
            self.up = ColumnParallelLinear(d, f, bias=False, prefix=f"{prefix}.up")
        self.down = RowParallelLinear(f, d, bias=False, prefix=f"{prefix}.down")

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.kind == "swiglu":
            z, _ = self.gate_up(x)
            z = self.act(z)
        else:
            z, _ = self.up(x)
            z = F.relu(z).pow(2).mul(0.5)
        out, _ = self.down(z)
        return out


class VllmBlock(nn.Module):
    """looplm's :class:`~looplm.model.block.Block` (``block(x)`` = G(x), ``advance(x)`` = the
    layer's output, the three norm placements) on vLLM's layers. ``kv`` is the
    :class:`KVSlot` looplm's :class:`BlockCall` hands each application: its index picks the
    ``Attention`` module (and so the KV cache) of that application."""

    n_layers = 1

    def __init__(self, cfg: ModelConfig, layer: int, prefix: str) -> None:
        super().__init__()
        self.reference_rounding = cfg.reference_rounding
        self.norm_placement = cfg.norm_placement

        def norm() -> RMSNorm:
            return RMSNorm(cfg.d_model, eps=cfg.norm_eps, has_weight=cfg.norm_weight)

        self.norm1 = norm()
        self.attn = VllmAttention(cfg, layer in cfg.value_embed_layers, f"{prefix}.attn")
        self.norm2 = norm()
        self.mlp = VllmMLP(cfg, f"{prefix}.mlp")
        if self.norm_placement != "pre":
            self.norm3, self.norm4 = norm(), norm()

    def _attend(self, x: torch.Tensor, kv: KVSlot | None, tokens: torch.Tensor | None):
        if kv is None:
            raise LoopLMError("a vLLM block runs with its slot's attention (kv) only")
        return self.attn(self.norm1(x), kv, tokens)

    def _after_attention(self, x: torch.Tensor, a: torch.Tensor) -> torch.Tensor:
        if self.norm_placement == "pre":
            return a + self.mlp(self.norm2(x + a))
        if self.norm_placement == "sandwich":
            a = self.norm3(a)
            return a + self.norm4(self.mlp(self.norm2(x + a)))
        y = self.norm3(x + a)
        return self.norm4(y + self.mlp(self.norm2(y))) - x

    def forward(self, x: torch.Tensor, *, kv=None, active=None, mask=None, tokens=None):
        """x (…, d) → G(x) (…, d)."""
        _no_halting(active, mask)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        return self._after_attention(x, self._attend(x, kv, tokens)).view(shape)

    def advance(self, x: torch.Tensor, *, kv=None, active=None, mask=None, tokens=None):
        """x + G(x), summed as looplm's block sums it (``reference_rounding``: the residual
        stream's order)."""
        if not self.reference_rounding:
            return x + self.forward(x, kv=kv, active=active, mask=mask, tokens=tokens)
        _no_halting(active, mask)
        shape = x.shape
        x = x.reshape(-1, shape[-1])
        a = self._attend(x, kv, tokens)
        if self.norm_placement == "pre":
            h = x + a
            out = h + self.mlp(self.norm2(h))
        elif self.norm_placement == "sandwich":
            h = x + self.norm3(a)
            out = h + self.norm4(self.mlp(self.norm2(h)))
        else:
            y = self.norm3(x + a)
            out = self.norm4(y + self.mlp(self.norm2(y)))
        return out.view(shape)


def _no_halting(active, mask) -> None:
    if active is not None or mask is not None:
        raise LoopLMError("vLLM runs every token at the served depth (no active rows, no masks)")


class LoopLMModel(nn.Module):
    """Embedding → prelude → looplm's loop of the shared core → coda; names mirror looplm's
    state dict (``tok_emb``, ``prelude.i``, ``block`` / ``block.layers.i``, ``coda.i``,
    ``recurrence``, ``norm_f``, ``lm_head``)."""

    # long: the model's modules in looplm's registration order, and the counted attention slots
    def __init__(self, cfg: ModelConfig, loops: int, prefix: str, cache_config) -> None:
        super().__init__()
        self.config, self.loops = cfg, loops
        self.looped = cfg.is_looped
        self.tok_emb = VocabParallelEmbedding(
            cfg.vocab_size, cfg.d_model, prefix=f"{prefix}.tok_emb"
        )
        self.pos_emb = (
            nn.Embedding(cfg.context, cfg.d_model) if cfg.positions == "learned" else None
        )
        if self.looped:
            p, k = cfg.prelude_layers, cfg.core_layers
            self.prelude = nn.ModuleList(
                VllmBlock(cfg, i, f"{prefix}.prelude.{i}") for i in range(p)
            )
            # one layer: looplm names it ``block`` itself; k layers: ``block.layers.i``
            self.block = (
                VllmBlock(cfg, p, f"{prefix}.block")
                if k == 1
                else Core([VllmBlock(cfg, p + i, f"{prefix}.block.layers.{i}") for i in range(k)])
            )
            self.coda = nn.ModuleList(
                VllmBlock(cfg, p + k + i, f"{prefix}.coda.{i}") for i in range(cfg.coda_layers)
            )
            self.recurrence = build_recurrence(cfg.recurrence, cfg.d_model, cfg.recurrence_args)
            self.recurrence.eval()
            core_slots = self._count_core_slots()
            n_slots = len(self.prelude) + core_slots + len(self.coda)
        else:  # an unshared stack: the first min(T, N) layers, once each
            self.layers = nn.ModuleList(
                VllmBlock(cfg, None, f"{prefix}.layers.{i}") for i in range(cfg.n_layers)
            )
            n_slots = min(loops, cfg.n_layers)
        self.norm_f = (
            RMSNorm(cfg.d_model, eps=cfg.norm_eps, has_weight=cfg.norm_weight)
            if cfg.final_norm
            else nn.Identity()
        )
        self.lm_head = None
        if not cfg.tie_head:
            self.lm_head = ParallelLMHead(cfg.vocab_size, cfg.d_model, prefix=f"{prefix}.lm_head")
        tp = get_tensor_model_parallel_world_size()
        hs = cfg.d_model // cfg.n_heads
        kv = max(1, (cfg.kv_heads or cfg.n_heads) // tp)
        # One Attention (one paged KV cache) per block application, in looplm's slot order.
        self.slots = nn.ModuleList(
            Attention(
                cfg.n_heads // tp,
                hs,
                hs**-0.5,
                num_kv_heads=kv,
                cache_config=cache_config,
                prefix=f"{prefix}.slots.{i}",
            )
            for i in range(n_slots)
        )

    @torch.no_grad()
    def _count_core_slots(self) -> int:
        """Block applications of one unroll of depth T: looplm's unroll of the recurrence on a
        stand-in core (G = 0) that counts the layers each call applies."""
        cfg = self.config
        k = cfg.core_layers
        stand = _Stand() if k == 1 else Core([_Stand() for _ in range(k)])
        param = next(self.recurrence.parameters(), None)
        device = param.device if param is not None else torch.empty(0).device
        ctx = self.recurrence.prepare(torch.zeros(1, 1, cfg.d_model, device=device))
        call = BlockCall(stand)
        for _ in self.unroll(ctx, self.loops, core=call):
            pass
        return call.slot

    def embed(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        e = self.tok_emb(input_ids)
        if self.config.emb_scale != 1.0:
            e = e * self.config.emb_scale
        if self.pos_emb is not None:
            e = e + self.pos_emb(positions)
        return e

    # looplm's own unroll, coda and layer runner (one implementation), on these modules
    unroll = LoopedLM.unroll
    _advance = LoopedLM._advance
    finish = LoopedLM.finish
    run_layers = staticmethod(LanguageModelBase.run_layers)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
        """Flat tokens (N,) at ``positions`` (N,) → what the readout reads (N, d)."""
        slots = _Slots(self.slots, positions)
        tokens = input_ids[None] if self.config.value_embed_layers else None
        e = self.embed(input_ids, positions)[None]  # (1, N, d): the recurrences' layout
        if not self.looped:
            return self.run_layers(self.layers[: len(self.slots)], e, None, slots, tokens=tokens)[0]
        if len(self.prelude):
            e = self.run_layers(self.prelude, e, None, slots, tokens=tokens)
        ctx = self.recurrence.prepare(e)
        if tokens is not None:  # value embeddings read the token ids in every layer
            ctx.extra["tokens"] = tokens
        core = BlockCall(self.block, cache=slots, first_slot=len(self.prelude), tokens=tokens)
        for last in self.unroll(ctx, self.loops, core=core):  # noqa: B007 — h_T only
            pass
        if core.slot + len(self.coda) != len(self.slots):
            raise LoopLMError(
                f"the pass used {core.slot + len(self.coda)} attention slots of {len(self.slots)}"
            )
        return self.finish(last.hidden, ctx, cache=slots, first_slot=core.slot)[0]


class LoopLMForCausalLM(nn.Module):
    """The vLLM model of a ``looplm export`` folder (architecture ``LoopLMForCausalLM``)."""

    def __init__(self, *, vllm_config: VllmConfig, prefix: str = "") -> None:
        super().__init__()
        cfg, loops = looplm_config(vllm_config.model_config.hf_config)
        self.config, self.loops = cfg, loops
        name = f"{prefix}.model" if prefix else "model"
        self.model = LoopLMModel(cfg, loops, name, vllm_config.cache_config)
        self.logits_processor = LogitsProcessor(cfg.vocab_size)

    def embed_input_ids(self, input_ids: torch.Tensor) -> torch.Tensor:
        """The token embedding (times ``emb_scale``); learned positions are added in
        :meth:`forward`, which reads token ids only."""
        e = self.model.tok_emb(input_ids)
        scale = self.config.emb_scale
        return e * scale if scale != 1.0 else e

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        intermediate_tensors=None,
        inputs_embeds: torch.Tensor | None = None,
        **kwargs,
    ) -> torch.Tensor:
        if inputs_embeds is not None:
            raise LoopLMError("looplm models read token ids (no inputs_embeds)")
        return self.model(input_ids, positions)

    def compute_logits(self, hidden_states: torch.Tensor) -> torch.Tensor | None:
        """looplm's readout: final norm, head, × logit_scale, then the soft cap."""
        m = self.model
        head = m.lm_head if m.lm_head is not None else m.tok_emb
        logits = self.logits_processor(head, m.norm_f(hidden_states))
        if logits is None:  # another rank holds the gathered logits
            return None
        c = self.config
        if c.logit_scale != 1.0:
            logits = logits * c.logit_scale
        if c.logit_softcap:
            logits = c.logit_softcap * torch.tanh(logits / c.logit_softcap)
        return logits

    # long: looplm's fused tensors split into vLLM's shards, one branch per kind
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> set[str]:
        """The export's ``model.*`` tensors (looplm's state dict): fused ``qkv`` rows split into
        the q/k/v shards, the query/key bias into the qkv bias (zeros for the values), the
        SwiGLU's ``gate_up`` rows into its two shards; everything else by name."""
        params = dict(self.named_parameters())
        buffers = dict(self.named_buffers())
        loaded: set[str] = set()
        c = self.config
        hs = c.d_model // c.n_heads
        q_dim, kv_dim = c.d_model, (c.kv_heads or c.n_heads) * hs
        for name, w in weights:
            if name.endswith(".attn.qkv.weight"):
                param = params[name]
                for shard, part in zip("qkv", w.split([q_dim, kv_dim, kv_dim], dim=0)):
                    param.weight_loader(param, part, shard)
            elif name.endswith(".attn.qk_bias"):
                name = name[: -len("qk_bias")] + "qkv.bias"
                param = params[name]
                q, k = w.split([q_dim, kv_dim])
                for shard, part in (("q", q), ("k", k), ("v", torch.zeros_like(k))):
                    param.weight_loader(param, part, shard)
            elif name.endswith(".mlp.gate_up.weight"):
                param = params[name]
                for shard, part in enumerate(w.chunk(2, dim=0)):
                    param.weight_loader(param, part, shard)
            elif name in params:
                param = params[name]
                getattr(param, "weight_loader", default_weight_loader)(param, w)
            elif name in buffers:
                buffers[name].copy_(w)
                continue
            else:
                raise LoopLMError(f"tensor {name!r} of the export has no place in the model")
            loaded.add(name)
        return loaded
