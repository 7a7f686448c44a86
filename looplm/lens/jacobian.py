"""The Jacobian lens of a looped model: what each loop state is disposed to make the model say.

For a checkpoint unrolled to depth T, the lens of loop step t = 0 … T is

    J_t = E_{prompt, p} [ Σ_{p' ≥ p} ∂h_T[p'] / ∂h_t[p] ]        (d × d)
    lens_t(h) = unembed(J_t · h),   unembed = final RMSNorm + tied head

h_t is the loop state in hidden coordinates (the :class:`~looplm.model.lm.LoopStep` ``.hidden``:
for SCSE ``h* + Δ_t`` with the anchor ``h*`` held fixed, for ``looped``/``gated`` the state itself,
for hyper-connected lanes the lane mean; a change of h_t enters the state through
``LoopStep.state_for``); h_T is the state the readout reads: after any coda, before the final
norm. The input (e, h*) is held fixed. For an unshared Transformer the same code gives one J per
layer output (``loops`` = layers run).

The expectation runs over prompts, every source position p of every prompt (``skip_positions``
leaves out the first ones) and all current-and-future target positions p' ≥ p. With causal
attention ∂h_T[p']/∂h_t[p] = 0 for p' < p, so one vector-Jacobian product whose cotangent is the
same vector u at every target position gives ``Σ_{p'} uᵀ ∂h_T[p']/∂h_t[p]`` at every source p at
once, for every loop step t (one unroll kept in the autograd graph, gradients taken with respect
to each step's state). ``mode="exact"`` takes u = e_i for i = 1 … d (row i of J_t);
``mode="hutchinson"`` takes ``probes`` Rademacher vectors v per prompt and estimates
``J_t ≈ mean v (vᵀ J_t)``, unbiased with error ∝ 1/√probes, for wide models.

The logit lens is the control arm J = I (:func:`logit_lens`). Fits on disjoint prompt sets merge
into the fit on their union (:meth:`JacobianLens.merge`: the source-position-weighted mean, the
prompt-weighted mean for prompts of one length).
"""

from __future__ import annotations

import hashlib
import json
import os
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.lens.settings import ESTIMATORS
from looplm.model.lm import LoopStep

LENS_FORMAT = 1
LENS_FILES = ("lens.safetensors", "lens.json")

Batch = torch.Tensor | tuple[torch.Tensor, ...] | list[torch.Tensor]


# --------------------------------------------------------------------------- model identity
def model_fingerprint(model: torch.nn.Module) -> str:
    """SHA-256 of the model's configuration and weights (as float32), so a lens knows its model.

    A float64 copy of a float32 model has the same fingerprint (its values convert back exactly).
    """
    h = hashlib.sha256()
    cfg = getattr(model, "config", None)
    if cfg is not None:
        import dataclasses

        h.update(json.dumps(dataclasses.asdict(cfg), sort_keys=True, default=str).encode())
    for name, t in sorted(model.state_dict().items()):
        h.update(name.encode())
        h.update(str(tuple(t.shape)).encode())
        h.update(t.detach().to("cpu", torch.float32).contiguous().numpy().tobytes())
    return h.hexdigest()


def model_family(model: torch.nn.Module) -> str:
    """The recurrence name of a looped model, ``unshared`` for distinct layers."""
    if not getattr(model, "is_looped", True):
        return "unshared"
    cfg = getattr(model, "config", None)
    return getattr(cfg, "recurrence", type(model).__name__)


def check_lens_loops(model: torch.nn.Module, loops: int) -> int:
    """T as an int ≥ 1 the model can run; an unshared model has at most ``n_layers`` states."""
    if isinstance(loops, bool) or not isinstance(loops, int) or loops < 1:
        raise LoopLMError(f"loops={loops!r}: the loop depth T must be an integer >= 1")
    if not getattr(model, "is_looped", True):
        n = len(model.layers)
        if loops > n:
            raise LoopLMError(
                f"loops={loops}: an unshared model has {n} layers; its lens depth is 1 … {n}"
            )
    return loops


