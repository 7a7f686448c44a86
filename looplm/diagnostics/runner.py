"""All diagnostics of one looped model over measured batches, as plain numbers and arrays.

:func:`diagnose_model` runs, per batch of fixed shape (B, L): the ordinary unroll to T, the pointwise
anchor response (b_t, b̃_t, R_t, E_Δ,t, random-direction gain), the bias-subtraction counterfactual
E_t of Eq. 10 with its effect on the NLL at T, and the per-token convergence statistics; then, once,
the anchor-start steering rollouts on the first inputs and the numerical Lemma 1 / Theorem 2 /
Corollary 3 check on a small float64 slice with the raw (pre-mask) map. Batch values are averaged
over batches (the paper's aggregation for R_t). Results are JSON-ready (NaN → None).
"""

from __future__ import annotations

import copy
import math
import time
from collections.abc import Sequence
from dataclasses import asdict

import numpy as np
import torch

from looplm.diagnostics.anchor import AnchorMap, anchor_response, mean_square
from looplm.diagnostics.convergence import (
    TOKEN_TYPES,
    convergence_depth,
    depth_by_type,
    relative_state_change,
    successive_kl,
    token_types,
)
from looplm.diagnostics.counterfactual import bias_subtraction, counterfactual_check
from looplm.diagnostics.settings import DiagnoseSettings
from looplm.diagnostics.steering import anchor_start_steering
from looplm.errors import LoopLMError
from looplm.settings import check_fields

DiagnoseOptions = DiagnoseSettings  # the name diagnose_model took before the settings were one


