"""The Jacobian lens per core layer: the residual stream inside each loop step.

A loop step of a model whose core has k layers (Parcae 2–8, Huginn 4, Ouro the whole stack)
applies them in sequence. Unrolled to depth T the model is a virtual stack of T·k core-layer
applications; the lens of virtual layer v = (t − 1)·k + i (loop step t = 1 … T, core layer
i = 0 … k − 1) reads r_v, the residual stream **entering** core layer i at step t (layer 0's is
what the recurrence feeds its core: Parcae's injected state, Huginn's adapter output, Ouro's
state):

    J_v = E_{prompt, p} [ Σ_{p' ≥ p} ∂h_T[p'] / ∂r_v[p] ],   lens_v(r) = unembed(J_v · r)

with h_T what the readout reads (after any coda), exactly as the per-step lens
(:mod:`looplm.lens.jacobian`) and fitted by the same vector-Jacobian products. The streams are
taken where every layer reads its input (a forward pre-hook on the layer's first norm), so the
model runs its own unroll unchanged. Prelude and coda layers are not part of the virtual stack.

The fitted object is a :class:`~looplm.lens.jacobian.JacobianLens` indexed by v = 0 … T·k − 1
(its ``loops`` is the last index, ``meta`` holds ``granularity: core_layer``, T and k), so the
fidelity, band and file code of the per-step lens apply to it unchanged.
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


@contextmanager
def core_layer_inputs(model: torch.nn.Module) -> Iterator[list[torch.Tensor]]:
    """Within the block: a list that fills with the residual stream entering every core-layer
    application, in order (loop step by loop step, layer by layer)."""
    seen: list[torch.Tensor] = []
    hooks = [
        layer.norm1.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
        for layer in core_layers(model)
    ]
    try:
        yield seen
    finally:
        for h in hooks:
            h.remove()


def _check_count(streams: list[torch.Tensor], loops: int, k: int) -> None:
    if len(streams) != loops * k:  # a recurrence that calls its core other than once per step
        raise LoopLMError(
            f"the unroll applied core layers {len(streams)} times; a per-layer lens needs "
            f"{loops} steps × {k} layers"
        )


@torch.no_grad()
def layer_states(
    model: torch.nn.Module, ids: torch.Tensor, loops: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([r_0 … r_{T·k−1}], the model's logits at depth T) from one unroll."""
    L.check_lens_loops(model, loops)
    k = len(core_layers(model))
    with core_layer_inputs(model) as seen:
        ctx = model.prepare(ids)
        for last in model.unroll(ctx, loops):  # noqa: B007
            pass
        logits = model.readout(model.finish(last.hidden, ctx))
    _check_count(seen, loops, k)
    return seen, logits


def fit_layer_lens(
    model: torch.nn.Module,
    batches: Iterable[L.Batch],
    loops: int,
    mode: str = "exact",
    **fit: Any,
) -> L.JacobianLens:
    """Fit ``J_v`` for every virtual layer v = 0 … T·k − 1 (the keyword arguments of
    :func:`~looplm.lens.jacobian.fit_jacobian_lens`: probes, skip_positions, pad_id, seed,
    corpus, progress)."""
    L.check_lens_loops(model, loops)
    k = len(core_layers(model))

    def unroll(m: torch.nn.Module, ids: torch.Tensor, T: int) -> L.Unrolled:
        with core_layer_inputs(m) as seen:
            run = L.unroll_for_lens(m, ids, T)
        _check_count(seen, T, k)
        # the streams are the states of this fit: no change of coordinates
        return L.Unrolled(run.context, [L.LoopStep(0, r, None, None) for r in seen], run.final)

    meta = {"granularity": "core_layer", "depth": loops, "core_layers": k}
    return L.fit_jacobian_lens(
        model, batches, loops, mode, unroll=unroll, n_states=loops * k, meta=meta, **fit
    )


def layer_fidelity(
    model: torch.nn.Module, lens: L.JacobianLens, batches: Iterable[L.Batch], *, pad_id=None
) -> Any:
    """KL(p_T ‖ lens_v), top-1 agreement and pass@k per virtual layer for the per-layer J-lens
    and the logit lens on the same streams (:func:`looplm.lens.readout.fidelity`)."""
    from looplm.lens.readout import fidelity

    meta = lens.meta or {}
    if meta.get("granularity") != "core_layer":
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


__all__ = ["core_layer_inputs", "core_layers", "fit_layer_lens", "layer_fidelity", "layer_states"]
