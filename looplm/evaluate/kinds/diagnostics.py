"""Mechanistic diagnostics of one checkpoint as a store row (``looplm diagnose --store``).

One row per checkpoint at its diagnosed depth T: ``eval_tag='diagnostics'``, the token-level NLL
at T, and in ``extra`` the summary with the per-step curves (energy ratio R_t, random-direction
gain, anchor energy, successive-output KL) and the steering rollouts. The rows are reported with
the fixed-depth tables. The experiment runner does not run this kind (``looplm diagnose`` does):
it has no section under ``evaluate:``.
"""

from __future__ import annotations

from typing import Any

from looplm.evaluate.kinds.base import EvaluationKind, register_kind

EVAL_TAG = "diagnostics"


@register_kind
class Diagnostics(EvaluationKind):
    """Forcing bias, R_t, gains, steering and convergence of one checkpoint (one row)."""

    name = "diagnostics"
    order = 90

    @classmethod
    def configure(cls, evaluate: dict[str, Any]) -> None:
        return None  # written by `looplm diagnose --store`, not by the experiment runner

    @classmethod
    def record(cls, cfg: Any, results: dict[str, Any]) -> Any:
        """The store record of one checkpoint's diagnostics (``results`` as ``looplm diagnose``
        writes them to ``diagnostics.json``)."""
        from looplm.data.corpora import canonical_split
        from looplm.evaluate.records import protocol_name
        from looplm.results.store import EvalRecord

        s = results["summary"]
        extra = {
            **s,
            "R_per_step": results["per_step"]["ratio"],
            "gain_per_step": results["per_step"]["gain"],
            "anchor_energy_per_step": results["per_step"]["anchor_energy"],
            "kl_per_loop": results["convergence"]["kl_per_loop"],
            "steering": results["steering"],
            "checkpoint": results["checkpoint"],
            "dtype": results["dtype"],
            "batch_shape": results["batch_shape"],
            "n_batches": results["n_batches"],
        }
        rec = EvalRecord(
            model_hash=results["model_hash"],
            method=results["method"],
            protocol=protocol_name(cfg),
            dataset=results["data"]["dataset"],
            split=canonical_split(results["data"]["split"]),
            depth=results["loops"],
            seed=results["seed"],
            eval_tag=EVAL_TAG,
            n_tokens=int(s["n_scored_tokens"] or 0),
            sum_nll=float(s["sum_nll_T"] or 0.0),
            extra=extra,
        )
        return cls.stamp([rec])[0]
