"""`looplm methods` and `looplm params`: what each recurrence computes and what it costs.

``looplm methods [--preset 22m] [--json]`` lists every registered recurrence with its equation, paper
reference, body calls per step (c_body of Eqs. 20–21), whether it claims a zero forcing bias, and
its parameter count at the preset; then the unshared controls with their presets.
``looplm params --preset P --method M [key=value …]`` prints one model's parameter count, split by
part, next to the paper's figure where the paper prints one (:mod:`looplm.model.catalog`).
"""

from __future__ import annotations

import argparse
import json

from looplm.model.settings import MethodsSettings, ParamsSettings
from looplm.settings.options import add_options, from_args

SETTINGS = {"methods": (MethodsSettings,), "params": (ParamsSettings,)}


def run_methods(args: argparse.Namespace) -> int:
    """Print the method table."""
    from looplm.model.catalog import method_rows, method_table

    s = from_args(MethodsSettings, args)
    rows = method_rows(s.preset)
    print(
        json.dumps(rows, indent=2, ensure_ascii=False) if s.json else "\n".join(method_table(rows))
    )
    return 0


def run_params(args: argparse.Namespace) -> int:
    """Print one model's parameter count."""
    from looplm.model.catalog import params_lines, params_report
    from looplm.settings import parse_key_values

    s = from_args(ParamsSettings, args)
    settings = parse_key_values(args.settings, what="setting", example="lanes=2")
    report = params_report(s.preset, s.method, settings)
    stated = report.pop("stated", None)
    print(
        json.dumps(report, indent=2)
        if s.json
        else "\n".join(params_lines({**report, "stated": stated}))
    )
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
    add_options(p, MethodsSettings)
    p.set_defaults(func=run_methods)

    q = subparsers.add_parser(
        "params",
        help="parameter count of one method at one preset",
        description="Parameter count of one model (built without allocating weights), split by "
        "part, next to the paper's figure where the paper prints one. Extra key=value arguments "
        "are model or recurrence settings, e.g. `looplm params --method hyper_scse lanes=2`.",
    )
    q.add_argument("settings", nargs="*", help="key=value model or recurrence settings")
    add_options(q, ParamsSettings)
    q.set_defaults(func=run_params)
