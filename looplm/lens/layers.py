"""The Jacobian lens per layer of the virtually unrolled graph: prelude, every core layer inside
each loop step, coda.

A loop step of a model whose core has k layers (Parcae 2–8, Huginn 4, Ouro the whole stack)
applies them in sequence; layers before the loop (the prelude, p of them) run once and layers
after it (the coda, c) run once on the final state. Unrolled to depth T the model is a virtual
stack of p + T·k + c layer applications (Huginn-0125 at T = 16: 2 + 4 × 16 + 2). The lens of
virtual layer v reads r_v, the residual stream **entering** that layer application:

* v = 0 … p − 1: prelude layer v;
* v = p + (t − 1)·k + i: core layer i (0 … k − 1) at loop step t (1 … T) — layer 0's stream is
  what the recurrence feeds its core (Parcae's injected state, Huginn's adapter output, Ouro's
  state);
* v = p + T·k + j: coda layer j (0 … c − 1), after the exit map and any final norm;

    J_v = E_{prompt, p} [ Σ_{p' ≥ p} ∂h_T[p'] / ∂r_v[p] ],   lens_v(r) = unembed(J_v · r)

with h_T what the readout reads (after the coda), exactly as the per-step lens
(:mod:`looplm.lens.jacobian`) and fitted by the same vector-Jacobian products. The streams are
taken where every layer reads its input (a forward pre-hook on the layer's first norm), so the
model runs its own forward pass unchanged; the token embedding is the gradient leaf (weights
frozen), so a prelude stream's derivative runs through every loop step that reads the prelude's
output.

The fitted object is a :class:`~looplm.lens.jacobian.JacobianLens` indexed by v = 0 … p + T·k +
c − 1 (its ``loops`` is the last index, ``meta`` holds ``granularity: layer``, T, p, k and c), so
the fidelity, band and file code of the per-step lens apply to it unchanged.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.lens import jacobian as L
from looplm.model.block import Core


def core_layers(model: torch.nn.Module) -> list[torch.nn.Module]:
    """The looped core's layers, in order (one for a single shared block)."""
    block = getattr(model, "block", None)
    if not getattr(model, "is_looped", False) or block is None:
        raise LoopLMError("a per-layer lens needs a looped model with a shared core")
    layers = list(block.layers) if isinstance(block, Core) else [block]
    if not all(hasattr(layer, "norm1") for layer in layers):
        raise LoopLMError(f"core layers of type {type(layers[0]).__name__} have no input norm")
    return layers


def virtual_layers(model: torch.nn.Module) -> tuple[list[torch.nn.Module], ...]:
    """(prelude layers, core layers, coda layers) in the order a forward pass applies them."""
    core = core_layers(model)
    outer = [list(getattr(model, name, ())) for name in ("prelude", "coda")]
    for layer in outer[0] + outer[1]:
        if not hasattr(layer, "norm1"):
            raise LoopLMError(f"layers of type {type(layer).__name__} have no input norm")
    return outer[0], core, outer[1]


def layer_counts(model: torch.nn.Module) -> tuple[int, int, int]:
    """(p, k, c): prelude, core and coda layer counts."""
    pre, core, coda = virtual_layers(model)
    return len(pre), len(core), len(coda)


@contextmanager
def layer_inputs(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block: a list that fills with the residual stream entering every layer
    application in execution order (prelude, then loop step by loop step and layer by layer,
    then coda)."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.norm1.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        for group in virtual_layers(model)
        for layer in group
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


@contextmanager
def _embedding_leaf(model: torch.nn.Module) -> Iterator[None]:
    """The token embedding's output made a gradient leaf while the weights are frozen, so every
    later stream (prelude, loop, coda) is a node of one graph."""
    embed = model.embed

    def leaf(*args: Any, **kw: Any) -> torch.Tensor:
        return embed(*args, **kw).detach().requires_grad_(True)

    model.embed = leaf  # an instance attribute shadowing the method, removed below
    try:
        yield
    finally:
        del model.embed


def _check_count(streams: list[torch.Tensor], loops: int, counts: tuple[int, int, int]) -> None:
    p, k, c = counts
    if len(streams) != p + loops * k + c:  # a recurrence that calls its core other than once a step
        raise LoopLMError(
            f"the forward pass applied layers {len(streams)} times; a per-layer lens needs "
            f"{p} prelude + {loops} steps × {k} core + {c} coda layers"
        )


@torch.no_grad()
def layer_states(
    model: torch.nn.Module, ids: torch.Tensor, loops: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([r_0 … r_{p+T·k+c−1}], the model's logits at depth T) from one forward pass."""
    L.check_lens_loops(model, loops)
    counts = layer_counts(model)
    with layer_inputs(model) as seen:  # eager: forward hooks record every layer's input
        ctx = model.prepare(ids)
        for last in model.unroll(ctx, loops):  # noqa: B007
            pass
        logits = model.readout(model.finish(last.hidden, ctx))
    _check_count(seen, loops, counts)
    return seen, logits


def fit_layer_lens(
    model: torch.nn.Module,
    batches: Iterable[L.Batch],
    loops: int,
    mode: str = "exact",
    **fit: Any,
) -> L.JacobianLens:
    """Fit ``J_v`` for every virtual layer v = 0 … p + T·k + c − 1 (the keyword arguments of
    :func:`~looplm.lens.jacobian.fit_jacobian_lens`: probes, skip_positions, pad_id, seed,
    corpus, progress)."""
    L.check_lens_loops(model, loops)
    counts = layer_counts(model)
    p, k, c = counts

    def unroll(m: torch.nn.Module, ids: torch.Tensor, T: int) -> L.Unrolled:
        with _embedding_leaf(m), layer_inputs(m) as seen, torch.enable_grad():
            ctx = m.prepare(ids)
            for last in m.unroll(ctx, T):  # noqa: B007
                pass
            final = m.finish(last.hidden, ctx)
        _check_count(seen, T, counts)
        # the streams are the states of this fit: no change of coordinates
        return L.Unrolled(ctx, [L.LoopStep(0, r, None, None) for r in seen], final)

    meta = {"granularity": "layer", "depth": loops, "prelude_layers": p, "core_layers": k,
            "coda_layers": c}  # fmt: skip
    return L.fit_jacobian_lens(
        model, batches, loops, mode, unroll=unroll, n_states=p + loops * k + c, meta=meta, **fit
    )


def layer_fidelity(
    model: torch.nn.Module, lens: L.JacobianLens, batches: Iterable[L.Batch], *, pad_id=None
) -> Any:
    """KL(p_T ‖ lens_v), top-1 agreement and pass@k per virtual layer for the per-layer J-lens
    and the logit lens on the same streams (:func:`looplm.lens.readout.fidelity`)."""
    from looplm.lens.readout import fidelity

    meta = lens.meta or {}
    if meta.get("granularity") != "layer":
        raise LoopLMError("layer_fidelity needs a lens fitted by fit_layer_lens")
    T = int(meta["depth"])
    arms = {"jacobian": lens, "logit": L.logit_lens(model, lens.loops)}
    return fidelity(
        model,
        arms,
        batches,
        lens.loops,
        pad_id=pad_id,
        states=lambda m, ids: layer_states(m, ids, T),
    )


__all__ = [
    "core_layers",
    "fit_layer_lens",
    "layer_counts",
    "layer_fidelity",
    "layer_inputs",
    "layer_states",
    "virtual_layers",
]
