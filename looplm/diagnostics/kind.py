"""Mechanistic diagnostics (:mod:`looplm.diagnostics`) as store rows: written by
``looplm diagnose --store`` for one checkpoint, and by a sweep for every looped run of a grid
whose ``evaluate:`` has a ``diagnostics`` section, so the paper's anchor-response tables (Table 3's
R_t and E_Δ,t, Table 20's R_47, Table 22's gains, Figure 5), the anchor-start steering of Figure 4
and the per-token convergence statistics come out of a sweep::

    diagnostics: {split: test, loops: 48, batches: 2, batch_size: 4, kl_threshold: 0.001,
                  steer_inputs: 6, check_steps: 0, dtype: float64, seed: 0}

(the keys of :class:`looplm.diagnostics.settings.DiagnosticsKindSettings`, the settings of
``looplm diagnose`` plus the split).

One row per looped run (unshared Transformers have no anchor and are left out) at the diagnosed
depth T: ``eval_tag`` ``diagnostics`` (``steer=<inputs>`` added when steering rollouts are
measured; a sweep's rows add ``cap=<batches·batch_size>ex``), the
token-level NLL of the ordinary unroll at T on the measured windows, and in ``extra`` the summary,
the per-step curves (R_t, random-direction gain, E_Δ,t, bias and update energies, the
bias-subtraction E_t), the successive-output KL per loop, the convergence statistics (median
convergence loop, fraction still updating at the largest training depth, depth by token type)
and the steering summary. A sweep measures the first ``batches`` full ``batch_size`` × context
windows of ``split`` in ``dtype`` (float64 keeps the ε = 1e-3 finite differences of the gain exact
enough). The rows are reported with the fixed-depth tables.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from looplm.diagnostics.settings import DiagnosticsKindSettings
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind

EVAL_TAG = "diagnostics"


def diagnostics_extra(results: dict[str, Any]) -> dict[str, Any]:
    """The store ``extra`` of one diagnosed run (``results`` as :func:`looplm.diagnostics.
    diagnose_model` returns them, plus ``checkpoint``)."""
    per_step = results["per_step"]
    return {
        **results["summary"],
        "R_per_step": per_step["ratio"],
        "gain_per_step": per_step["gain"],
        "anchor_energy_per_step": per_step["anchor_energy"],
        "per_step": per_step,
        "kl_per_loop": results["convergence"]["kl_per_loop"],
        "convergence": results["convergence"],
        "steering": results["steering"],
        "checkpoint": results.get("checkpoint"),
        "dtype": results["dtype"],
        "batch_shape": results["batch_shape"],
        "n_batches": results["n_batches"],
    }


@register_kind
class Diagnostics(EvaluationKind):
    """Forcing bias, R_t, gains, steering and convergence of a looped run (one row)."""

    name = "diagnostics"
    section = "diagnostics"
    Settings = DiagnosticsKindSettings
    order = 90

    def __init__(self, settings: DiagnosticsKindSettings) -> None:
        self.settings = settings

    @classmethod
    def record(cls, cfg: Any, results: dict[str, Any], **identity: Any) -> Any:
        """The store record of one checkpoint's diagnostics (``results`` as ``looplm diagnose``
        writes them to ``diagnostics.json``); ``identity`` overrides identity fields."""
        from looplm.data.corpora import canonical_split
        from looplm.evaluate.records import protocol_name
        from looplm.results.store import EvalRecord

        s = results["summary"]
        fields = {
            "model_hash": results["model_hash"],
            "method": results["method"],
            "protocol": protocol_name(cfg),
            "dataset": results["data"]["dataset"],
            "split": canonical_split(results["data"]["split"]),
            "depth": results["loops"],
            "seed": results["seed"],
            "eval_tag": EVAL_TAG,
            **identity,
        }
        rec = EvalRecord(
            **fields,
            n_tokens=int(s["n_scored_tokens"] or 0),
            sum_nll=float(s["sum_nll_T"] or 0.0),
            extra={**diagnostics_extra(results), **results.get("extra", {})},
        )
        return cls.stamp([rec])[0]

    def tag(self, job: EvalJob) -> str:
        from looplm.evaluate.records import eval_tag

        s = self.settings
        # rows with steering rollouts are a different measurement from rows without: a grid
        # asking for them must not find a steering-free row of the same cell and skip
        steer = min(s.steer_inputs, s.batch_size * s.batches)
        parts = (EVAL_TAG, f"steer={steer}" if steer else "", job.evaluate.get("tag", ""))
        return eval_tag(",".join(x for x in parts if x), max_examples=s.batches * s.batch_size)

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.data.corpora import canonical_split

        m = job.cfg.model
        if not m.is_looped or m.coda_layers:  # no anchor to measure / loop states not read out
            return []
        return [
            {
                "model_hash": job.model_hash,
                "method": job.cfg.method_label,
                "protocol": job.protocol,
                "dataset": job.cfg.data.dataset,
                "split": canonical_split(self.settings.split),
                "depth": self.settings.loops,
                "seed": int(job.cfg.train.seed),
                "eval_tag": self.tag(job),
                "adaptive_mode": "",
                "calibration": "",
            }
        ]

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        import copy

        import torch

        from looplm.diagnostics.runner import diagnose_model
        from looplm.evaluate.inputs import checkpoint_tokenizer, load_batches

        if not todo:
            return []
        s = self.settings
        dtype = {"float64": torch.float64, "float32": torch.float32}[s.dtype]
        model = copy.deepcopy(job.model()).to(dtype).eval()
        batches, info, pad_id = load_batches(
            job.cfg,
            split=s.split,
            data_dir=job.data_dir,
            batch_size=s.batch_size,
            n_batches=s.batches,
            seed=job.cfg.train.seed,
        )
        tokenizer, _ = checkpoint_tokenizer(job.cfg)  # without one, token types are all "other"
        opts = dataclasses.replace(
            s,
            ref_depth=job.cfg.train.depth_max,
            steer_inputs=min(s.steer_inputs, s.batch_size * s.batches),
        )
        results, _arrays = diagnose_model(
            model, batches, opts, tokenizer=tokenizer, pad_id=pad_id, progress=job.progress
        )
        results.update(
            model_hash=job.model_hash,
            method=job.cfg.method_label,
            seed=job.cfg.train.seed,
            data=info,
            extra={**job.extra, "data": info},
        )
        identity = {k: todo[0][k] for k in ("protocol", "split", "eval_tag", "dataset")}
        return [self.record(job.cfg, results, **identity)]
