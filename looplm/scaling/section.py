"""The report section of the recurrence scaling law: φ with its bootstrap interval per method and
sweep, and the fit's figure (reads store records only)."""

from __future__ import annotations

import os
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.plotting import new_figure, save_png
from looplm.results.sections import ReportSection, register_section
from looplm.results.store import EvalRecord
from looplm.results.tables import ROW_CONTEXT, context_title, md_escape
from looplm.scaling.fit import ScalingFit, bootstrap_records, fit_records, scaling_points

PHI_BOOT = 200  # bootstrap resamples for φ's interval


@register_section
class ScalingSection(ReportSection):
    """The recurrence scaling-law fit (φ with its bootstrap interval) per method and sweep."""

    name = "scaling"
    kinds = ("scaling",)
    order = 30
    json_keys = ("scaling",)

    def write(self, records: list[EvalRecord]) -> None:
        self._scaling_section(records)

    def _scaling_section(self, recs: list[EvalRecord]) -> None:
        self.report.md += [
            "## Recurrence scaling law (the recurrence-equivalence exponent φ)",
            "",
            "L = E + A·(N_once + r^φ·N_rec)^−α + B·D^−β, fitted in log space (Huber, "
            "multiple starts); L is the token-weighted mean NLL (nats). φ's interval: 95% "
            f"percentile bootstrap over {PHI_BOOT} resamples of the sweep points.",
            "",
            "| Method | context | points | φ | φ 95% CI | E | A | α | B | β | RMSE(log L) |",
            "|---|---|---:|---:|---|---:|---:|---:|---:|---:|---:|",
        ]
        notes = []
        fields = ("method",) + ROW_CONTEXT
        groups: dict[tuple, list[EvalRecord]] = {}
        for rec in recs:  # one fit per method over every training variant of a sweep
            sweep = rec.extra.get("sweep_protocol") or rec.protocol
            key = (rec.method, sweep, rec.dataset, rec.split, rec.eval_tag)
            groups.setdefault(key, []).append(rec)
        for key, grp in sorted(groups.items()):
            ctx = dict(zip(fields, key))
            ctx_text = context_title({k: v for k, v in ctx.items() if k != "method"})
            try:
                fit = fit_records(grp)
            except LoopLMError as exc:
                notes.append(f"- `{ctx['method']}` ({ctx_text}): no fit — {exc}")
                self.report.json["scaling"].append({"context": ctx, "error": str(exc)})
                continue
            try:
                ci = bootstrap_records(grp, fit=fit, n_boot=PHI_BOOT, seed=self.report.boot_seed)
                ci_text, ci_json = f"[{ci.low:.3f}, {ci.high:.3f}]", ci.to_dict()
            except LoopLMError as exc:
                ci_text, ci_json = "–", {"error": str(exc)}
            self.report.md.append(
                f"| {md_escape(ctx['method'])} | {md_escape(ctx_text)} | {fit.n_points} | "
                f"**{fit.phi:.3f}** | {ci_text} | {fit.E:.3f} | {fit.A:.4g} | {fit.alpha:.3f} | "
                f"{fit.B:.4g} | {fit.beta:.3f} | {fit.rmse_log:.2g} |"
            )
            entry: dict[str, Any] = {"context": ctx, "fit": fit.to_dict(), "phi_interval": ci_json}
            if self.report.make_figures:
                slug = self.report.unique_slug("scaling", ctx.values())
                path = self.report.out_dir / "figures" / f"{slug}.png"
                plain = context_title({k: v for k, v in ctx.items() if k != "method"}, False)
                plot_scaling(fit, scaling_points(grp), path, title=f"{ctx['method']} — {plain}")
                self.report.figures.append(path)
                entry["figure"] = f"figures/{slug}.png"
                notes.append(f"![scaling fit {ctx['method']}](figures/{slug}.png)")
            self.report.json["scaling"].append(entry)
        self.report.md += [""] + notes + [""]


def plot_scaling(
    fit: ScalingFit, points: dict[str, np.ndarray], path: str | os.PathLike, *, title: str = ""
) -> None:
    """Scaling-fit figure: (left) ``L − B·D^−β`` vs ``N_once + r^φ N_rec`` with the fitted
    ``E + A·N^−α`` curve, points coloured by r; (right) predicted vs observed loss."""
    fig, (ax1, ax2) = new_figure((10.0, 4.2), ncols=2, dpi=150)
    r, once, rec, d, y = (points[k] for k in ("r", "n_once", "n_rec", "d", "loss"))
    n_eff = fit.effective_params(r, once, rec)
    y_adj = y - fit.B * d ** (-fit.beta)
    rs = sorted(set(r.tolist()))
    for i, rv in enumerate(rs):
        sel = r == rv
        ax1.scatter(n_eff[sel], y_adj[sel], s=22, color=f"C{i}", label=f"r = {rv:g}", zorder=3)
        pred = fit.predict(r[sel], once[sel], rec[sel], d[sel])
        ax2.scatter(pred, y[sel], s=22, color=f"C{i}", label=f"r = {rv:g}", zorder=3)
    grid = np.geomspace(n_eff.min() / 1.2, n_eff.max() * 1.2, 200)
    ax1.plot(grid, fit.E + fit.A * grid ** (-fit.alpha), color="black", lw=1.2, label="fit")
    from matplotlib.ticker import NullFormatter

    ax1.set_xscale("log")
    ax1.xaxis.set_minor_formatter(NullFormatter())
    ax1.set_xlabel(r"effective parameters $N_\mathrm{once} + r^{\varphi} N_\mathrm{rec}$")
    ax1.set_ylabel(r"loss $-\ B\,D^{-\beta}$  (nats)")
    ax1.set_title(f"φ = {fit.phi:.3f}, α = {fit.alpha:.3f}, E = {fit.E:.3f}", fontsize=10)
    ax1.legend(fontsize=8, frameon=False)
    ax1.grid(True, color="0.9", lw=0.6)
    lo = float(min(y.min(), fit.predict(r, once, rec, d).min()))
    hi = float(max(y.max(), fit.predict(r, once, rec, d).max()))
    pad = 0.03 * (hi - lo or 1.0)
    ax2.plot([lo - pad, hi + pad], [lo - pad, hi + pad], color="0.5", lw=1, ls="--")
    ax2.set_xlim(lo - pad, hi + pad)
    ax2.set_ylim(lo - pad, hi + pad)
    ax2.set_xlabel("predicted loss (nats)")
    ax2.set_ylabel("observed loss (nats)")
    ax2.set_title(f"RMSE(log L) = {fit.rmse_log:.2g}, {fit.n_points} points", fontsize=10)
    ax2.grid(True, color="0.9", lw=0.6)
    if title:
        fig.suptitle(title, fontsize=10)
    save_png(fig, path)
