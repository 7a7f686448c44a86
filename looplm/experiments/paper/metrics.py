"""Per-seed measured values of an entry's rows: the diagnostics statistics and the metric at one
named point, shared by the side-by-side report and the verdicts."""

from __future__ import annotations

import math
from typing import Any

# The scale tiers a reported row or a claim may name (keys of looplm.experiments.paper.entries.TIERS).
TIER_NAMES = (None, "22m", "50m", "95.6m", "ctx512", "ctx1024")


def diagnostic_value(metric: str, step: int, extra: dict[str, Any]) -> float | None:
    """One diagnostics statistic (R_t, gain_t, KL at a loop, convergence, steering) of one
    checkpoint's diagnostics row ``extra``; None when the row does not hold it."""
    conv, steer = extra.get("convergence") or {}, extra.get("steering") or {}
    per_step = {"R": extra.get("R_per_step"), "gain": extra.get("gain_per_step")}
    v = None
    if metric in per_step:
        seq = per_step[metric] or []
        v = seq[step] if step < len(seq) else None
    elif metric == "kl_loop":
        kl = extra.get("kl_per_loop") or []
        v = kl[step - 1] if 0 < step <= len(kl) else None
    elif metric == "median_convergence_loop":
        v = extra.get("median_convergence_depth")
    elif metric == "still_updating_at_8":
        v = conv.get("still_updating_frac_at_ref_depth")
    elif metric in ("ray_cosine_min", "ray_cosine_max"):
        v = (steer.get("ray_cosine") or {}).get(metric.rsplit("_", 1)[1])
    elif metric == "dose_fraction_rms":
        v = ((steer.get("dose") or {}).get("rms_displacement_over_push") or {}).get("mean")
    elif metric in ("dose_fraction_min", "dose_fraction_max"):  # over inputs and the gains
        end = metric.rsplit("_", 1)[1]
        dose = steer.get("dose") or {}
        ends = [
            ((dose[k] or {}).get("displacement_over_push") or {}).get(end)
            for k in dose
            if k.startswith("gain_")
        ]
        ends = [x for x in ends if x is not None]
        v = (min if end == "min" else max)(ends) if ends else None
    elif metric in ("bias_max", "raw_bias_max"):  # max_t max |b_t| (masked) or |b~_t| (raw)
        v = extra.get("bias_max_abs" if metric == "bias_max" else "raw_bias_max_abs")
    return None if v is None else float(v)


def seed_values(m: Any, method: str, point: dict[str, Any]) -> dict[int, float]:
    """seed → the metric of ``method`` at one point (a depth, budget or diagnostics step), read
    from an entry's measured rows ``m`` (:class:`looplm.experiments.paper.report._Measured`)."""
    metric, scale = point.get("metric", "ppl"), point.get("scale")
    if metric == "ppl":
        return m.fixed(method, scale, int(point["depth"]))
    if metric == "adaptive_ppl":
        rows = m.rows(method, scale, adaptive_mode=f"maxtoken:budget={point['budget']}")
        return {s: r.ppl for s, r in rows.items()}
    if metric in ("lambada_ppl_k", "lambada_acc_pct"):
        rows = m.rows(method, scale, dataset="lambada", depth=int(point["depth"]), adaptive_mode="")
        if metric == "lambada_ppl_k":
            return {s: r.ppl / 1e3 for s, r in rows.items()}
        return {s: 100.0 * r.extra["n_correct"] / r.extra["n_examples"]
                for s, r in rows.items() if r.extra.get("n_examples")}  # fmt: skip
    if metric == "transfer_ppl_k":
        rows = m.rows(method, scale, dataset=point["dataset"], split="validation",
                      depth=int(point["depth"]), adaptive_mode="")  # fmt: skip
        return {s: r.ppl / 1e3 for s, r in rows.items() if not r.eval_tag.startswith("diagnostics")}
    if metric == "adaptive_depth_error":  # |achieved mean depth − budget|
        b = point["budget"]
        rows = m.rows(method, scale, adaptive_mode=f"maxtoken:budget={b}")
        return {s: abs(r.extra.get("mean_depth", math.nan) - b) for s, r in rows.items()}
    if metric == "kl_excess_nll":
        return _kl_excess(m, method, scale, float(point["threshold"]))
    out = {}
    for s, extra in m.diagnostics(method, scale).items():
        v = diagnostic_value(metric, int(point.get("step", 0)), extra)
        if v is not None:
            out[s] = v
    return out


def _kl_excess(m: Any, method: str, scale: str | None, threshold: float) -> dict[int, float]:
    """seed → NLL of KL halting at ``threshold`` minus uniform depth's NLL at the same mean depth
    (linear between the two measured fixed depths around it; NLL = log PPL). Positive: halting
    is worse than spending the same mean number of loops on every token."""
    out = {}
    mode = f"kl:thr={threshold:g}"
    for s, r in m.rows(method, scale, adaptive_mode=mode).items():
        depth = r.extra.get("mean_depth")
        fixed = {}
        for d in range(1, 129):
            got = m.fixed(method, scale, d).get(s)
            if got is not None:
                fixed[d] = math.log(got)
        below = [d for d in fixed if d <= depth]
        above = [d for d in fixed if d >= depth]
        if depth is None or not below or not above:
            continue
        lo, hi = max(below), min(above)
        w = 0.0 if hi == lo else (depth - lo) / (hi - lo)
        out[s] = math.log(r.ppl) - ((1 - w) * fixed[lo] + w * fixed[hi])
    return out
