"""The readout arms of the lens beyond J: the tuned lens, fidelity per loop step, token ranks.

* :class:`TunedLens` — an affine map per loop step, ``tuned_t(h) = unembed(A_t h + b_t)``, trained
  with Adam on KL(p_T ‖ tuned_t) over the fitting prompts from A_t = I, b_t = 0 (the third arm
  beside the J-lens and the logit lens);
* :func:`fidelity` — KL(p_T ‖ lens_t), top-1 agreement with the model's own top-1 and pass@k of
  the next token, per arm, loop step and prompt; :meth:`Fidelity.summary` adds t intervals and
  paired bootstrap intervals between arms (:mod:`looplm.results.stats`); :func:`lens_band` reads
  the steps where one arm beats another;
* :func:`token_ranks` — the rank of a given token under each arm at each loop step.

Every arm is an object with ``.loops``, ``.check_model(model)`` and ``.apply(model, h, t)``.
"""

from __future__ import annotations

import math
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from looplm.errors import LoopLMError
from looplm.lens.jacobian import (
    LENS_FORMAT,
    Batch,
    batch_ids,
    check_fitted,
    check_lens_loops,
    check_step,
    frozen_weights,
    load_tensors,
    loop_states,
    model_family,
    model_fingerprint,
    position_masks,
    progress_bar,
    save_tensors,
)
from looplm.targets import IGNORE_INDEX


# --------------------------------------------------------------------------- tuned lens
@dataclass
class TunedLens:
    """An affine map per loop step, ``tuned_t(h) = unembed(A_t h + b_t)``, trained to the model's
    final distribution (KL(p_T ‖ tuned_t) on the fitting prompts); A_t starts at I, b_t at 0."""

    weights: dict[int, torch.Tensor]  # A_t (d, d)
    biases: dict[int, torch.Tensor]  # b_t (d,)
    loops: int
    n_prompts: int
    model_hash: str
    family: str = ""
    train_steps: int = 0
    final_kl: list[float] = field(default_factory=list)  # training KL per step at the end

    @property
    def d_model(self) -> int:
        return int(self.weights[0].shape[0])

    def steps(self) -> list[int]:
        return list(range(self.loops + 1))

    def transform(self, h: torch.Tensor, t: int) -> torch.Tensor:
        """A_t h + b_t for states h (…, d) of step t."""
        check_step(t, self.loops)
        A = self.weights[t].to(device=h.device, dtype=h.dtype)
        return h @ A.T + self.biases[t].to(device=h.device, dtype=h.dtype)

    def apply(self, model: torch.nn.Module, h: torch.Tensor, t: int) -> torch.Tensor:
        """unembed(A_t h + b_t): logits (…, V)."""
        return model.readout(self.transform(h, t))

    def check_model(self, model: torch.nn.Module, loops: int | None = None) -> None:
        """Refuse a model other than the one fitted, or a depth other than T."""
        check_fitted(self.model_hash, self.loops, model, loops)

    def metadata(self) -> dict[str, Any]:
        return {
            "format": LENS_FORMAT,
            "kind": "tuned_lens",
            "loops": self.loops,
            "n_prompts": self.n_prompts,
            "model_hash": self.model_hash,
            "family": self.family,
            "train_steps": self.train_steps,
            "final_kl": self.final_kl,
        }

    def save(self, path: str | os.PathLike) -> Path:
        """``PATH/lens.safetensors`` + ``PATH/lens.json``, written atomically."""
        tensors = {f"A_{t}": self.weights[t] for t in self.steps()}
        tensors.update({f"b_{t}": self.biases[t] for t in self.steps()})
        return save_tensors(path, tensors, self.metadata())

    @classmethod
    def load(cls, path: str | os.PathLike) -> TunedLens:
        tensors, meta = load_tensors(path, "tuned_lens")
        loops = int(meta["loops"])
        return cls(
            weights={t: tensors[f"A_{t}"] for t in range(loops + 1)},
            biases={t: tensors[f"b_{t}"] for t in range(loops + 1)},
            loops=loops,
            n_prompts=int(meta["n_prompts"]),
            model_hash=meta["model_hash"],
            family=meta.get("family", ""),
            train_steps=int(meta.get("train_steps", 0)),
            final_kl=list(meta.get("final_kl", [])),
        )


