"""Figures of ``looplm diagnose`` (matplotlib, Agg backend, PNG). They read the files the command
wrote (``diagnostics.json``, ``steering.npz``), never live objects.

* ``r_t.png`` — R_t bars by method (paper Figure 5 style): bars at the last step, open markers at
  t = 0, dashed unit reference.
* ``<label>/steering.png`` — anchor-start steering (paper Figure 4 style): (a) trajectories and
  forcing rays, (b) injection-gain dose-response relative to the injection-removed rollout.
* ``r_t_by_scale.png`` (``looplm paper report`` on a grid with scale tiers) — R_t per tier and
  method, mean over seeds (paper Figure 5 by scale).
* ``convergence.png`` — successive-output KL per loop, per-token state change, convergence depth
  by token type.
* ``anchor_steps.png`` — R_t, E_Δ,t, random-direction gain and the counterfactual E_t per step.
"""

from __future__ import annotations

import json
import os
from collections.abc import Sequence
from pathlib import Path

import matplotlib.lines
import matplotlib.patches
import matplotlib.ticker
import numpy as np

from looplm.results.plotting import CYCLE, method_color, new_figure, save_png


def _save(fig, path: str | os.PathLike) -> None:
    save_png(fig, path, dpi=130, tight=True)


def load_result(path: str | os.PathLike) -> dict:
    """A ``diagnostics.json`` written by ``looplm diagnose``."""
    return json.loads(Path(path).read_text())


def _val(x) -> float:
    return float("nan") if x is None else float(x)


def last_step_text(results: Sequence[dict]) -> str:
    """``t = 47 (T = 48; trained to T ≤ 8)``: the step the bars show, and, where the unroll goes
    past the depth the models were trained to, that it is extra-loop."""
    steps = sorted({r["summary"]["last_step"] for r in results})
    text = f"t = {'/'.join(map(str, steps))}"
    trained = sorted({r.get("convergence", {}).get("ref_depth") for r in results} - {None})
    if trained and steps[-1] + 1 > trained[-1]:
        loops = "/".join(str(t + 1) for t in steps)
        text += f" (T = {loops}, extra-loop: trained to T ≤ {'/'.join(map(str, trained))})"
    return text


def plot_rt_bars(results: Sequence[dict], path: str | os.PathLike) -> None:
    """R_t at the last step (bars) and at t = 0 (open markers) per checkpoint; unit reference."""
    labels = [r["label"] for r in results]
    last = [_val(r["summary"]["R_last"]) for r in results]
    first = [_val(r["summary"]["R_t0"]) for r in results]
    fig, ax = new_figure((max(4.0, 1.3 * len(results) + 2), 3.6), layout=None)
    x = np.arange(len(results))
    colors = [method_color(r["method"], i) for i, r in enumerate(results)]
    ax.bar(x, np.nan_to_num(last), color=colors, width=0.6)
    ax.scatter(x, first, facecolors="none", edgecolors="k", s=60, zorder=3)
    ax.axhline(1.0, ls="--", color="0.4", lw=1)
    handles = [
        matplotlib.patches.Patch(color="0.6", label="bars: last step t = T−1"),
        matplotlib.lines.Line2D(
            [], [], ls="", marker="o", mfc="none", mec="k", label="open markers: t = 0"
        ),
        matplotlib.lines.Line2D([], [], ls="--", color="0.4", label="unit reference (R_t = 1)"),
    ]
    top = max([v for v in last + first if np.isfinite(v)] + [1.0])
    for xi, v in zip(x, last):
        # an exact zero is a finding (the forcing bias vanishes at the anchor), not a missing bar
        text = "0 exactly\n(b_t ≡ 0)" if v == 0 else f"{v:.2f}"
        ax.text(xi, (v if np.isfinite(v) else 0) + 0.02 * top, text, ha="center", va="bottom")
    if any(v == 0 for v in last):
        ax.text(0.5, 0.55, "R_t = 0 exactly: the forcing bias b_t(e) = T_t(0; e) is zero\n"
                "(no bar to draw; SCSE's zero-deviation mask makes it so)",
                transform=ax.transAxes, ha="center", va="center", fontsize=8, color="0.3")  # fmt: skip
    ax.set_ylim(0, top * 1.25)
    ax.set_xticks(x, labels, rotation=15 if len(results) > 3 else 0)
    ax.set_ylabel("R_t  (Eq. 9)")
    ax.set_title(f"Pointwise forcing-bias energy ratio, bars at {last_step_text(results)}")
    ax.legend(handles=handles, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, -0.1), ncol=3)
    _save(fig, path)


