"""FLOP and parameter accounting.

FLOPs follow the paper's per-token matrix-multiplication proxy exactly (Appendix "Compute and
Token-Budget Accounting")::

    FLOPs_body,token(T)      = N_body(T) · (8d² + 6·d·d_ff + 4·L·d)          (Eq. 20)
    FLOPs_body+head,token(T) = FLOPs_body,token(T) + 2·d·|V|                  (Eq. 21)

with ``N_body(T) = c_body · T`` for a shared-block recurrence (c_body = the recurrence's
``body_calls_per_step``: 1, or 2 for the subtractive controls) and ``N_body(T) = min(T, N_layers)``
for the unshared Transformer. ``4·L·d`` is the dense L×L causal-mask attention term. As in the paper,
the proxy omits normalisation, softmax, nonlinearities, elementwise work and architecture-specific
anchor, initial-state, source, gate, FiLM and lane-mixing paths.
"""

from __future__ import annotations

from typing import Any

from looplm.errors import LoopLMError
from looplm.settings.config import UNSHARED, ModelConfig, model_config


def _c_body(recurrence: str) -> int:
    if recurrence == UNSHARED:
        return 1
    from looplm.model.recurrences import get_recurrence_class

    return int(get_recurrence_class(recurrence).body_calls_per_step)


def eq20_21(
    *,
    recurrence: str,
    depth: float,
    seq_len: int,
    d_model: int,
    d_ff: int,
    vocab_size: int,
    n_layers: float,
    prelude_layers: int = 0,
    core_layers: int = 1,
    coda_layers: int = 0,
) -> dict[str, Any]:
    """The one evaluation of Eqs. 20–21: per-token FLOPs at (possibly fractional) ``depth``.

    ``N_body = P + C + c_body · k · depth`` layer applications for a looped model with P prelude
    and C coda layers and a k-layer core (``c_body · depth`` for today's 0/1/0 models),
    ``min(depth, n_layers)`` for the unshared Transformer; ``per_body = 8d² + 6·d·d_ff + 4·L·d`` (Eq. 20, one body application) and
    ``head = 2·d·|V|`` (Eq. 21). Integer depths give integer FLOPs. Returns ``{"body",
    "body_head", "head", "per_body", "n_body", "c_body"}``.
    """
    c_body = _c_body(recurrence)
    if recurrence == UNSHARED:
        n_body = min(depth, n_layers)
    else:
        n_body = prelude_layers + coda_layers + c_body * core_layers * depth
    per_body = 8 * d_model * d_model + 6 * d_model * d_ff + 4 * seq_len * d_model
    body = n_body * per_body
    head = 2 * d_model * vocab_size
    return {
        "body": body,
        "body_head": body + head,
        "head": head,
        "per_body": per_body,
        "n_body": n_body,
        "c_body": c_body,
    }


def model_flops(cfg: ModelConfig, depth: float, seq_len: int | None = None) -> dict[str, Any]:
    """:func:`eq20_21` for a model config (its own width, FFN width, vocabulary, layers)."""
    return eq20_21(
        recurrence=cfg.recurrence,
        depth=depth,
        seq_len=int(seq_len or cfg.context),
        d_model=cfg.d_model,
        d_ff=cfg.d_ff,
        vocab_size=cfg.vocab_size,
        n_layers=cfg.n_layers,
        prelude_layers=cfg.prelude_layers,
        core_layers=cfg.core_layers,
        coda_layers=cfg.coda_layers,
    )


def flops(
    preset: str, recurrence: str, loops: int, seq_len: int = 128, **overrides: Any
) -> dict[str, Any]:
    """Per-token FLOP proxies of Eqs. 20–21 for ``recurrence`` at ``preset``, depth ``loops``.

    Returns ``{"body", "body_head", "head", "per_body", "n_body", "c_body", "d_model", "d_ff",
    "seq_len", "vocab_size"}``; ``body`` and ``body_head`` are FLOPs per token (integers).
    ``flops("22m", "scse", 8)["body"] == 39_321_600`` (the paper's 39.3M). ``overrides`` are model
    settings (e.g. ``prelude_layers=2, core_layers=3``): N_body counts every layer application
    (:func:`eq20_21`).
    """
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise LoopLMError(f"loops={loops!r}: the loop depth T must be an integer >= 1")
    if isinstance(seq_len, bool) or not isinstance(seq_len, int) or seq_len < 1:
        raise LoopLMError(f"seq_len={seq_len!r} must be a positive integer")
    cfg = model_config(preset, recurrence, **overrides)
    out = model_flops(cfg, loops, seq_len)
    out.update(d_model=cfg.d_model, d_ff=cfg.d_ff, seq_len=seq_len, vocab_size=cfg.vocab_size)
    return out


def parameter_count(preset: str, recurrence: str, **overrides: Any) -> dict[str, int]:
    """Parameters of ``build_model(preset, recurrence, **overrides)``, counted without weights.

    The model is built on the ``meta`` device (no memory, no initialisation cost), so the 136.5M
    preset counts in milliseconds. Returns ``{"total", "trainable", "embedding", "body",
    "recurrence", "other", "n_rec", "n_once"}``; the tied head is counted once, in ``embedding``.
    ``n_rec`` is the looped core's parameters (applied every loop step); ``n_once`` everything
    else (embeddings and head, prelude and coda layers, the recurrence's own projections and
    gains, the final norm) — the split of the recurrence scaling law. An unshared model has
    ``n_rec = 0``.
    """
    import torch

    from looplm.model.build import build_model

    with torch.device("meta"):
        model = build_model(preset, recurrence, **overrides)
    groups = {"embedding": 0, "body": 0, "recurrence": 0, "other": 0}
    for name, p in model.named_parameters():
        top = name.split(".", 1)[0]
        if top in ("tok_emb", "pos_emb"):
            groups["embedding"] += p.numel()
        elif top in ("block", "layers", "prelude", "coda"):
            groups["body"] += p.numel()
        elif top == "recurrence":
            groups["recurrence"] += p.numel()
        else:
            groups["other"] += p.numel()
    n_rec = sum(p.numel() for n, p in model.named_parameters() if n.startswith("block."))
    return {
        "total": model.num_parameters(),
        "trainable": model.num_parameters(trainable_only=True),
        **groups,
        "n_rec": n_rec,
        "n_once": model.num_parameters() - n_rec,
    }
