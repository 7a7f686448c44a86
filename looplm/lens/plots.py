"""Figures of the lens analysis (matplotlib, Agg, PNG), drawn from the ``lens.json`` dict.

* ``lens_slice.png`` (+ ``lens_slice.html``): loop step × position, the top-1 token of the J-lens
  and of the logit lens in each cell, shaded by its probability.
* ``lens_fidelity.png``: KL(p_T ‖ lens_t), top-1 agreement and pass@k per loop step (t/T) for
  the three arms at T and at each extrapolated depth, with t intervals over prompts.
* ``lens_angles.png``: the overlap of the top-k subspaces across loop steps (mean cos² of the
  principal angles) and, beside it, persistence into the extrapolated depths, with the
  random-subspace baseline.
* ``lens_dose.png``: swap dose-response, target pair (the model's top-1 ↔ runner-up) against the
  unrelated control pair, along J-lens and logit-lens directions.
* ``lens_layers.png`` (with ``--layers``): KL and top-1 agreement per virtual core layer, J-lens
  against the logit lens on the same residual streams.
"""

from __future__ import annotations

import html
import json
from pathlib import Path
from typing import Any

import numpy as np

from looplm.io import atomic_write_text
from looplm.results.plotting import new_figure, save_png

ARM_COLORS = {"jacobian": "C0", "logit": "C1", "tuned": "C2"}
ARM_NAMES = {"jacobian": "J-lens", "logit": "logit lens", "tuned": "tuned lens"}


def band(mean: np.ndarray, ci: np.ndarray, *, nonnegative: bool = False) -> tuple:
    """The shaded interval ``mean ± ci``; for a quantity that cannot be negative (a KL) its
    lower edge is cut at 0, so a symlog axis never shows a negative KL."""
    lo, hi = mean - ci, mean + ci
    return (np.maximum(lo, 0.0) if nonnegative else lo), hi


def _nan(x) -> float:
    return float("nan") if x is None else float(x)


def plot_slice(result: dict[str, Any], path: Path) -> Path:
    sl = result["slice"]
    labels = sl.get("text") or [str(t) for t in sl["tokens"]]
    T = len(sl["jacobian"]) - 1
    Lx = len(labels)
    fig, axes = new_figure((max(6.0, 0.42 * Lx + 1.5), 0.42 * (T + 1) * 2 + 1.6), nrows=2)
    for ax, arm in zip(axes, ("jacobian", "logit"), strict=True):
        prob = np.array([row["prob"] for row in sl[arm]])
        ax.imshow(prob, aspect="auto", cmap="Blues", vmin=0, vmax=1, origin="lower")
        for t, row in enumerate(sl[arm]):
            cells = row.get("label") or [str(i) for i in row["top"]]
            for p, lab in enumerate(cells):
                color = "white" if prob[t, p] > 0.6 else "black"
                ax.text(p, t, lab[:4], ha="center", va="center", fontsize=7, color=color)
        ax.set_xticks(range(Lx))
        ax.set_xticklabels([lab[:4] for lab in labels], fontsize=7)
        ax.set_yticks(range(T + 1))
        ax.set_ylabel("loop step t")
        ax.set_title(f"{ARM_NAMES[arm]}: top-1 token per (step, position); shade = probability")
    axes[-1].set_xlabel("input position (the token at each position; the cell predicts the next)")
    return save_png(fig, path, dpi=130, tight=True)


def write_slice_html(result: dict[str, Any], path: Path) -> Path:
    """The same slice as an HTML table (hover shows the probability)."""
    sl = result["slice"]
    labels = sl.get("text") or [str(t) for t in sl["tokens"]]
    parts = [
        "<!doctype html><meta charset='utf-8'><title>lens slice</title>",
        "<style>td{font-family:monospace;padding:2px 5px;text-align:center}</style>",
    ]
    for arm in ("jacobian", "logit"):
        parts.append(f"<h3>{ARM_NAMES[arm]}</h3><table><tr><th>t</th>")
        parts += [f"<th>{html.escape(lab)}</th>" for lab in labels]
        parts.append("</tr>")
        for t in range(len(sl[arm]) - 1, -1, -1):
            row = sl[arm][t]
            cells = row.get("label") or [str(i) for i in row["top"]]
            parts.append(f"<tr><th>{t}</th>")
            for lab, pr in zip(cells, row["prob"], strict=True):
                shade = int(255 - 180 * pr)
                parts.append(
                    f"<td style='background:rgb({shade},{shade},255)' title='p={pr:.3f}'>"
                    f"{html.escape(lab)}</td>"
                )
            parts.append("</tr>")
        parts.append("</table>")
    atomic_write_text(path, "\n".join(parts))
    return path


