"""Causal interventions along lens token directions over a band of loop steps.

A token v's direction at loop step t is row v of ``D_t = W_U diag(γ) J_t``
(:meth:`~looplm.lens.jacobian.JacobianLens.token_directions`; the logit lens gives the plain
unembedding rows). Over a band of steps t ∈ [first, last] the state h_t is edited and the model's
own unroll continues from the edited state (``model.unroll(…, state=…, start=t)``):

* steer:           ``h ← h + α · u_v``
* coordinate swap: write ``h = c_a u_a + c_b u_b + r`` with r in the complement handled by the
  pseudo-inverse of [u_a u_b]; the swap exchanges the two coordinates and keeps r,
  ``h ← h + β (c_b − c_a)(u_a − u_b)`` (β = 1 the full swap, β a dose). Over a band the
  dose-response writes the clean run's coordinates exchanged, ``h ← h + β [(r_b − c_a) u_a +
  (r_a − c_b) u_b]`` with r those of the unedited h_t, so the swap at step t + 1 does not swap
  back the swap of step t
* project-out:     ``h ← h − β Q Qᵀ h``, Q an orthonormal basis of the span of the directions

A state edit enters the recurrence through ``LoopStep.state_for``:
``s ← s + from_hidden(h′) − from_hidden(h)`` (for SCSE ``Δ ← Δ + (h′ − h)``), so a swap of a
token with itself (u_a − u_b = 0) and a zero-strength steer leave every state, and the logits,
bit-for-bit unchanged.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.lens.jacobian import Batch, batch_ids, check_lens_loops, loop_states
from looplm.lens.settings import INTERVENTIONS
from looplm.targets import IGNORE_INDEX

Edit = Callable[[int, torch.Tensor], torch.Tensor]
KINDS = INTERVENTIONS  # stated with the settings


def check_band(band: Sequence[int], loops: int) -> tuple[int, int]:
    """A band of loop steps (first, last), inclusive, inside 0 … T."""
    if (
        not isinstance(band, (tuple, list))
        or len(band) != 2
        or any(isinstance(b, bool) or not isinstance(b, int) for b in band)
    ):
        raise LoopLMError(f"band={band!r} must be two loop steps (first, last)")
    lo, hi = band
    if not 0 <= lo <= hi <= loops:
        raise LoopLMError(
            f"band=({lo}, {hi}) lies outside the loop steps 0 … {loops} (or first > last)"
        )
    return lo, hi


def band_from_fractions(lo: float, hi: float, loops: int) -> tuple[int, int]:
    """The steps t with lo ≤ t/T ≤ hi (at least one step: the nearest to the middle)."""
    if not 0.0 <= lo <= hi <= 1.0:
        raise LoopLMError(f"band fractions ({lo}, {hi}) must satisfy 0 <= lo <= hi <= 1")
    steps = [t for t in range(loops + 1) if lo - 1e-12 <= t / loops <= hi + 1e-12]
    if not steps:
        mid = round(0.5 * (lo + hi) * loops)
        return mid, mid
    return steps[0], steps[-1]


# --------------------------------------------------------------------------- edits of one state
def _per_prompt(u: torch.Tensor, h: torch.Tensor) -> torch.Tensor:
    """Directions (d,) or (B, d) → (B or 1, 1, d) in h's dtype, broadcasting over positions."""
    u = u.to(device=h.device, dtype=h.dtype)
    return u.reshape(-1, 1, h.shape[-1]) if u.dim() <= 2 else u


def steer(h: torch.Tensor, direction: torch.Tensor, strength: float) -> torch.Tensor:
    """``h + α u``: h (B, L, d), u (d,) or (B, d)."""
    return h + strength * _per_prompt(direction, h)


def coordinate_swap(
    h: torch.Tensor,
    u_a: torch.Tensor,
    u_b: torch.Tensor,
    strength: float = 1.0,
    reference: torch.Tensor | None = None,
) -> torch.Tensor:
    """Exchange h's coordinates along u_a and u_b, keeping the rest: h (B, L, d), u (d,) or (B, d).

    ``c = pinv([u_a u_b]) h``; ``h + β (c_b − c_a)(u_a − u_b)``; u_a = u_b changes nothing. With
    ``reference`` (the unedited state of the same step, coordinates r) the two coordinates become
    the reference's, exchanged: ``h + β [(r_b − c_a) u_a + (r_a − c_b) u_b]``, so a swap repeated
    at every step of a band does not swap back what the previous step swapped.
    """
    ua, ub = _per_prompt(u_a, h), _per_prompt(u_b, h)  # (B|1, 1, d)
    U = torch.stack([ua[:, 0], ub[:, 0]], dim=-1)  # (B|1, d, 2)
    P = torch.linalg.pinv(U)  # (B|1, 2, d)
    c = torch.einsum("bkd,bld->blk", P, h)  # (B, L, 2)
    if reference is None:
        return h + strength * (c[..., 1:2] - c[..., 0:1]) * (ua - ub)
    r = torch.einsum("bkd,bld->blk", P, reference.to(h.dtype))
    return h + strength * ((r[..., 1:2] - c[..., 0:1]) * ua + (r[..., 0:1] - c[..., 1:2]) * ub)