def check_step(t: int, loops: int) -> int:
    """A loop step of a depth-T lens: an integer in 0 … T."""
    if isinstance(t, bool) or not isinstance(t, int) or not 0 <= t <= loops:
        raise LoopLMError(f"step t={t!r} is outside the lens's loop steps 0 … {loops}")
    return t


def check_fitted(
    model_hash: str, fitted_loops: int, model: torch.nn.Module, loops: int | None = None
) -> None:
    """A lens fitted on model ``model_hash`` at T = ``fitted_loops`` refuses another model or T."""
    got = model_fingerprint(model)
    if model_hash and got != model_hash:
        raise LoopLMError(
            f"this lens was fitted on model {model_hash[:12]}, not on model {got[:12]}; "
            "fit a lens on this model"
        )
    if loops is not None and loops != fitted_loops:
        raise LoopLMError(
            f"loops={loops}: this lens was fitted at T={fitted_loops}; fit one at T={loops}"
        )


# --------------------------------------------------------------------------- batches and masks
def batch_ids(batch: Batch) -> torch.Tensor:
    """The (B, L) token ids of a batch given as ids or as an ``(ids, targets, …)`` tuple."""
    x = batch[0] if isinstance(batch, (tuple, list)) else batch
    if not isinstance(x, torch.Tensor) or x.dim() != 2:
        shape = tuple(x.shape) if isinstance(x, torch.Tensor) else type(x).__name__
        raise LoopLMError(f"a lens batch must be (batch, length) token ids, got {shape}")
    return x


def position_masks(
    ids: torch.Tensor, pad_id: int | None = None, skip_positions: int = 0
) -> tuple[torch.Tensor, torch.Tensor]:
    """(source mask, target mask), each (B, L) bool: targets are the non-pad positions, sources
    the non-pad positions p ≥ ``skip_positions``."""
    if isinstance(skip_positions, bool) or not isinstance(skip_positions, int):
        raise LoopLMError(f"skip_positions={skip_positions!r} must be an integer >= 0")
    if not 0 <= skip_positions < ids.shape[1]:
        raise LoopLMError(
            f"skip_positions={skip_positions} leaves no source position in prompts of length "
            f"{ids.shape[1]}; allowed: 0 … {ids.shape[1] - 1}"
        )
    target = torch.ones_like(ids, dtype=torch.bool) if pad_id is None else ids != pad_id
    source = target.clone()
    source[:, :skip_positions] = False
    return source, target


def _check_attention(model: torch.nn.Module) -> None:
    cfg = getattr(model, "config", None)
    attention = getattr(cfg, "attention", "causal")
    if attention != "causal":
        raise LoopLMError(
            f"model.attention={attention!r}: the lens sums over target positions p' >= p, "
            "which one cotangent per output coordinate does only under causal attention"
        )


# --------------------------------------------------------------------------- the unroll
@contextmanager
def frozen_weights(model: torch.nn.Module) -> Iterator[None]:
    """Weights without gradient for the block (the lens differentiates states only)."""
    flags = [(p, p.requires_grad) for p in model.parameters()]
    try:
        for p, _ in flags:
            p.requires_grad_(False)
        yield
    finally:
        for p, flag in flags:
            p.requires_grad_(flag)


@dataclass
class Unrolled:
    """One unroll kept in the autograd graph: its steps (s_0 a leaf) and h_T as read out."""

    context: Any
    steps: list[LoopStep]  # t = 0 … T
    final: torch.Tensor  # finish(h_T): what the readout reads (after any coda)

    @property
    def states(self) -> list[torch.Tensor]:
        """s_0 … s_T in the recurrence's coordinates."""
        return [st.state for st in self.steps]

    @property
    def hidden(self) -> list[torch.Tensor]:
        """h_0 … h_T in hidden coordinates (before any coda)."""
        return [st.hidden for st in self.steps]

    def hidden_grad(self, t: int, grad_state: torch.Tensor) -> torch.Tensor:
        """∂/∂h_t from ∂/∂s_t: the vector-Jacobian product through the state of h_t
        (:meth:`LoopStep.state_for`; the identity for every family whose state is h_t or
        h_t − h*)."""
        st = self.steps[t]
        if st.recurrence is None:
            return grad_state
        fixed = LoopStep(t, st.state.detach(), st.context, st.recurrence)
        with torch.enable_grad():
            h = fixed.hidden.detach().requires_grad_(True)
            (g,) = torch.autograd.grad(fixed.state_for(h), h, grad_state)
        return g