def plot_rt_by_scale(groups: Sequence[dict], path: str | os.PathLike) -> None:
    """R_t by scale tier (paper Figure 5 style): per tier a bar per method at the last step (mean
    over seeds, error bar = std, every seed's value as a dot), open markers at t = 0, labels with
    the mean. ``groups``: ``{"tier", "method", "R_t0": [per seed], "R_last": [per seed]}``, in
    drawing order. A symmetric-log axis keeps exact zeros and three-digit ratios on one plot."""
    tiers = list(dict.fromkeys(g["tier"] for g in groups))
    methods = list(dict.fromkeys(g["method"] for g in groups))
    width = 0.8 / max(len(methods), 1)
    fig, ax = new_figure((max(5.0, 0.75 * len(groups) + 2), 4.0), layout=None)
    top = 1.0
    for j, m in enumerate(methods):
        for i, tier in enumerate(tiers):
            g = next((g for g in groups if g["tier"] == tier and g["method"] == m), None)
            if g is None:
                continue
            last = np.array([_val(v) for v in g["R_last"]], dtype=float)
            first = np.array([_val(v) for v in g["R_t0"]], dtype=float)
            x = i + (j - (len(methods) - 1) / 2) * width
            mean = float(np.nanmean(last)) if np.isfinite(last).any() else float("nan")
            std = float(np.nanstd(last, ddof=1)) if np.isfinite(last).sum() > 1 else 0.0
            ax.bar(x, np.nan_to_num(mean), width * 0.9, color=method_color(m, j),
                   label=m if i == 0 else None, yerr=std, capsize=3)  # fmt: skip
            ax.scatter(np.full(len(last), x), last, s=9, color="k", zorder=3)
            if np.isfinite(first).any():
                ax.scatter([x], [np.nanmean(first)], facecolors="none", edgecolors="k", s=60,
                           zorder=4)  # fmt: skip
            ax.text(x, np.nan_to_num(mean + std) * 1.3 + 0.05, "0" if mean == 0 else f"{mean:.3g}",
                    ha="center", va="bottom", fontsize=7)  # fmt: skip
            top = max(top, float(np.nanmax(np.concatenate([last, first, [0.0]]))))
    ax.axhline(1.0, ls="--", color="0.4", lw=1)
    ax.set_yscale("symlog", linthresh=1.0)
    ax.set_ylim(0, top * 3)
    ax.set_xticks(np.arange(len(tiers)), tiers)
    ax.set_xlabel("scale tier")
    ax.set_ylabel("R_t  (Eq. 9), symmetric-log axis")
    steps = sorted({g.get("last_step") for g in groups if g.get("last_step") is not None})
    ax.set_title(
        "Forcing-bias energy ratio by scale: bars at t = "
        + "/".join(map(str, steps))
        + " (mean ± std over seeds, dots per seed), open markers at t = 0",
        fontsize=9,
    )
    ax.legend(fontsize=8, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    _save(fig, path)


def _pca(points: np.ndarray) -> np.ndarray:
    """Top-2 principal directions (d, 2) of points (n, d), centred at the origin (the anchor)."""
    pts = points[np.isfinite(points).all(axis=1)]
    if pts.size == 0 or not np.any(pts):
        return np.eye(points.shape[1], 2)
    _, _, vt = np.linalg.svd(pts, full_matrices=False)
    basis = vt[:2].T
    if basis.shape[1] < 2:
        basis = np.concatenate([basis, np.zeros((basis.shape[0], 2 - basis.shape[1]))], axis=1)
    return basis


def _rollout_panel(ax, st: dict, traj: np.ndarray, ray: np.ndarray, colors: list[str]) -> None:
    """(a) anchor-start trajectories against the forcing rays, in a shared PCA plane."""
    B, T1, _ = traj.shape
    if st["stays_at_anchor"]:
        ax.scatter([0], [0], marker="*", s=150, color="k", zorder=3, label="anchor h* (Δ = 0)")
        ax.text(
            0.5,
            0.62,
            "b_t(e) = 0:\nanchor-start rollouts stay at h* exactly",
            transform=ax.transAxes,
            ha="center",
            color="#2ca02c",
            fontsize=11,
            weight="bold",
        )
        ax.set_xlim(-1, 1)
        ax.set_ylim(-1, 1)
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        ends = np.linalg.norm(traj[:, -1], axis=-1, keepdims=True)  # (B, 1)
        norms = np.linalg.norm(ray, axis=-1, keepdims=True)
        ray_ends = np.where(norms > 0, ray / np.where(norms > 0, norms, 1) * ends, 0.0)  # (B, d)
        # One projection fitted on trajectories and rays alike (each ray sampled at as many points
        # as a trajectory), so the plane shows how far the trajectories follow the rays.
        frac = np.linspace(0.0, 1.0, T1)[None, :, None]  # (1, T+1, 1)
        ray_pts = (frac * ray_ends[:, None, :]).reshape(-1, traj.shape[-1])
        basis = _pca(np.concatenate([traj.reshape(-1, traj.shape[-1]), ray_pts]))
        p = traj @ basis  # (B, T+1, 2)
        for i in range(B):
            ax.plot(p[i, :, 0], p[i, :, 1], "-", color=colors[i], lw=1.5)
            ax.scatter(p[i, -1, 0], p[i, -1, 1], color=colors[i], s=18, zorder=3)
            r = ray_ends[i] @ basis
            ax.plot([0, r[0]], [0, r[1]], "--", color=colors[i], lw=1, alpha=0.7)
        ref = st["ref_depth"]
        radius = float(np.mean(np.linalg.norm(traj[:, ref], axis=-1)))
        circ = matplotlib.patches.Circle((0, 0), radius, fill=False, ls=":", color="0.3")
        ax.add_patch(circ)
        ax.scatter([0], [0], marker="*", s=150, color="k", zorder=4, label="anchor h* (Δ = 0)")
        ax.plot([], [], "-", color="0.3", label="trajectory Δ_t (sequence mean)")
        ax.plot([], [], "--", color="0.3", label="forcing ray t·b₀(e), same length")
        ax.plot([], [], ":", color="0.3", label=f"mean ‖Δ_{ref}‖ (t = {ref})")
        cos = st["ray_cosine"]
        ax.text(
            0.02,
            0.02,
            f"trajectory–ray cosine (full states, all t) {cos['min']:.2f} … {cos['max']:.2f}",
            transform=ax.transAxes,
            fontsize=8,
        )
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_xlabel("PC 1")
        ax.set_ylabel("PC 2")
    ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=2)
    ax.set_title(f"(a) anchor-start rollouts, Δ_0 = 0, t = 0…{T1 - 1}", fontsize=10)