def project_out(h: torch.Tensor, directions: torch.Tensor, strength: float = 1.0) -> torch.Tensor:
    """``h − β Q Qᵀ h`` with Q an orthonormal basis of the directions (k, d) or (B, k, d)."""
    D = directions.to(device=h.device, dtype=h.dtype)
    if D.dim() == 1:
        D = D[None]
    if D.dim() == 2:
        D = D[None]  # (1, k, d)
    Q, _ = torch.linalg.qr(D.transpose(1, 2))  # (B|1, d, k)
    return h - strength * torch.einsum("blk,bdk->bld", h @ Q, Q)


# --------------------------------------------------------------------------- the edited unroll
@torch.no_grad()
def intervene(
    model: torch.nn.Module,
    ids: torch.Tensor,
    loops: int,
    band: Sequence[int],
    edit: Edit,
    *,
    positions: torch.Tensor | None = None,
) -> torch.Tensor:
    """Logits (B, L, V) of the model at depth T with ``edit(t, h_t)`` applied at every step of
    ``band`` (at ``positions``, a (B, L) bool mask; default every position), each edited state
    continued by the model's own unroll."""
    check_lens_loops(model, loops)
    lo, hi = check_band(band, loops)
    ctx = model.prepare(ids)
    steps = model.unroll(ctx, loops)  # eager: restarted from an edited state at each band step
    st = next(steps)
    while True:
        if lo <= st.t <= hi:
            steps = model.unroll(ctx, loops, state=_edited_state(st, edit, positions), start=st.t)
            st = next(steps)  # step t, edited; the unroll goes on from it
        nxt = next(steps, None)
        if nxt is None:
            break
        st = nxt
    return model.readout(model.finish(st.hidden, ctx))


def _edited_state(st, edit: Edit, positions: torch.Tensor | None) -> torch.Tensor:
    """The recurrent state of ``st`` after editing its hidden state (an edit that changes no bit
    of h_t changes no bit of the state)."""
    h = st.hidden
    h_new = edit(st.t, h)
    if positions is not None:
        h_new = torch.where(positions[..., None].to(h.device), h_new, h)
    return st.state_for(h_new)


# --------------------------------------------------------------------------- dose-response
def read_positions(batch: Batch, pad_id: int | None = None) -> torch.Tensor:
    """(B,) the position each prompt is read at: its last supervised target (an ``(ids,
    targets)`` batch with −100 elsewhere), else its last non-pad token."""
    ids = batch_ids(batch)
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        sup = batch[1] != IGNORE_INDEX
    else:
        sup = torch.ones_like(ids, dtype=torch.bool) if pad_id is None else ids != pad_id
    if not bool(sup.any(1).all()):
        raise LoopLMError("every prompt needs a position to read (a target or a non-pad token)")
    idx = torch.arange(ids.shape[1]).expand_as(ids)
    return torch.where(sup, idx, -1).max(1).values


def token_edit(
    kind: str,
    model: torch.nn.Module,
    lens: Any,
    tok_a: torch.Tensor,
    tok_b: torch.Tensor,
    strength: float,
    reference: Sequence[torch.Tensor] | None = None,
) -> Edit:
    """The edit of one dose along the lens's token directions of each step, per prompt (tokens
    (B,)): ``swap`` a ↔ b (to the coordinates of ``reference[t]``, the unedited states h_0 … h_T,
    when given), ``steer`` toward b by α·‖h_t‖ (α = ``strength``), ``project`` a out."""
    if kind not in KINDS:
        raise LoopLMError(f"kind={kind!r}; allowed: {', '.join(KINDS)}")
    cache: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}

    def directions(t: int) -> tuple[torch.Tensor, torch.Tensor]:
        if t not in cache:
            cache[t] = (
                lens.token_directions(model, t, tok_a),
                lens.token_directions(model, t, tok_b),
            )
        return cache[t]

    def edit(t: int, h: torch.Tensor) -> torch.Tensor:
        ua, ub = directions(t)
        if kind == "swap":
            ref = None if reference is None else reference[t]
            return coordinate_swap(h, ua, ub, strength, ref)
        if kind == "steer":
            unit = ub / ub.norm(dim=-1, keepdim=True).clamp_min(1e-30)
            return steer(h, unit[:, None, :] * h.norm(dim=-1, keepdim=True), strength)
        return project_out(h, ua[:, None, :], strength)

    return edit