def _collect_states(
    model: torch.nn.Module,
    batches: Sequence[Batch],
    loops: int,
    pad_id: int | None,
    max_positions: int,
    seed: int,
) -> tuple[torch.Tensor, torch.Tensor, int]:
    """States (T+1, N, d) and final log-probabilities (N, V) at up to ``max_positions`` non-pad
    positions (a seeded subsample), and the prompt count."""
    hs, logps, n_prompts = [], [], 0
    for batch in batches:
        ids = batch_ids(batch)
        _, tgt = position_masks(ids, pad_id)
        hidden, logits = loop_states(model, ids, loops)
        hs.append(torch.stack([h[tgt] for h in hidden]))  # (T+1, n, d)
        logps.append(torch.log_softmax(logits[tgt], dim=-1))
        n_prompts += ids.shape[0]
    H, P = torch.cat(hs, dim=1), torch.cat(logps)
    if H.shape[1] > max_positions:
        keep = torch.randperm(H.shape[1], generator=torch.Generator().manual_seed(seed))
        keep = keep[:max_positions].to(H.device)
        H, P = H[:, keep], P[keep]
    return H, P, n_prompts


def fit_tuned_lens(
    model: torch.nn.Module,
    batches: Iterable[Batch],
    loops: int,
    *,
    steps: int = 250,
    lr: float = 3e-3,
    pad_id: int | None = None,
    max_positions: int = 4096,
    seed: int = 0,
    progress: bool = False,
) -> TunedLens:
    """Train A_t, b_t (t = 0 … T) with Adam on KL(p_T ‖ unembed(A_t h_t + b_t)), full batch.

    The steps' maps share no parameter, so one joint loss trains each exactly as alone.
    """
    check_lens_loops(model, loops)
    if isinstance(steps, bool) or not isinstance(steps, int) or steps < 0:
        raise LoopLMError(f"steps={steps!r} must be an integer >= 0")
    batches = list(batches)
    if not batches:
        raise LoopLMError("fit_tuned_lens needs at least one batch of prompts")
    was_training = model.training
    model.eval()
    try:
        with frozen_weights(model):
            H, P, n_prompts = _collect_states(model, batches, loops, pad_id, max_positions, seed)
            w = model.tok_emb.weight
            H, P = H.to(w.dtype), P.to(w.dtype)  # (T+1, N, d), (N, V)
            d = H.shape[-1]
            A = torch.eye(d, dtype=w.dtype, device=w.device).repeat(loops + 1, 1, 1)
            A.requires_grad_(True)  # (T+1, d, d)
            b = torch.zeros(loops + 1, 1, d, dtype=w.dtype, device=w.device, requires_grad=True)
            opt = torch.optim.Adam([A, b], lr=lr)
            bar = progress_bar(steps, f"tuned lens T={loops}", progress)
            kl = torch.zeros(loops + 1)
            for it in range(steps + 1):
                with torch.enable_grad():
                    z = torch.baddbmm(b, H, A.transpose(1, 2))  # A_t h + b_t
                    q = torch.log_softmax(model.readout(z), dim=-1)
                    kl = (P.exp() * (P - q)).sum(-1).mean(-1)  # (T+1,)
                    if it == steps:
                        break
                    opt.zero_grad()
                    kl.sum().backward()
                    opt.step()
                bar.update(1)
            bar.close()
    finally:
        model.train(was_training)
    return TunedLens(
        weights={t: A[t].detach().double() for t in range(loops + 1)},
        biases={t: b[t, 0].detach().double() for t in range(loops + 1)},
        loops=loops,
        n_prompts=n_prompts,
        model_hash=model_fingerprint(model),
        family=model_family(model),
        train_steps=steps,
        final_kl=[float(x) for x in kl.detach()],
    )


# --------------------------------------------------------------------------- fidelity
FIDELITY_METRICS = ("kl", "top1", "pass_at_k")