def _dose_panel(ax, st: dict, arrays: dict[str, np.ndarray], colors: list[str]) -> None:
    """(b) the injection-gain dose-response relative to the injection-removed rollout."""
    B = len(colors)
    dose = st["dose"]
    gains = sorted(float(k[len("dose_") :]) for k in arrays if k.startswith("dose_"))
    if not dose["source_channel"]:
        ax.text(
            0.5,
            0.55,
            "source_gain has no effect:\nno injected source term",
            transform=ax.transAxes,
            ha="center",
            color="#2ca02c",
            fontsize=11,
            weight="bold",
        )
        ax.set_xticks([])
        ax.set_yticks([])
    else:
        paths = {g: arrays[f"dose_{g:g}"].astype(np.float64) for g in gains}  # (B, T+1, d)
        basis = _pca(np.concatenate([v.reshape(-1, v.shape[-1]) for v in paths.values()]))
        styles = {min(gains): ":", max(gains): "-"}
        for g in gains:
            q = paths[g] @ basis
            for i in range(B):
                ax.plot(q[i, :, 0], q[i, :, 1], styles.get(g, "--"), color=colors[i], lw=1.2)
                if g in (min(gains), max(gains)):
                    ax.scatter(
                        q[i, -1, 0], q[i, -1, 1], marker="^", color=colors[i], s=40, zorder=3
                    )
        for g in gains:
            ax.plot([], [], styles.get(g, "--"), color="0.3", label=f"gain ×{g:g}")
        ax.scatter([], [], marker="^", color="0.3", label="×½ / ×2 endpoints")
        ax.scatter([0], [0], marker="o", s=30, color="k", zorder=4, label="injection removed (×0)")
        col = dose.get("collinearity_lo_hi") or {}
        ratio = dose.get(f"gain_{max(gains):g}", {}).get("displacement_over_push", {})
        if col.get("min") is not None:
            ax.text(
                0.02,
                0.02,
                f"cos(D_×{min(gains):g}, D_×{max(gains):g}) ≥ {col['min']:.3f};  "
                f"‖D_×{max(gains):g}‖/‖Δ_T‖ = {ratio.get('mean', float('nan')):.2f}",
                transform=ax.transAxes,
                fontsize=8,
            )
        ax.set_aspect("equal", adjustable="datalim")
        ax.set_xlabel("PC 1")
        ax.set_ylabel("PC 2")
        ax.legend(fontsize=7, loc="upper center", bbox_to_anchor=(0.5, -0.13), ncol=3)
    ax.set_title("(b) dose-response: D_g,t = Δ_t(gain g) − Δ_t(gain 0)", fontsize=10)


