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
* the Jacobian lens is an analysis of its own: :mod:`looplm.lens`;
* :mod:`~looplm.diagnostics.settings` — the settings of ``looplm diagnose``, its sweep kind and
  :func:`~looplm.diagnostics.runner.diagnose_model`; :mod:`~looplm.diagnostics.checkpoints` — the
  diagnostics of several checkpoints; :mod:`~looplm.diagnostics.kind` — the ``diagnostics`` sweep
  kind (its rows go to the fixed-depth tables); :mod:`~looplm.diagnostics.command` —
  ``looplm diagnose``;
* :mod:`~looplm.diagnostics.runner` — all of them over measured batches;
  :mod:`~looplm.diagnostics.plots` — the figures.
"""

from looplm.settings.plugins import lazy_attributes

# Loaded on first use: ``looplm.diagnostics.settings`` (what the command line is built from)
# imports without torch.
__getattr__ = lazy_attributes(
    __name__,
    {
        "AnchorMap": "looplm.diagnostics.anchor",
        "anchor_response": "looplm.diagnostics.anchor",
        "energy_ratio": "looplm.diagnostics.anchor",
        "mean_square": "looplm.diagnostics.anchor",
        "TOKEN_TYPES": "looplm.diagnostics.convergence",
        "convergence_depth": "looplm.diagnostics.convergence",
        "depth_by_type": "looplm.diagnostics.convergence",
        "relative_state_change": "looplm.diagnostics.convergence",
        "successive_kl": "looplm.diagnostics.convergence",
        "token_types": "looplm.diagnostics.convergence",
        "bias_subtraction": "looplm.diagnostics.counterfactual",
        "counterfactual_check": "looplm.diagnostics.counterfactual",
        "gauss_legendre01": "looplm.diagnostics.counterfactual",
        "secant_apply": "looplm.diagnostics.counterfactual",
        "random_direction_gain": "looplm.diagnostics.gain",
        "unit_directions": "looplm.diagnostics.gain",
        "DiagnoseOptions": "looplm.diagnostics.runner",
        "diagnose_model": "looplm.diagnostics.runner",
        "anchor_start_rollout": "looplm.diagnostics.steering",
        "anchor_start_steering": "looplm.diagnostics.steering",
        "source_gain": "looplm.diagnostics.steering",
    },
)


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
