"""`looplm methods` and `looplm params`: what each recurrence computes and what it costs.

``looplm methods [--preset 22m] [--json]`` lists every registered recurrence with its equation, paper
reference, body calls per step (c_body of Eqs. 20–21), whether it claims a zero forcing bias, and
its parameter count at the preset; then the unshared controls with their presets.
``looplm params --preset P --method M [key=value …]`` prints one model's parameter count, split by
part, next to the paper's figure where the paper prints one.
"""

from __future__ import annotations

import argparse
import json
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
    from looplm.accounting import parameter_count
    from looplm.config import UNSHARED, model_config
    from looplm.model.recurrences import get_recurrence_class, recurrence_names

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


def run_methods(args: argparse.Namespace) -> int:
    """Print the method table."""
    rows = method_rows(args.preset)
    if args.json:
        print(json.dumps(rows, indent=2, ensure_ascii=False))
        return 0
    print(f"{'method':<22} {'preset':<20} {'c_body':>6}  {'b_t=0':<5} {'parameters':>14}")
    for r in rows:
        b0 = "yes" if r["zero_forcing_bias"] else "no"
        if "settings" in r:  # a named setting of the recurrence above
            print(f"  {r['name']}")
            print(f"{'':<22} {r['preset']:<20} {r['c_body']:>6}  {b0:<5} {r['params']:>14,}")
        else:
            print(f"{r['name']:<22} {r['preset']:<20} {r['c_body']:>6}  {b0:<5} {r['params']:>14,}")
        print(f"    {r['equation']}")
        print(f"    ref: {r['reference']}")
    return 0


def _parse_kv(items: list[str]) -> dict[str, Any]:
    from looplm.settings import parse_key_values

    return parse_key_values(items, what="setting", example="lanes=2")


def run_params(args: argparse.Namespace) -> int:
    """Print one model's parameter count."""
    from looplm.accounting import parameter_count

    counts = parameter_count(args.preset, args.method, **_parse_kv(args.settings))
    paper = PAPER_PARAMS.get((args.method, args.preset)) if not args.settings else None
    if args.json:
        out = dict(counts, method=args.method, preset=args.preset)
        if paper:
            out[paper[3]] = paper[0]
        print(json.dumps(out, indent=2))
        return 0
    total = counts["total"]
    print(f"{args.method} at {args.preset}: {total:,} parameters ({total / 1e6:.2f}M)")
    if counts["trainable"] != total:
        print(f"  trainable                {counts['trainable']:>14,}")
    for key, label in (
        ("embedding", "embedding (tied head)"),
        ("body", "shared block / layers"),
        ("recurrence", "recurrence"),
        ("other", "final norm"),
    ):
        print(f"  {label:<24} {counts[key]:>14,}")
    if paper:
        value, dec, what, source = paper
        rel = (total - value) / value * 100
        ok = round(total / 1e6, dec) == round(value / 1e6, dec)
        verdict = "matches" if ok else "DIFFERS"
        print(f"  {source}: {value / 1e6:.{dec}f}M ({what}); {verdict} ({rel:+.2f}%)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``methods`` and ``params`` commands."""
    p = subparsers.add_parser(
        "methods",
        help="list every recurrence: equation, paper reference, c_body, parameters",
        description="List every registered recurrence and the unshared controls with the "
        "equation implemented, the paper reference, body calls per step (c_body), whether the "
        "forcing bias is zero by construction, and the parameter count at a preset.",
    )
    p.add_argument("--preset", default="22m", help="preset for the parameter counts (22m)")
    p.add_argument("--json", action="store_true", help="print JSON instead of a table")
    p.set_defaults(func=run_methods)

    q = subparsers.add_parser(
        "params",
        help="parameter count of one method at one preset",
        description="Parameter count of one model (built without allocating weights), split by "
        "part, next to the paper's figure where the paper prints one. Extra key=value arguments "
        "are model or recurrence settings, e.g. `looplm params --method hyper_scse lanes=2`.",
    )
    q.add_argument("--preset", default="22m", help="model preset (22m)")
    q.add_argument("--method", default="scse", help="recurrence name (scse); see `looplm methods`")
    q.add_argument("settings", nargs="*", help="key=value model or recurrence settings")
    q.add_argument("--json", action="store_true", help="print JSON")
    q.set_defaults(func=run_params)