@dataclass
class Fidelity:
    """Per arm, metric and loop step: one value per prompt (NaN where a prompt has none)."""

    loops: int
    k: int
    arms: list[str]
    values: dict[str, dict[str, torch.Tensor]]  # arm → metric → (T+1, n_prompts) float64

    def summary(
        self, *, confidence: float = 0.95, n_boot: int = 2000, seed: int = 0
    ) -> dict[str, Any]:
        """Per arm and metric: the mean per step with a t interval; per pair of arms the paired
        delta per step (first arm − second) with its bootstrap interval over prompts."""
        from looplm.results.stats import delta_stats, t_halfwidth

        out: dict[str, Any] = {"loops": self.loops, "k": self.k, "arms": {}, "paired": {}}
        for arm in self.arms:
            out["arms"][arm] = {}
            for metric in FIDELITY_METRICS:
                rows = []
                for t in range(self.loops + 1):
                    v = _finite(self.values[arm][metric][t])
                    mean = sum(v) / len(v) if v else math.nan
                    rows.append({"mean": mean, "ci": t_halfwidth(v, confidence), "n": len(v)})
                out["arms"][arm][metric] = rows
        for i, a in enumerate(self.arms):
            for b in self.arms[i + 1 :]:
                key = f"{a}-{b}"
                out["paired"][key] = {}
                for metric in FIDELITY_METRICS:
                    rows = []
                    for t in range(self.loops + 1):
                        d = self.values[a][metric][t] - self.values[b][metric][t]
                        v = _finite(d)
                        st = delta_stats(v, confidence=confidence, n_boot=n_boot, boot_seed=seed)
                        rows.append({**st, "n": len(v)})
                    out["paired"][key][metric] = rows
        return out


def _finite(x: torch.Tensor) -> list[float]:
    return [float(v) for v in x.tolist() if math.isfinite(v)]


def fidelity(
    model: torch.nn.Module,
    arms: dict[str, Any],
    batches: Iterable[Batch],
    loops: int,
    *,
    k: int = 5,
    pad_id: int | None = None,
    states=None,
) -> Fidelity:
    """KL(p_T ‖ lens_t), top-1 agreement with the model's own top-1, and pass@k of the next token
    for every arm (objects with ``.apply(model, h, t)``) at every loop step, per prompt.

    KL and top-1 average over a prompt's non-pad positions; pass@k over its supervised targets
    (a batch ``(ids, targets)`` with −100 where unsupervised; ids alone: the next token).
    ``states(model, ids) -> ([states], logits)`` gives what the arms read (default: the loop
    states h_0 … h_T and the logits at T; the per-layer lens passes its residual streams).
    """
    check_lens_loops(model, loops)
    if isinstance(k, bool) or not isinstance(k, int) or k < 1:
        raise LoopLMError(f"k={k!r} must be a positive integer")
    for name, arm in arms.items():
        if arm.loops != loops:
            raise LoopLMError(f"arm {name!r} was fitted at T={arm.loops}, not at loops={loops}")
        arm.check_model(model)
    cols: dict[str, dict[str, list[torch.Tensor]]] = {
        a: {m: [] for m in FIDELITY_METRICS} for a in arms
    }
    model_was = model.training
    model.eval()
    try:
        for batch in batches:
            ids = batch_ids(batch)
            targets = _targets(batch, ids, pad_id)
            _, mask = position_masks(ids, pad_id)
            hidden, logits = (states or (lambda m, x: loop_states(m, x, loops)))(model, ids)
            logp = torch.log_softmax(logits.double(), dim=-1)
            top1 = logits.argmax(-1)
            sup = targets != IGNORE_INDEX
            m = mask.double()
            for name, arm in arms.items():
                per = {key: [] for key in FIDELITY_METRICS}
                for t, h in enumerate(hidden):
                    with torch.no_grad():
                        q = torch.log_softmax(arm.apply(model, h, t).double(), dim=-1)
                    kl = (logp.exp() * (logp - q)).sum(-1)  # (B, L)
                    per["kl"].append((kl * m).sum(1) / m.sum(1))
                    agree = (q.argmax(-1) == top1).double()
                    per["top1"].append((agree * m).sum(1) / m.sum(1))
                    topk = q.topk(min(k, q.shape[-1]), dim=-1).indices
                    hit = (topk == targets.clamp(min=0)[..., None]).any(-1).double() * sup
                    n_sup = sup.double().sum(1)
                    per["pass_at_k"].append(hit.sum(1) / n_sup)  # NaN without targets
                for key in FIDELITY_METRICS:
                    cols[name][key].append(torch.stack(per[key]).cpu())  # (T+1, B)
    finally:
        model.train(model_was)
    values = {a: {m: torch.cat(cols[a][m], dim=1) for m in FIDELITY_METRICS} for a in arms}
    return Fidelity(loops, k, list(arms), values)