def clean_json(obj):
    """Replace NaN/inf by None recursively (strict JSON), tensors/numpy scalars by numbers."""
    if isinstance(obj, dict):
        return {str(k): clean_json(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [clean_json(v) for v in obj]
    if isinstance(obj, (torch.Tensor, np.ndarray, np.generic)):
        return clean_json(obj.tolist())
    if isinstance(obj, float) and not math.isfinite(obj):
        return None
    return obj


def _mean_lists(rows: Sequence[Sequence[float]]) -> list[float]:
    return np.asarray(rows, dtype=np.float64).mean(axis=0).tolist()


def _progress(total: int, desc: str, enabled: bool):
    from tqdm.auto import tqdm

    from looplm.progress import progress_enabled

    return tqdm(total=total, desc=desc, disable=not (enabled and progress_enabled()), leave=False)


@torch.no_grad()
def _nll_sum(model, h: torch.Tensor, targets: torch.Tensor) -> tuple[float, int]:
    s = model.score(h, targets, per_token=True, dtype=torch.float64)
    return float(s.nll.sum()), int(s.n_tokens)


def _check_slice(model, ids: torch.Tensor, opts: DiagnoseSettings) -> dict:
    """Lemma 1 / Theorem 2 / Corollary 3 on a float64 copy with the raw map (see module doc)."""
    m64 = copy.deepcopy(model).double().eval()
    for p in m64.parameters():
        p.requires_grad_(False)
    x = ids[: opts.check_examples, : opts.check_tokens]
    with torch.no_grad():  # eager: a float64 copy, run once, for torch.func's jvp/vjp below
        out = m64(x, loops=1, return_states=True)
    tmap = AnchorMap(m64, out.context, mask=False)
    delta0 = out.states[0] - out.context.anchor
    res = counterfactual_check(
        tmap,
        delta0,
        opts.check_steps,
        n_nodes=opts.check_nodes,
        max_panels=opts.check_panels,
        power_iters=opts.power_iters,
        generator=torch.Generator().manual_seed(opts.seed + 7),
    )
    res["map"] = "raw (pre-mask)"
    res["slice_shape"] = list(x.shape)
    return res


class _Measured:
    """What the per-batch passes accumulate."""

    def __init__(self, T: int) -> None:
        self.per_batch: dict[str, list] = {}
        self.kl_sum = torch.zeros(T, dtype=torch.float64)
        self.chg_sum = torch.zeros(T, dtype=torch.float64)
        self.n_tok = 0
        self.depths: list[torch.Tensor] = []
        self.types: list[torch.Tensor] = []
        self.valid: list[torch.Tensor] = []
        self.kl_ref: list[torch.Tensor] = []
        self.nll = self.nll_bar = 0.0
        self.n_scored = 0

    def add_batch(self, model, x, y, opts: DiagnoseSettings, gen, tokenizer, pad_id) -> None:
        """The unroll to T, the anchor response and gain, the counterfactual, convergence."""
        T = opts.loops
        # stays eager: one forward next to the per-step maps below (model.step per probe
        # direction, the counterfactual's steps), which dominate a batch and run eager anyway
        out = model(x, loops=T, return_states=True)
        ctx, states = out.context, out.states
        res = anchor_response(
            model, ctx, states, n_dirs=opts.n_dirs, eps_fd=opts.eps_fd, generator=gen,
            keep_bias=True,
        )  # fmt: skip
        biases = res.pop("bias")
        for k, v in res.items():
            self.per_batch.setdefault(k, []).append(v)
        # bias-subtraction counterfactual (Eq. 10) with the model's own map
        cf = bias_subtraction(
            AnchorMap(model, ctx, mask=True), states[0] - ctx.anchor, T, biases=biases
        )
        del biases
        self.per_batch.setdefault("E_energy", []).append(cf["E_energy"])
        # readouts read what the model's readout reads: h through the exit map and any coda
        s, n = _nll_sum(model, model.finish(ctx.anchor + cf["delta_T"], ctx), y)
        s_bar, _ = _nll_sum(model, model.finish(ctx.anchor + cf["delta_bar_T"], ctx), y)
        self.nll, self.nll_bar, self.n_scored = (
            self.nll + s,
            self.nll_bar + s_bar,
            self.n_scored + n,
        )
        # convergence
        read = [model.finish(h, ctx) for h in states]  # the states themselves without a coda
        kl = successive_kl(model.readout, read, model.config.vocab_size).cpu()  # (T, B, L)
        del read
        chg = relative_state_change(states).cpu()
        valid = torch.ones(x.shape, dtype=torch.bool) if pad_id is None else (x != pad_id).cpu()
        self.kl_sum += (kl * valid).sum(dim=(1, 2))
        self.chg_sum += (chg * valid).sum(dim=(1, 2))
        self.n_tok += int(valid.sum())
        self.depths.append(convergence_depth(kl, opts.kl_threshold))
        self.kl_ref.append(kl[min(opts.ref_depth, T) - 1])
        self.valid.append(valid)
        if tokenizer is not None:
            self.types.append(token_types(x.cpu(), tokenizer))
        else:
            self.types.append(torch.full(x.shape, TOKEN_TYPES.index("other"), dtype=torch.long))

    def step_means(self) -> dict[str, list[float]]:
        """Per-step values averaged over batches (the gain's std pooled within and between)."""
        mean = {k: _mean_lists(v) for k, v in self.per_batch.items() if k != "gain_std"}
        g_means = np.asarray(self.per_batch["gain"])  # (n_batches, T)
        g_std = np.asarray(self.per_batch["gain_std"])
        mean["gain_std"] = np.sqrt((g_std**2).mean(0) + g_means.var(0)).tolist()
        return mean

    def convergence(self, opts: DiagnoseSettings, tokenizer) -> dict:
        T = opts.loops
        depth = torch.cat([d.flatten() for d in self.depths])
        types = torch.cat([t.flatten() for t in self.types])
        valid = torch.cat([v.flatten() for v in self.valid])
        kl_ref = torch.cat([k.flatten() for k in self.kl_ref])[valid]
        d_valid = depth[valid].double()
        some = d_valid.numel() > 0
        return {
            "threshold": opts.kl_threshold,
            "kl_per_loop": (self.kl_sum / max(self.n_tok, 1)).tolist(),  # t = 1 … T
            "state_change_per_loop": (self.chg_sum / max(self.n_tok, 1)).tolist(),
            "n_tokens": self.n_tok,
            "mean_depth": float(d_valid.mean()) if some else None,
            "median_depth": float(d_valid.median()) if some else None,
            "not_converged_frac": float((d_valid > T).double().mean()) if some else None,
            "ref_depth": min(opts.ref_depth, T),
            "still_updating_frac_at_ref_depth": float((kl_ref >= opts.kl_threshold).double().mean())
            if kl_ref.numel()
            else None,
            "depth_by_type": depth_by_type(depth, types, T, valid),
            "token_types_from": getattr(tokenizer, "name", None),
        }

    def summary(self, mean: dict, convergence: dict, check: dict | None, T: int) -> dict:
        last = T - 1
        n = self.n_scored
        return {
            "bias_energy_t0": mean["bias_energy"][0],
            "bias_energy_last": mean["bias_energy"][last],
            "bias_max_abs": max(max(r) for r in self.per_batch["bias_max_abs"]),
            "raw_bias_max_abs": max(max(r) for r in self.per_batch["raw_bias_max_abs"]),
            "R_t0": mean["ratio"][0],
            "R_last": mean["ratio"][last],
            "anchor_energy_last": mean["anchor_energy"][last],  # E_Δ,T−1 (the paper's E_Δ,47)
            "anchor_energy_T": mean["anchor_energy"][T],
            "gain_t0": mean["gain"][0],
            "gain_last": mean["gain"][last],
            "E_energy_T": mean["E_energy"][T],
            "nll_T": self.nll / n if n else None,
            "nll_T_bias_subtracted": self.nll_bar / n if n else None,
            "n_scored_tokens": n,
            "sum_nll_T": self.nll,
            "kl_loop2": convergence["kl_per_loop"][1] if T >= 2 else None,
            "kl_last": convergence["kl_per_loop"][last],
            "median_convergence_depth": convergence["median_depth"],
            "lemma1_max_rel_error": check["lemma1_max_rel_error"] if check else None,
            "last_step": last,
        }


def _check_batches(model: torch.nn.Module, batches: Sequence) -> None:
    if not getattr(model, "is_looped", False):
        raise LoopLMError("diagnostics need a looped model with a shared block and an anchor")
    if not batches:
        raise LoopLMError("no batches to measure (check --batches and the data)")
    shapes = {tuple(x.shape) for x, _ in batches}
    if len(shapes) != 1:
        raise LoopLMError(f"measured batches must share one shape, got {sorted(shapes)}")


# long: the diagnose pipeline and the one results dict it writes
def diagnose_model(
    model: torch.nn.Module,
    batches: Sequence[tuple[torch.Tensor, torch.Tensor]],
    opts: DiagnoseSettings | None = None,
    *,
    tokenizer=None,
    pad_id: int | None = None,
    progress: bool = True,
) -> tuple[dict, dict[str, np.ndarray]]:
    """Run every diagnostic on ``batches`` of (input_ids, targets), all of one shape (B, L).

    Args:
        model: a looped model (``model.is_looped``), already on its device, dtype and eval mode.
        batches: measured batches; targets use ``IGNORE_INDEX`` for unscored positions.
        opts: settings; defaults follow the paper.
        tokenizer: decodes ids for the token-type breakdown (None: all tokens typed ``other``).
        pad_id: positions holding this id are left out of the convergence statistics.
        progress: show a progress bar (on a TTY, unless LOOPLM_NO_PROGRESS=1).

    Returns:
        (results dict, arrays for the steering figure).
    """
    opts = opts or DiagnoseSettings()
    check_fields(opts)
    _check_batches(model, batches)
    model.eval()
    device = next(model.parameters()).device
    T = opts.loops
    gen = torch.Generator().manual_seed(opts.seed)
    t_start = time.time()
    acc = _Measured(T)
    bar = _progress(len(batches), "diagnose", progress)
    for x, y in batches:
        acc.add_batch(model, x.to(device), y.to(device), opts, gen, tokenizer, pad_id)
        bar.update(1)
    bar.close()
    mean = acc.step_means()
    convergence = acc.convergence(opts, tokenizer)
    steering, arrays = None, {}
    if opts.steer_inputs > 0:  # anchor-start steering on the first inputs
        x0 = torch.cat([x for x, _ in batches])[: opts.steer_inputs].to(device)
        with torch.no_grad():
            ctx0 = model.prepare(x0)
        steering, arrays = anchor_start_steering(
            model, ctx0, T, gains=opts.dose_gains, ref_depth=opts.ref_depth
        )
    check = _check_slice(model, batches[0][0].to(device), opts) if opts.check_steps > 0 else None
    summary = acc.summary(mean, convergence, check, T)
    B, L = batches[0][0].shape
    results = {
        "loops": T,
        "batch_shape": [int(B), int(L)],
        "n_batches": len(batches),
        "dtype": str(next(model.parameters()).dtype).replace("torch.", ""),
        "device": str(device),
        "options": asdict(opts),
        "summary": summary,
        "per_step": mean,
        "steering": steering,
        "counterfactual": {
            "map": "masked (the model's own map)",
            "E_energy": mean["E_energy"],
            "nll_T": summary["nll_T"],
            "nll_T_bias_subtracted": summary["nll_T_bias_subtracted"],
            "check": check,
        },
        "convergence": convergence,
        "elapsed_s": time.time() - t_start,
    }
    return clean_json(results), arrays


__all__ = ["DiagnoseOptions", "DiagnoseSettings", "clean_json", "diagnose_model", "mean_square"]
