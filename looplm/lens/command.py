"""`looplm lens CHECKPOINT --out DIR`: the Jacobian lens of a looped (or unshared) checkpoint.

Fits J_t = E Σ_{p'≥p} ∂h_T[p'] / ∂h_t[p] at depth T and at deeper, extrapolated depths, trains a
tuned lens, measures the fidelity of the J-lens, the logit lens and the tuned lens per loop step on
held-out prompts, the workspace structure and a coordinate-swap dose-response, and writes
``DIR/lens.json``, the fitted lenses and the figures (``lens_slice.png``/``.html``,
``lens_fidelity.png``, ``lens_angles.png``, ``lens_dose.png``). See docs/lens.md.
The options are those of :class:`~looplm.lens.settings.LensSettings`, :class:`~looplm.lens.
settings.LensInputs` and :class:`~looplm.diagnostics.settings.DataSettings`.
"""

from __future__ import annotations

import argparse

from looplm.evaluate.settings import DataSettings
from looplm.lens.settings import LensInputs, LensSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (LensInputs, LensSettings, DataSettings)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "lens",
        help="Jacobian lens: fit J_t per loop step, readout fidelity, workspace, interventions",
        description=(
            "Fit the Jacobian lens of a checkpoint at depth T (and at extrapolated depths), "
            "compare it with the logit lens and a tuned lens per loop step on held-out prompts, "
            "measure the workspace structure and a coordinate-swap dose-response, and write "
            "lens.json, the lenses and the figures into --out."
        ),
    )
    p.add_argument("checkpoint", metavar="CHECKPOINT", help="checkpoint folder")
    for cls in SETTINGS:
        add_options(p, cls)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.lens.analysis import lens_checkpoint, summary_lines
    from looplm.settings.limits import check_output_folder

    settings = from_args(LensSettings, args)
    inputs, data = from_args(LensInputs, args), from_args(DataSettings, args)
    check_output_folder("--out", inputs.out)  # before the fit, not after it
    print("\n".join(summary_lines(lens_checkpoint(args.checkpoint, settings, inputs, data))))
    return 0