def plot_steering(arrays: dict[str, np.ndarray], result: dict, path: str | os.PathLike) -> None:
    """Figure 4 style: (a) anchor-start trajectories vs forcing rays, (b) dose-response."""
    st = result["steering"]
    traj = arrays["traj"].astype(np.float64)  # (B, T+1, d) sequence means of Δ_t
    ray = arrays["ray"].astype(np.float64)  # (B, d)
    B = traj.shape[0]
    fig, axes = new_figure((11, 5.6), ncols=2, layout=None)
    colors = [CYCLE[i % len(CYCLE)] for i in range(B)]
    _rollout_panel(axes[0], st, traj, ray, colors)
    _dose_panel(axes[1], st, arrays, colors)
    fig.suptitle(f"{result['label']}: anchor-start steering ({B} inputs)", fontsize=11)
    _save(fig, path)


def plot_convergence(results: Sequence[dict], path: str | os.PathLike) -> None:
    """KL per loop, per-token state change and convergence depth by token type."""
    fig, axes = new_figure((15, 4.2), ncols=3, layout=None)
    for i, r in enumerate(results):
        c = r["convergence"]
        t = np.arange(1, len(c["kl_per_loop"]) + 1)
        kl = np.array([_val(v) for v in c["kl_per_loop"]])
        col = method_color(r["method"], i)
        zero = bool(np.all(kl == 0))
        axes[0].semilogy(
            t,
            np.where(kl > 0, kl, np.nan),
            color=col,
            label=r["label"] + (" (KL ≡ 0)" if zero else ""),
        )
        chg = np.array([_val(v) for v in c["state_change_per_loop"]])
        axes[1].semilogy(t, np.where(chg > 0, chg, np.nan), color=col, label=r["label"])
    if results:
        tau = results[0]["convergence"]["threshold"]
        axes[0].axhline(tau, ls=":", color="0.4", label=f"τ = {tau:g}")
    axes[0].set_xlabel("loop t")
    axes[0].set_ylabel("mean KL(p_t ‖ p_{t−1})  [nats]")
    axes[0].set_title("(a) successive-output KL per loop")
    axes[0].legend(fontsize=8)
    axes[1].set_xlabel("loop t")
    axes[1].set_ylabel("mean ‖h_t − h_{t−1}‖ / ‖h_{t−1}‖")
    axes[1].set_title("(b) per-token state change")
    axes[1].legend(fontsize=8)

    ax = axes[2]
    types = ["whitespace", "punctuation", "function", "content", "other"]
    width = 0.8 / max(len(results), 1)
    for i, r in enumerate(results):
        by = r["convergence"]["depth_by_type"]
        means = [by[k].get("mean", np.nan) if by[k].get("count") else np.nan for k in types]
        ax.bar(
            np.arange(len(types)) + (i - (len(results) - 1) / 2) * width,
            means,
            width,
            color=method_color(r["method"], i),
            label=r["label"],
        )
    counts = results[0]["convergence"]["depth_by_type"] if results else {}
    ax.set_xticks(
        np.arange(len(types)),
        [f"{k}\n(n={counts.get(k, {}).get('count', 0)})" for k in types],
        fontsize=8,
    )
    T = results[0]["loops"] if results else 0
    tau = results[0]["convergence"]["threshold"] if results else 0
    ax.set_ylabel("mean convergence depth\n(first loop with KL < τ)")
    ax.set_title(f"(c) convergence depth by token type (τ = {tau:g})", fontsize=11)
    ax.set_xlabel(f"token type  (tokens never below τ count as T + 1 = {T + 1})", fontsize=8)
    ax.set_ylim(0, ax.get_ylim()[1] * 1.3)
    ax.legend(fontsize=8, ncol=min(3, max(len(results), 1)), loc="upper center")
    fig.subplots_adjust(wspace=0.38)  # room for each panel's y-label beside its neighbour
    _save(fig, path)


