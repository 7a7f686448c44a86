"""`looplm diagnose CHECKPOINT [CHECKPOINT …]`: the paper's mechanistic diagnostics.

For each checkpoint: forcing bias b_t and raw b̃_t, energy ratio R_t (Eq. 9), anchor energy E_Δ,t,
random-direction gain, anchor-start steering with the injection-gain dose-response, the
bias-subtraction counterfactual with a numerical Lemma 1 check, and per-token convergence
(:func:`looplm.diagnostics.checkpoints.diagnose_checkpoints`). The options are those of
:class:`~looplm.diagnostics.settings.DiagnoseSettings` and ``DataSettings``.
"""

from __future__ import annotations

import argparse

from looplm.diagnostics.settings import DiagnoseOutput, DiagnoseSettings
from looplm.evaluate.settings import DataSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (DiagnoseSettings, DataSettings, DiagnoseOutput)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "diagnose",
        help="mechanistic diagnostics: forcing bias, R_t, gain, steering, counterfactual, KL",
        description=(
            "Anchor-response diagnostics of looped checkpoints (paper Table 3, Figures 4-5, "
            "Lemma 1) and per-token convergence (KL halting study). Several checkpoints are "
            "compared in one set of figures."
        ),
    )
    p.add_argument("checkpoints", nargs="+", metavar="CHECKPOINT", help="checkpoint folder(s)")
    for cls in SETTINGS:
        add_options(p, cls)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.diagnostics.checkpoints import diagnose_checkpoints, table_lines
    from looplm.evaluate.inputs import set_threads
    from looplm.settings.limits import check_output_folder

    settings, data = from_args(DiagnoseSettings, args), from_args(DataSettings, args)
    io = from_args(DiagnoseOutput, args)
    check_output_folder("--out", io.out)  # before the diagnostics, not after them
    set_threads(io.threads)
    done = diagnose_checkpoints(
        args.checkpoints, settings, data, io.out, store=io.store, device=io.device, plots=io.plots
    )
    print("\n".join(table_lines(done["rows"])))
    figures = done["figures"]
    print(f"wrote {done['summary']}" + (f" and {len(figures)} figures" if figures else ""))
    return 0
