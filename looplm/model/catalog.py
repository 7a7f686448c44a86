"""The catalogue of methods: what each recurrence computes and what it costs (``looplm methods``,
``looplm params``).

:func:`method_rows` lists every registered recurrence with its equation, paper
reference, body calls per step (c_body of Eqs. 20–21), whether it claims a zero forcing bias, and
its parameter count at the preset; then the unshared controls with their presets.
:func:`params_report` gives one model's parameter count, split by part, next to the paper's figure
where the paper prints one.
"""

from __future__ import annotations

from typing import Any

# The unshared controls and references, selected by preset (recurrence "unshared").
UNSHARED_PRESETS: dict[str, str] = {
    "22m-unshared-4x320": "param-matched unshared control, 4 layers, width 320, 5 heads",
    "22m-unshared-6x288": "param-matched unshared control, 6 layers, width 288, 6 heads",
    "22m-unshared-8x384": "Transformer-8 absolute unshared-depth reference (22m block ×8)",
}

# Parameter counts stated elsewhere: (method, preset) → (count, printed decimals in millions,
# what it is, where it is stated: "paper" = Looped Transformers with Source-Centered State
# Evolution, "specification" = looplm's own specification where the paper prints no figure).
PAPER_PARAMS: dict[tuple[str, str], tuple[float, int, str, str]] = {
    ("step_conditioned", "136.5m"): (
        139.2e6, 1, "largest recurrent-step-conditioned control", "paper",
    ),
    ("scse", "136.5m"): (136.5e6, 1, "largest source-centered model", "paper"),
    ("unshared", "22m-unshared-4x320"): (22.7e6, 1, "4-layer width-320 unshared control", "paper"),
    ("unshared", "22m-unshared-6x288"): (22.5e6, 1, "6-layer width-288 unshared control", "paper"),
    ("unshared", "22m-unshared-8x384"): (38.23e6, 2, "Transformer-8 reference", "specification"),
    ("unshared", "22m"): (38.23e6, 2, "Transformer-8 reference", "specification"),
}  # fmt: skip


def method_rows(preset: str) -> list[dict[str, Any]]:
    """One dict per method: name, c_body, zero_forcing_bias, params, equation, reference, preset."""
    from looplm.model.accounting import parameter_count
    from looplm.model.recurrences import get_recurrence_class, recurrence_names
    from looplm.settings.config import UNSHARED, model_config

    rows = []
    for name in recurrence_names():
        if name == UNSHARED:
            continue
        cls = get_recurrence_class(name)
        rows.append(
            {
                "name": name,
                "preset": preset,
                "c_body": cls.body_calls_per_step,
                "zero_forcing_bias": cls.zero_forcing_bias,
                "params": parameter_count(preset, name)["total"],
                "equation": cls.equation,
                "reference": cls.reference,
            }
        )
        # named settings of the same recurrence (e.g. the two looped baselines)
        for label, settings, equation, reference in getattr(cls, "variants", ()):
            rows.append(
                {
                    "name": label,
                    "recurrence": name,
                    "settings": settings,
                    "preset": preset,
                    "c_body": cls.body_calls_per_step,
                    "zero_forcing_bias": cls.zero_forcing_bias,
                    "params": parameter_count(preset, name, **settings)["total"],
                    "equation": equation,
                    "reference": reference,
                }
            )
    n_layers = model_config(preset, UNSHARED).n_layers
    unshared = [(preset, f"ordinary Transformer, {n_layers} distinct layers at {preset}")]
    unshared += [(p, d) for p, d in UNSHARED_PRESETS.items() if p != preset]
    for p, desc in unshared:
        rows.append(
            {
                "name": UNSHARED,
                "preset": p,
                "c_body": 1,
                "zero_forcing_bias": False,
                "params": parameter_count(p, UNSHARED)["total"],
                "equation": "h_{i+1} = h_i + G_i(h_i), i < min(T, N_layers);  N_body = min(T, N)",
                "reference": f"{desc}; Appendix 'Experimental Setup Details'",
            }
        )
    return rows


def method_table(rows: list[dict[str, Any]]) -> list[str]:
    """The lines ``looplm methods`` prints for :func:`method_rows`."""
    lines = [f"{'method':<22} {'preset':<20} {'c_body':>6}  {'b_t=0':<5} {'parameters':>14}"]
    for r in rows:
        b0 = "yes" if r["zero_forcing_bias"] else "no"
        if "settings" in r:  # a named setting of the recurrence above
            lines.append(f"  {r['name']}")
            lines.append(f"{'':<22} {r['preset']:<20} {r['c_body']:>6}  {b0:<5} {r['params']:>14,}")
        else:
            lines.append(
                f"{r['name']:<22} {r['preset']:<20} {r['c_body']:>6}  {b0:<5} {r['params']:>14,}"
            )
        lines.append(f"    {r['equation']}")
        lines.append(f"    ref: {r['reference']}")
    return lines


def params_report(preset: str, method: str, settings: dict[str, Any]) -> dict[str, Any]:
    """One model's parameter count by part, with the figure stated elsewhere (``paper`` /
    ``specification``) where one is and no settings change the model."""
    from looplm.model.accounting import parameter_count

    counts = parameter_count(preset, method, **settings)
    out: dict[str, Any] = dict(counts, method=method, preset=preset)
    stated = PAPER_PARAMS.get((method, preset)) if not settings else None
    if stated:
        out[stated[3]] = stated[0]
        out["stated"] = stated
    return out


def params_lines(report: dict[str, Any]) -> list[str]:
    """The lines ``looplm params`` prints for :func:`params_report`."""
    total = report["total"]
    lines = [f"{report['method']} at {report['preset']}: {total:,} parameters ({total / 1e6:.2f}M)"]
    if report["trainable"] != total:
        lines.append(f"  trainable                {report['trainable']:>14,}")
    for key, label in (
        ("embedding", "embedding (tied head)"),
        ("body", "shared block / layers"),
        ("recurrence", "recurrence"),
        ("other", "final norm"),
    ):
        lines.append(f"  {label:<24} {report[key]:>14,}")
    if report.get("stated"):
        value, dec, what, source = report["stated"]
        rel = (total - value) / value * 100
        ok = round(total / 1e6, dec) == round(value / 1e6, dec)
        verdict = "matches" if ok else "DIFFERS"
        lines.append(f"  {source}: {value / 1e6:.{dec}f}M ({what}); {verdict} ({rel:+.2f}%)")
    return lines