def plot_anchor_steps(results: Sequence[dict], path: str | os.PathLike) -> None:
    """Per-step R_t, E_Δ,t, random-direction gain and the counterfactual N⁻¹‖E_t‖²."""
    fig, axes = new_figure((11, 7.5), nrows=2, ncols=2, layout=None)
    panels = [
        ("ratio", "(a) R_t  (Eq. 9)", "R_t", False),
        ("anchor_energy", "(b) anchor energy E_Δ,t = N⁻¹‖Δ_t‖²", "E_Δ,t", True),
        ("gain", "(c) random-direction gain (ε = 1e-3, 4 directions)", "gain", True),
        ("E_energy", "(d) bias-subtraction response N⁻¹‖E_t‖² (Eq. 10)", "N⁻¹‖E_t‖²", True),
    ]
    for ax, (key, title, ylab, log) in zip(axes.flat, panels):
        series = [[_val(v) for v in r["per_step"][key]] for r in results]
        flat = log and bool(series) and all(np.all(np.array(s) == 0) for s in series)
        if flat:
            # nothing to draw on a log axis: show the zeros on a linear one and say why
            log = False
            no_bias = all(np.all(np.array(r["per_step"]["ratio"]) == 0) for r in results)
            why = "exactly 0 at every step" + (
                ": the forcing bias b_t is 0,\nso subtracting it changes nothing" if no_bias else ""
            )
            ax.text(0.5, 0.6, why, transform=ax.transAxes, ha="center", va="center", fontsize=9,
                    color="0.3")  # fmt: skip
        for i, (r, s) in enumerate(zip(results, series)):
            s = np.array(s)
            label = r["label"]
            if np.all(s == 0):
                label += " (≡ 0" + (", not drawn on a log axis)" if log else ")")
            elif key in ("gain", "ratio"):
                label += f" (t = {len(s) - 1}: {s[-1]:.5f})"
            y = np.where(s > 0, s, np.nan) if log else s
            ax.plot(np.arange(len(s)), y, color=method_color(r["method"], i), label=label)
        if log:
            ax.set_yscale("log")
        if key == "gain":
            ax.yaxis.set_major_locator(matplotlib.ticker.LogLocator(subs=(1.0, 2.0, 5.0)))
            ax.yaxis.set_major_formatter(matplotlib.ticker.ScalarFormatter())
            ax.yaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        if key == "ratio":
            ax.axhline(1.0, ls="--", color="0.5", lw=0.8)
        if key == "gain":
            ax.axhline(1.0, ls="--", color="0.5", lw=0.8)
        ax.set_title(title, fontsize=10)
        ax.set_xlabel("step t")
        ax.set_ylabel(ylab)
        ax.legend(fontsize=8)
    fig.tight_layout()
    _save(fig, path)


def render_figures(
    out_dir: str | os.PathLike, result_paths: Sequence[str | os.PathLike]
) -> list[str]:
    """Draw every figure from the written result files; returns the PNG paths."""
    out_dir = Path(out_dir)
    results = [load_result(p) for p in result_paths]
    written = []
    for p, r in zip(result_paths, results):
        npz = Path(p).with_name("steering.npz")
        if r.get("steering") and npz.is_file():
            with np.load(npz) as z:
                arrays = {k: z[k] for k in z.files}
            target = Path(p).with_name("steering.png")
            plot_steering(arrays, r, target)
            written.append(str(target))
    for name, fn in (
        ("r_t.png", plot_rt_bars),
        ("anchor_steps.png", plot_anchor_steps),
        ("convergence.png", plot_convergence),
    ):
        fn(results, out_dir / name)
        written.append(str(out_dir / name))
    return written