def _targets(batch: Batch, ids: torch.Tensor, pad_id: int | None) -> torch.Tensor:
    """The supervised next tokens of a batch: its targets, or the ids shifted by one."""
    if isinstance(batch, (tuple, list)) and len(batch) > 1:
        y = batch[1]
        if y.shape != ids.shape:
            raise LoopLMError(f"targets {tuple(y.shape)} do not match ids {tuple(ids.shape)}")
        return y
    y = torch.full_like(ids, IGNORE_INDEX)
    y[:, :-1] = ids[:, 1:]
    if pad_id is not None:
        y[y == pad_id] = IGNORE_INDEX
    return y


def lens_band(
    summary: dict[str, Any], better: str = "jacobian", worse: str = "logit", metric: str = "kl"
) -> dict[str, Any]:
    """Loop steps where ``better`` beats ``worse`` with a paired interval that excludes zero
    (lower KL, higher top-1 / pass@k), as steps and as fractions t/T of the depth."""
    T = summary["loops"]
    key, sign = f"{better}-{worse}", 1.0
    if key not in summary["paired"]:
        key, sign = f"{worse}-{better}", -1.0
    if key not in summary["paired"]:
        raise LoopLMError(f"no paired comparison of arms {better!r} and {worse!r}")
    if metric == "kl":
        sign = -sign  # lower is better
    steps = []
    for t, row in enumerate(summary["paired"][key][metric]):
        lo, hi = sign * row["boot_lo"], sign * row["boot_hi"]
        if min(lo, hi) > 0:
            steps.append(t)
    return {
        "metric": metric,
        "steps": steps,
        "fractions": [t / T for t in steps],
        "range": [min(steps) / T, max(steps) / T] if steps else None,
    }


@torch.no_grad()
def token_ranks(
    model: torch.nn.Module,
    arms: dict[str, Any],
    ids: torch.Tensor,
    loops: int,
    positions: torch.Tensor,
    tokens: torch.Tensor,
) -> dict[str, torch.Tensor]:
    """Per arm, the rank (0 = top-1) of ``tokens[b]`` in lens_t's logits at ``positions[b]`` of
    prompt b, for every loop step: arm → (T+1, B) int64. E.g. where a bridge entity that never
    appears in a prompt surfaces in the loop."""
    check_lens_loops(model, loops)
    B = ids.shape[0]
    positions = torch.as_tensor(positions, dtype=torch.long).reshape(-1)
    tokens = torch.as_tensor(tokens, dtype=torch.long).reshape(-1)
    if positions.numel() != B or tokens.numel() != B:
        raise LoopLMError(f"one position and one token per prompt needed ({B} prompts)")
    if int(positions.min()) < 0 or int(positions.max()) >= ids.shape[1]:
        raise LoopLMError(f"positions must lie in 0 … {ids.shape[1] - 1}")
    for name, arm in arms.items():
        if arm.loops != loops:
            raise LoopLMError(f"arm {name!r} was fitted at T={arm.loops}, not at loops={loops}")
    hidden, _ = loop_states(model, ids, loops)
    rows = torch.arange(B)
    out = {}
    for name, arm in arms.items():
        ranks = []
        for t, h in enumerate(hidden):
            logits = arm.apply(model, h[rows, positions], t)  # (B, V)
            target = logits[rows, tokens]
            ranks.append((logits > target[:, None]).sum(-1))
        out[name] = torch.stack(ranks)
    return out