def plot_fidelity(result: dict[str, Any], path: Path) -> Path:
    depths = list(result["fidelity"])
    metrics = (("kl", "KL(p_T ‖ lens_t)"), ("top1", "top-1 agreement"), ("pass_at_k", "pass@k"))
    fig, axes = new_figure((4.0 * len(depths), 8.0), nrows=3, ncols=len(depths))
    axes = np.asarray(axes).reshape(3, len(depths))
    for j, T in enumerate(depths):
        fid = result["fidelity"][T]
        x = np.arange(int(T) + 1) / int(T)
        for i, (metric, name) in enumerate(metrics):
            ax = axes[i, j]
            for arm, rows in fid["arms"].items():
                mean = np.array([_nan(r["mean"]) for r in rows[metric]])
                ci = np.nan_to_num(np.array([_nan(r["ci"]) for r in rows[metric]]))
                ax.plot(
                    x, mean, marker=".", color=ARM_COLORS.get(arm), label=ARM_NAMES.get(arm, arm)
                )
                lo, hi = band(mean, ci, nonnegative=metric == "kl")
                ax.fill_between(x, lo, hi, color=ARM_COLORS.get(arm), alpha=0.2)
            steps = fid["band"]["kl"]["steps"]
            if steps and metric == "kl":
                ax.axvspan(min(steps) / int(T), max(steps) / int(T), color="C0", alpha=0.08)
            if metric == "kl":
                ax.set_yscale("symlog", linthresh=1e-3)
                ax.set_ylim(bottom=0)  # a KL is never negative
            if metric == "pass_at_k":
                name = f"pass@{fid['k']}"
            ax.set_ylabel(name)
            if i == 0:
                ax.set_title(f"T = {T}" + (" (fitted)" if j == 0 else " (extrapolated)"))
            if i == 2:
                ax.set_xlabel("loop step t / T")
    axes[0, 0].legend(fontsize=8)
    return save_png(fig, path, dpi=130, tight=True)


def plot_angles(result: dict[str, Any], path: Path) -> Path:
    st = result["structure"]
    m = np.array(st["overlap"])
    rnd = st["random_overlap"]
    fig, (ax, bx) = new_figure((10.0, 4.2), ncols=2)
    im = ax.imshow(m, vmin=0, vmax=1, cmap="viridis", origin="lower")
    fig.colorbar(im, ax=ax, label="mean cos² of principal angles")
    ax.set_xlabel("loop step t′")
    ax.set_ylabel("loop step t")
    ax.set_title(
        f"top-{st['k']} subspaces of J_t (random: {rnd['expected']:.2f}, p99 {rnd['p99']:.2f})"
    )
    for i, (Tx, per) in enumerate(st["persistence"].items()):
        t = np.arange(len(per["same_step"]))
        bx.plot(t, per["same_lag"], marker="o", color=f"C{i}", label=f"T={Tx}, same lag to end")
        bx.plot(t, per["same_step"], marker="x", ls="--", color=f"C{i}", label=f"T={Tx}, same step")
    bx.axhline(rnd["p99"], color="grey", ls=":", label="random p99")
    bx.set_ylim(0, 1.02)
    bx.set_xlabel(f"loop step t of the T={result['loops']} fit")
    bx.set_ylabel("overlap with the deeper fit")
    bx.set_title("persistence under extrapolation")
    bx.legend(fontsize=7)
    return save_png(fig, path, dpi=130, tight=True)