def _dose_batch(
    model, lens, batch, loops, band, kind, strengths, control_ranks, rows, *, pad_id, all_positions
) -> None:
    """Add one batch's per-prompt outcomes of every dose to ``rows``."""
    ids = batch_ids(batch)
    pos = read_positions(batch, pad_id)
    idx = torch.arange(ids.shape[0])
    clean, logits = loop_states(model, ids, loops)  # the unedited h_0 … h_T: swap references
    order = logits[idx, pos].argsort(dim=-1, descending=True)  # (B, V)
    a, b = order[:, 0], order[:, 1]
    r1, r2 = control_ranks
    pairs = {"target": (a, b), "control": (order[:, r1], order[:, r2])}
    mask = None
    if not all_positions:
        mask = torch.zeros_like(ids, dtype=torch.bool)
        mask[idx, pos] = True
    for arm, (ta, tb) in pairs.items():
        for s in strengths:
            edit = token_edit(kind, model, lens, ta, tb, float(s), clean)
            out = intervene(model, ids, loops, band, edit, positions=mask)[idx, pos]
            top = out.argmax(-1)
            rows[arm][s]["to_rival"] += (top == b).double().tolist()
            rows[arm][s]["changed"] += (top != a).double().tolist()
            rows[arm][s]["margin"] += (out[idx, b] - out[idx, a]).double().tolist()


# long: the argument checks and the result table of every dose, around a short batch loop
@torch.no_grad()
def dose_response(
    model: torch.nn.Module,
    lens: Any,
    batches: Iterable[Batch],
    loops: int,
    band: Sequence[int],
    *,
    kind: str = "swap",
    strengths: Sequence[float] = (0.0, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0),
    control_ranks: tuple[int, int] = (10, 11),
    pad_id: int | None = None,
    all_positions: bool = False,
) -> dict[str, Any]:
    """Dose-response of an intervention over ``band`` at each prompt's read position.

    Per prompt, a = the model's own top-1 token and b = its runner-up at the read position. The
    target edit is ``swap`` (a ↔ b), ``steer`` (toward b, α·‖h_t‖) or ``project`` (out a); the
    control edit is the same with an unrelated pair, the tokens the model ranks
    ``control_ranks`` there. Per strength: the rate at which the top-1 moves to b
    (``to_rival``), the rate at which it changes at all (``changed``), and the mean logit margin
    b − a, each with a t interval over prompts. Edits touch the read position only unless
    ``all_positions``.
    """
    from looplm.results.stats import t_halfwidth

    if kind not in KINDS:
        raise LoopLMError(f"kind={kind!r}; allowed: {', '.join(KINDS)}")
    check_lens_loops(model, loops)
    check_band(band, loops)
    if lens.loops != loops:
        raise LoopLMError(f"loops={loops}: this lens was fitted at T={lens.loops}")
    lens.check_model(model)
    r1, r2 = control_ranks
    V = model.config.vocab_size
    ok = all(isinstance(r, int) and not isinstance(r, bool) and 2 <= r < V for r in (r1, r2))
    if not ok or r1 == r2:
        raise LoopLMError(f"control_ranks={control_ranks!r} must be two ranks in 2 … {V - 1}")
    rows = {
        arm: {s: {"to_rival": [], "changed": [], "margin": []} for s in strengths}
        for arm in ("target", "control")
    }
    was = model.training
    model.eval()
    try:
        for batch in batches:
            _dose_batch(model, lens, batch, loops, band, kind, strengths, control_ranks, rows,
                        pad_id=pad_id, all_positions=all_positions)  # fmt: skip
    finally:
        model.train(was)
    result: dict[str, Any] = {
        "kind": kind,
        "band": list(check_band(band, loops)),
        "loops": loops,
        "strengths": [float(s) for s in strengths],
        "control_ranks": list(control_ranks),
    }
    for arm in ("target", "control"):
        result[arm] = {}
        for metric in ("to_rival", "changed", "margin"):
            vals = [rows[arm][s][metric] for s in strengths]
            result[arm][metric] = [sum(v) / len(v) for v in vals]
            result[arm][f"{metric}_ci"] = [t_halfwidth(v) for v in vals]
    result["n_prompts"] = len(rows["target"][strengths[0]]["to_rival"])
    return result