def unroll_for_lens(model: torch.nn.Module, ids: torch.Tensor, loops: int) -> Unrolled:
    """The model's own unroll to depth ``loops`` with the initial state as a gradient leaf.

    The context (embedding, anchor h*, prelude) is computed without gradient, so derivatives hold
    the input fixed; every later state is a node of one graph, so one backward pass gives the
    vector-Jacobian product with respect to every step's state.
    """
    with torch.no_grad():
        ctx = model.prepare(ids)
        s0 = next(iter(model.unroll(ctx, loops))).state
    s0 = s0.detach().requires_grad_(True)
    with torch.enable_grad():  # eager: a backward per probe through the kept graph (vjp's)
        steps = list(model.unroll(ctx, loops, state=s0, start=0))
        final = model.finish(steps[-1].hidden, ctx)
    return Unrolled(ctx, steps, final)


@torch.no_grad()
def loop_states(
    model: torch.nn.Module, ids: torch.Tensor, loops: int
) -> tuple[list[torch.Tensor], torch.Tensor]:
    """([h_0 … h_T] in hidden coordinates, the model's logits at depth T) from one unroll."""
    check_lens_loops(model, loops)
    # stays eager: lens batches are prompt sets padded to their longest (a shape per batch), and
    # this one unroll is cheap next to every arm's T + 1 readouts of its states
    ctx = model.prepare(ids)
    hidden = [st.hidden for st in model.unroll(ctx, loops)]
    return hidden, model.readout(model.finish(hidden[-1], ctx))