def plot_dose(result: dict[str, Any], path: Path) -> Path:
    iv = result["interventions"]
    fig, axes = new_figure((10.0, 4.0), ncols=2)
    for ax, metric, name in (
        (axes[0], "to_rival", "top-1 moved to the runner-up"),
        (axes[1], "margin", "logit margin runner-up − top-1"),
    ):
        for arm, res in iv["swap"].items():
            s = np.array(res["strengths"])
            for pair, ls in (("target", "-"), ("control", ":")):
                y = np.array([_nan(v) for v in res[pair][metric]])
                ci = np.nan_to_num(np.array([_nan(v) for v in res[pair][f"{metric}_ci"]]))
                ax.plot(
                    s,
                    y,
                    ls=ls,
                    marker="o",
                    color=ARM_COLORS[arm],
                    label=f"{ARM_NAMES[arm]}, {pair} pair",
                )
                ax.fill_between(s, y - ci, y + ci, color=ARM_COLORS[arm], alpha=0.12)
        ax.set_xlabel("swap strength β (1 = full coordinate swap)")
        ax.set_ylabel(name)
    axes[0].set_title(f"coordinate swap over loop steps {iv['band'][0]}–{iv['band'][1]}")
    axes[0].legend(fontsize=7)
    return save_png(fig, path, dpi=130, tight=True)


def plot_layers(result: dict[str, Any], path: Path) -> Path:
    """KL(p_T ‖ lens_v) and top-1 agreement per virtual layer (the per-layer lens), J-lens and
    logit lens with their intervals; dotted lines separate the prelude, the loop steps and the
    coda."""
    lay = result["layers"]
    p, k, c = (int(lay.get(f"{n}_layers", 0)) for n in ("prelude", "core", "coda"))
    fig, axes = new_figure((7.0, 5.5), nrows=2)
    for ax, (metric, name) in zip(axes, (("kl", "KL(p_T ‖ lens_v)"), ("top1", "top-1 agreement"))):
        for arm, rows in lay["arms"].items():
            mean = np.array([_nan(r["mean"]) for r in rows[metric]])
            ci = np.nan_to_num(np.array([_nan(r["ci"]) for r in rows[metric]]))
            x = np.arange(len(mean))
            ax.plot(x, mean, marker=".", color=ARM_COLORS.get(arm), label=ARM_NAMES.get(arm, arm))
            lo, hi = band(mean, ci, nonnegative=metric == "kl")
            ax.fill_between(x, lo, hi, color=ARM_COLORS.get(arm), alpha=0.2)
        for b in range(p, len(mean) - c + 1, k):  # the first layer of every step, the coda's
            if 0 < b < len(mean):
                ax.axvline(b - 0.5, color="0.7", lw=0.8, ls=":")
        if metric == "kl":
            ax.set_yscale("symlog", linthresh=1e-3)
            ax.set_ylim(bottom=0)  # a KL is never negative
        ax.set_ylabel(name)
    axes[0].set_title(
        f"per layer at T = {result['loops']}: {p} prelude + {k} per loop step + {c} coda"
    )
    axes[1].set_xlabel("virtual layer v = p + (t − 1)·k + i (stream entering each layer)")
    axes[0].legend(fontsize=8)
    return save_png(fig, path, dpi=130, tight=True)


def render_lens_figures(result: dict[str, Any] | str | Path, out: str | Path) -> list[Path]:
    """All lens figures from a result dict (or the path of its ``lens.json``)."""
    if not isinstance(result, dict):
        result = json.loads(Path(result).read_text())
    out = Path(out)
    paths = [
        plot_slice(result, out / "lens_slice.png"),
        write_slice_html(result, out / "lens_slice.html"),
        plot_fidelity(result, out / "lens_fidelity.png"),
        plot_angles(result, out / "lens_angles.png"),
    ]
    if result.get("interventions", {}).get("swap"):
        paths.append(plot_dose(result, out / "lens_dose.png"))
    if result.get("layers"):
        paths.append(plot_layers(result, out / "lens_layers.png"))
    return paths
