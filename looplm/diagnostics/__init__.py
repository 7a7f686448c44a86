"""Mechanistic diagnostics of looped models (SPEC §5; paper "Mechanistic Analysis" and appendix).

* :mod:`~looplm.diagnostics.anchor` — forcing bias b_t, raw b̃_t, energy ratio R_t (Eq. 9),
  anchor energy E_Δ,t, in each family's own anchor coordinates;
* :mod:`~looplm.diagnostics.gain` — random-direction gain (finite differences, ε = 1e-3);
* :mod:`~looplm.diagnostics.steering` — anchor-start rollouts, trajectory–ray cosines, the
  injection-gain dose-response (Figure 4);
* :mod:`~looplm.diagnostics.counterfactual` — bias-subtraction trajectories (Eq. 10) and numerical
  checks of Lemma 1, Theorem 2 and Corollary 3;
* :mod:`~looplm.diagnostics.convergence` — successive-output KL, per-token convergence depth by
  token type (the per-token convergence study);
* :mod:`~looplm.diagnostics.lens` — the Jacobian lens of a looped model per loop step (exact and
  Hutchinson fits, merge, files, logit lens); ``lens_readout`` (tuned lens, fidelity, token
  ranks), ``lens_structure`` (ranks, subspace overlaps, stationarity, composition, persistence),
  ``lens_interventions`` (steer, coordinate swap, project-out, dose-response), ``lens_run`` (the
  whole analysis of ``looplm lens``) and ``lens_plots``;
* :mod:`~looplm.diagnostics.runner` — all of them over measured batches;
  :mod:`~looplm.diagnostics.plots` — the figures.
"""

from looplm.diagnostics.anchor import AnchorMap, anchor_response, energy_ratio, mean_square
from looplm.diagnostics.convergence import (
    TOKEN_TYPES,
    convergence_depth,
    depth_by_type,
    relative_state_change,
    successive_kl,
    token_types,
)
from looplm.diagnostics.counterfactual import (
    bias_subtraction,
    counterfactual_check,
    gauss_legendre01,
    secant_apply,
)
from looplm.diagnostics.gain import random_direction_gain, unit_directions
from looplm.diagnostics.runner import DiagnoseOptions, diagnose_model
from looplm.diagnostics.steering import anchor_start_rollout, anchor_start_steering, source_gain

__all__ = [
    "TOKEN_TYPES",
    "AnchorMap",
    "DiagnoseOptions",
    "anchor_response",
    "anchor_start_rollout",
    "anchor_start_steering",
    "bias_subtraction",
    "convergence_depth",
    "counterfactual_check",
    "depth_by_type",
    "diagnose_model",
    "energy_ratio",
    "gauss_legendre01",
    "mean_square",
    "random_direction_gain",
    "relative_state_change",
    "secant_apply",
    "source_gain",
    "successive_kl",
    "token_types",
    "unit_directions",
]