# --------------------------------------------------------------------------- the lens object
@dataclass
class JacobianLens:
    """Fitted ``J_t`` (t = 0 … T) of one model at one depth T, with what it was fitted on.

    ``jacobians[t]`` is (d, d) float64 with ``J[i, j] = E Σ_{p'≥p} ∂h_T[p', i] / ∂h_t[p, j]``.
    """

    jacobians: dict[int, torch.Tensor]
    loops: int
    estimator: str  # exact | hutchinson | identity (the logit lens)
    n_prompts: int
    n_positions: int  # source positions averaged over
    model_hash: str
    family: str = ""
    probes: int = 0  # Hutchinson probes per prompt
    skip_positions: int = 0
    corpus: str = ""
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def d_model(self) -> int:
        return int(self.jacobians[0].shape[0])

    def steps(self) -> list[int]:
        """The loop steps 0 … T."""
        return list(range(self.loops + 1))

    # -- checks --------------------------------------------------------------------------
    def check_model(self, model: torch.nn.Module, loops: int | None = None) -> None:
        """Refuse a model other than the one fitted, or a depth other than T."""
        check_fitted(self.model_hash, self.loops, model, loops)

    # -- readout -------------------------------------------------------------------------
    def transform(self, h: torch.Tensor, t: int) -> torch.Tensor:
        """J_t · h for states h (…, d) of step t, in h's dtype."""
        check_step(t, self.loops)
        if h.shape[-1] != self.d_model:
            raise LoopLMError(f"state width {h.shape[-1]} != the lens's width {self.d_model}")
        J = self.jacobians[t].to(device=h.device, dtype=h.dtype)
        return h @ J.T

    def apply(self, model: torch.nn.Module, h: torch.Tensor, t: int) -> torch.Tensor:
        """lens_t(h) = unembed(J_t · h): logits (…, V) of states h (…, d) of loop step t."""
        return model.readout(self.transform(h, t))

    def token_directions(
        self, model: torch.nn.Module, t: int, tokens: Sequence[int] | torch.Tensor
    ) -> torch.Tensor:
        """Rows of ``D_t = W_U diag(γ) J_t`` for ``tokens``: (k, d) directions in h_t coordinates
        (``W_U`` the output head — the token embedding when tied; γ the final norm's gain, ones
        without one; the norm's 1/rms, a logit scale or soft-cap move no direction)."""
        check_step(t, self.loops)
        W = model.head_weight.detach().double()  # (V, d)
        ids = torch.as_tensor(tokens, dtype=torch.long, device=W.device).reshape(-1)
        if ids.numel() and (int(ids.min()) < 0 or int(ids.max()) >= W.shape[0]):
            bad = int(ids.min()) if int(ids.min()) < 0 else int(ids.max())
            raise LoopLMError(f"token id {bad} is outside the vocabulary [0, {W.shape[0]})")
        gain = getattr(model.norm_f, "weight", None)  # None: no final norm, or one without gain
        ones = torch.ones(W.shape[1], dtype=W.dtype, device=W.device)
        gamma = ones if gain is None else gain.detach().double()
        return (W[ids] * gamma) @ self.jacobians[t].to(W.device)  # (k, d)

    # -- merging and files ---------------------------------------------------------------
    def merge(self, other: JacobianLens) -> JacobianLens:
        """The fit on the union of both prompt sets: the source-position-weighted mean of J_t."""
        return merge_lenses([self, other])

    def state_dict(self) -> dict[str, torch.Tensor]:
        return {f"J_{t}": self.jacobians[t].contiguous() for t in self.steps()}

    def metadata(self) -> dict[str, Any]:
        return {
            "format": LENS_FORMAT,
            "kind": "jacobian_lens",
            "loops": self.loops,
            "estimator": self.estimator,
            "n_prompts": self.n_prompts,
            "n_positions": self.n_positions,
            "model_hash": self.model_hash,
            "family": self.family,
            "probes": self.probes,
            "skip_positions": self.skip_positions,
            "corpus": self.corpus,
            "d_model": self.d_model,
            "meta": self.meta,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """Write ``PATH/lens.safetensors`` + ``PATH/lens.json`` atomically; returns the folder."""
        return save_tensors(path, self.state_dict(), self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike) -> JacobianLens:
        """A lens written by :meth:`save` (its checksum verified)."""
        tensors, meta = load_tensors(path, "jacobian_lens")
        loops = int(meta["loops"])
        try:
            jac = {t: tensors[f"J_{t}"] for t in range(loops + 1)}
        except KeyError as exc:
            raise LoopLMError(f"lens {path}: missing {exc.args[0]}") from None
        return cls(
            jacobians=jac,
            loops=loops,
            estimator=meta["estimator"],
            n_prompts=int(meta["n_prompts"]),
            n_positions=int(meta["n_positions"]),
            model_hash=meta["model_hash"],
            family=meta.get("family", ""),
            probes=int(meta.get("probes", 0)),
            skip_positions=int(meta.get("skip_positions", 0)),
            corpus=meta.get("corpus", ""),
            meta=meta.get("meta", {}),
        )


def save_tensors(path: str | os.PathLike, tensors: dict[str, torch.Tensor], meta: dict) -> Path:
    from safetensors.torch import save

    from looplm.io import atomic_write_bytes, atomic_write_json

    folder = Path(path)
    data = save({k: v.detach().cpu().contiguous() for k, v in tensors.items()})
    atomic_write_bytes(folder / LENS_FILES[0], data)
    atomic_write_json(folder / LENS_FILES[1], {**meta, "sha256": hashlib.sha256(data).hexdigest()})
    return folder


def load_tensors(path: str | os.PathLike, kind: str) -> tuple[dict[str, torch.Tensor], dict]:
    from safetensors.torch import load

    folder = Path(path)
    if folder.is_file():
        folder = folder.parent
    files = [folder / name for name in LENS_FILES]
    if not all(f.is_file() for f in files):
        raise LoopLMError(f"lens {folder}: needs {' and '.join(LENS_FILES)} (not a saved lens)")
    try:
        meta = json.loads(files[1].read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise LoopLMError(f"lens {folder}: {LENS_FILES[1]} is corrupt ({exc})") from None
    if meta.get("format") != LENS_FORMAT or meta.get("kind") != kind:
        raise LoopLMError(
            f"lens {folder}: format {meta.get('format')!r} kind {meta.get('kind')!r}; "
            f"expected format {LENS_FORMAT} kind {kind!r}"
        )
    data = files[0].read_bytes()
    if hashlib.sha256(data).hexdigest() != meta.get("sha256"):
        raise LoopLMError(f"lens {folder}: {LENS_FILES[0]} does not match its checksum")
    return load(data), meta


def merge_lenses(lenses: Sequence[JacobianLens]) -> JacobianLens:
    """Fits of one model at one T on disjoint prompt sets → the fit on their union."""
    if not lenses:
        raise LoopLMError("merge_lenses needs at least one lens")
    first = lenses[0]
    for other in lenses[1:]:
        for key in ("loops", "model_hash", "estimator", "skip_positions"):
            a, b = getattr(first, key), getattr(other, key)
            if a != b:
                raise LoopLMError(f"cannot merge lenses with {key}={a!r} and {key}={b!r}")
    n = sum(lens.n_positions for lens in lenses)
    jac = {
        t: sum(lens.jacobians[t].double() * lens.n_positions for lens in lenses) / n
        for t in first.steps()
    }
    corpora = sorted({lens.corpus for lens in lenses if lens.corpus})
    probes = {lens.probes for lens in lenses}
    return replace(
        first,
        jacobians=jac,
        n_prompts=sum(lens.n_prompts for lens in lenses),
        n_positions=n,
        probes=probes.pop() if len(probes) == 1 else -1,
        corpus="+".join(corpora),
        meta={},
    )


def logit_lens(model: torch.nn.Module, loops: int) -> JacobianLens:
    """The control arm J_t = I: ``lens_t(h) = unembed(h)``."""
    check_lens_loops(model, loops)
    d = model.config.d_model
    eye = torch.eye(d, dtype=torch.float64)
    return JacobianLens(
        jacobians={t: eye for t in range(loops + 1)},
        loops=loops,
        estimator="identity",
        n_prompts=0,
        n_positions=0,
        model_hash=model_fingerprint(model),
        family=model_family(model),
    )


# --------------------------------------------------------------------------- fitting
# long: validation, the batch loop and the lens's provenance read best in one place
def fit_jacobian_lens(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    loops: int,
    mode: str = "exact",
    *,
    probes: int = 16,
    skip_positions: int = 0,
    pad_id: int | None = None,
    seed: int = 0,
    corpus: str = "",
    progress: bool = False,
    unroll: Callable[[torch.nn.Module, torch.Tensor, int], Unrolled] | None = None,
    n_states: int | None = None,
    meta: dict[str, Any] | None = None,
) -> JacobianLens:
    """Fit ``J_t`` for t = 0 … T on ``batches`` (ids (B, L) or ``(ids, targets)`` tuples).

    ``mode="exact"``: d vector-Jacobian products per batch (cotangent e_i at every target
    position); ``mode="hutchinson"``: ``probes`` Rademacher cotangents per prompt (seeded by
    ``seed``). Positions holding ``pad_id`` are neither sources nor targets; the first
    ``skip_positions`` positions of every prompt are not sources. ``unroll(model, ids, loops)
    -> Unrolled`` with ``n_states`` states replaces the loop states (the per-layer lens,
    :mod:`looplm.lens.layers`; the lens is then indexed 0 … n_states − 1 and records ``meta``).
    """
    if mode not in ESTIMATORS:
        raise LoopLMError(f"mode={mode!r}; allowed: {', '.join(ESTIMATORS)}")
    check_lens_loops(model, loops)
    _check_attention(model)
    if mode == "hutchinson" and (
        isinstance(probes, bool) or not isinstance(probes, int) or probes < 1
    ):
        raise LoopLMError(f"probes={probes!r} must be a positive integer")
    was_training = model.training
    model.eval()
    gen = torch.Generator().manual_seed(seed)
    d = model.config.d_model
    n = loops + 1 if n_states is None else n_states
    sums = [torch.zeros(d, d, dtype=torch.float64) for _ in range(n)]
    n_prompts = n_positions = 0
    batches = list(batches)
    if not batches:
        raise LoopLMError("fit_jacobian_lens needs at least one batch of prompts")
    bar = progress_bar(len(batches), f"lens T={loops} {mode}", progress)
    try:
        with frozen_weights(model):
            for batch in batches:
                ids = batch_ids(batch)
                src, tgt = position_masks(ids, pad_id, skip_positions)
                run = (unroll or unroll_for_lens)(model, ids, loops)
                accumulate(run, src, tgt, sums, mode, probes, gen)
                n_prompts += ids.shape[0]
                n_positions += int(src.sum())
                bar.update(1)
    finally:
        bar.close()
        model.train(was_training)
    if n_positions == 0:
        raise LoopLMError("the lens batches hold no source position (all padding?)")
    return JacobianLens(
        jacobians={t: sums[t] / n_positions for t in range(n)},
        loops=n - 1,
        estimator=mode,
        n_prompts=n_prompts,
        n_positions=n_positions,
        model_hash=model_fingerprint(model),
        family=model_family(model),
        probes=probes if mode == "hutchinson" else 0,
        skip_positions=skip_positions,
        corpus=corpus,
        meta=dict(meta or {}),
    )


def accumulate(
    run: Unrolled,
    src: torch.Tensor,
    tgt: torch.Tensor,
    sums: list[torch.Tensor],
    mode: str,
    probes: int,
    gen: torch.Generator,
) -> None:
    """Add Σ_{prompts, sources} of one batch's vector-Jacobian products to ``sums``."""
    final = run.final
    B, L, d = final.shape
    srcw = src.to(final.device, torch.float64)[..., None]  # (B, L, 1)
    tgtw = tgt.to(final.device, final.dtype)[..., None]
    n_vec = d if mode == "exact" else probes
    for k in range(n_vec):
        if mode == "exact":
            u = torch.zeros(B, d, dtype=final.dtype, device=final.device)
            u[:, k] = 1.0
        else:
            u = (torch.randint(0, 2, (B, d), generator=gen) * 2 - 1).to(final)
        cot = u[:, None, :] * tgtw  # (B, L, d): u at every target position p'
        grads = torch.autograd.grad(final, run.states, cot, retain_graph=k < n_vec - 1)
        for t, g in enumerate(grads):
            if g is None:  # h_T does not depend on s_t (cannot happen for a real unroll)
                continue
            g = run.hidden_grad(t, g).double() * srcw  # (B, L, d), row of Σ_{p'} ∂h_T/∂h_t
            if mode == "exact":
                sums[t][k] += g.sum(dim=(0, 1)).cpu()
            else:  # v (vᵀ J): outer product of the probe with its VJP
                sums[t] += (torch.einsum("bi,blj->ij", u.double(), g) / probes).cpu()


class _NoBar:
    def update(self, n: int = 1) -> None:
        pass

    def close(self) -> None:
        pass


def progress_bar(total: int, desc: str, enabled: bool):
    if not enabled or os.environ.get("LOOPLM_NO_PROGRESS"):
        return _NoBar()
    from tqdm import tqdm

    return tqdm(total=total, desc=desc, leave=False, dynamic_ncols=True)


def lens_logits(
    lens: JacobianLens, model: torch.nn.Module, hidden: Sequence[torch.Tensor]
) -> list[torch.Tensor]:
    """lens_t(h_t) for every step of ``hidden`` = [h_0 … h_T]: T+1 logit tensors (B, L, V)."""
    if len(hidden) != lens.loops + 1:
        raise LoopLMError(
            f"{len(hidden) - 1} loop steps given; this lens was fitted at T={lens.loops}"
        )
    with torch.no_grad():
        return [lens.apply(model, h, t) for t, h in enumerate(hidden)]
