"""The Jacobian lens on the two-hop knowledge task (:mod:`looplm.lens.twohop`)::

    lens: {loops: 8, extrapolate: [24, 48], n_fit: 128, k: 8, band: [0.38, 0.92],
           extra_bands: [[0.1, 0.4]], arms: [jlens, logit, tuned], tuned_steps: 100,
           swap_depths: [8, 24]}

For every depth T (``loops`` and each ``extrapolate`` depth; an unshared model: its layer count
only) the lens arms are fitted on ``n_fit`` prompts of training text and every two-hop prompt is
read. Rows, all with ``dataset`` = the task and ``depth`` = T:

* ``split = lens:<set>:t=<t>`` (set ``two_hop`` = trained compositions, ``heldout``), one per loop
  step t = 0 … T: per arm the bridge entity's mean / median rank, top-1 and top-5 rates,
  ``KL(p_T ‖ lens_t)`` and top-1 agreement with the model at the query position, and the bridge's
  mean rank and top-1 rate at the first relation's position (``*_r1``); at T = ``loops`` also the
  per-prompt ranks and KLs (for paired intervals over seeds and prompts).
* ``split = lens:summary``: the model's accuracy per set, the top-k subspace overlaps of J_t within
  the fit and against the ``loops`` fit (same step), the random-subspace baseline, and at the
  ``swap_depths`` the bridge-swap test over the band of steps ``band`` (fractions of T; and over
  each band of ``extra_bands``) with J-lens and logit-lens directions, edited at the query position
  (``jlens``, ``logit``) and at every position of the prompt (``jlens@all``, ``logit@all``):
  per-prompt success and unrelated-pair control, on the trained compositions the model answers
  correctly. Fit and measurement wall times.

``n_tokens`` counts the prompts scored; ``sum_nll`` is 0 (the rows carry no likelihood).
"""

from __future__ import annotations

import time
from typing import Any

from looplm.errors import LoopLMError
from looplm.evaluate.kinds.base import EvalJob, EvaluationKind, register_kind
from looplm.lens.settings import TwoHopLensSettings, fractions

SETS = ("two_hop", "heldout")
SUMMARY = "lens:summary"


def _step_split(which: str, t: int) -> str:
    return f"lens:{which}:t={t}"


@register_kind
class Lens(EvaluationKind):
    """Bridge-entity rank, fidelity, subspace overlap and swap test per loop step."""

    name = "lens"
    section = "lens"
    order = 60

    Settings = TwoHopLensSettings

    def __init__(self, settings: TwoHopLensSettings) -> None:
        self.settings = settings
        self.loops, self.extrapolate = settings.loops, list(settings.extrapolate)
        self.n_fit, self.k, self.tuned_steps = settings.n_fit, settings.k, settings.tuned_steps
        self.batch_size, self.arms = settings.batch_size, list(settings.arms)
        self.band = fractions(settings.band, "band")
        self.extra_bands = [fractions(b, "extra_bands") for b in settings.extra_bands]
        self.swap_depths = list(settings.swap_depths or [self.loops])

    def depths(self, job: EvalJob) -> list[int]:
        if not job.cfg.model.is_looped:  # distinct layers: one depth, its layer count
            return [int(job.cfg.model.n_layers)]
        return [self.loops, *self.extrapolate]

    def _tag(self, job: EvalJob) -> str:
        return ",".join(x for x in (job.tag(), f"lensfit={self.n_fit}") if x)

    def _splits(self, T: int) -> list[str]:
        return [SUMMARY] + [_step_split(w, t) for w in SETS for t in range(T + 1)]

    def identities(self, job: EvalJob) -> list[dict[str, Any]]:
        from looplm.data.synthetic import TWOHOP
        from looplm.evaluate.records import fixed_depth_identities

        if job.cfg.data.dataset != TWOHOP:
            raise LoopLMError(
                f"the lens evaluation reads the two-hop task, not data.dataset="
                f"{job.cfg.data.dataset!r}; allowed: {TWOHOP}"
            )
        return [
            i
            for T in self.depths(job)
            for split in self._splits(T)
            for i in fixed_depth_identities(
                job.cfg, [T], dataset=TWOHOP, split=split, tag=self._tag(job), protocol=job.protocol
            )  # fmt: skip
        ]

    def run(self, job: EvalJob, todo: list[dict[str, Any]]) -> list[Any]:
        wanted = {(i["split"], i["depth"]) for i in todo}
        out: list[Any] = []
        base_lens = None
        for T in self.depths(job):
            if not any(d == T for _, d in wanted) and T != self.depths(job)[0]:
                continue
            records, lens = self._depth(job, T, base_lens)
            if base_lens is None:
                base_lens = lens
            out += [r for r in records if (r.split, r.depth) in wanted]
        return out

    # long: one depth's fits, readouts of both prompt sets, overlap, swaps and rows in one pass
    def _depth(self, job: EvalJob, T: int, base_lens: Any) -> tuple[list[Any], Any]:
        """Every row of depth T, and its J-lens (the first depth's is the persistence base)."""
        import numpy as np

        from looplm.data.twohop import knowledge_base
        from looplm.evaluate.records import fixed_depth_records
        from looplm.evaluate.twohop import prompts
        from looplm.lens import twohop as lt

        model, task_args = job.model(), job.cfg.data.task_args
        kb = knowledge_base(task_args)
        t0 = time.perf_counter()
        arms = lt.fit_arms(model, task_args, T, self.n_fit, self.arms, self.tuned_steps)
        fit_s = time.perf_counter() - t0
        first = base_lens is None
        rows: list[tuple[str, dict[str, Any]]] = []
        summary: dict[str, Any] = {"fit_s": fit_s, "loops": T, "sets": {}}
        correct_train = None
        for which in SETS:
            p = prompts(kb, which)
            m = lt.readout_measures(model, arms, p, self.batch_size)
            summary["sets"][which] = {
                "accuracy": float(m["correct"].mean()),
                "n_correct": int(m["correct"].sum()),
                "n_examples": int(m["correct"].size),
            }
            if which == "two_hop":
                correct_train = (p, m["correct"])
            for t in range(T + 1):
                ex: dict[str, Any] = {"t": t, "loops": T, "set": which, "fraction": t / T}
                for a in arms:
                    r, k, g = m[a]["rank"][t], m[a]["kl"][t], m[a]["agree"][t]
                    ex[a] = {
                        "bridge_rank_mean": float(r.mean()),
                        "bridge_rank_median": float(np.median(r)),
                        "bridge_top1": float((r == 0).mean()),
                        "bridge_top5": float((r < 5).mean()),
                        "kl_mean": float(k.mean()),
                        "agree_top1": float(g.mean()),
                    }
                    r1 = m[a]["rank_r1"][t]
                    ex[a]["bridge_rank_r1_mean"] = float(r1.mean())
                    ex[a]["bridge_top1_r1"] = float((r1 == 0).mean())
                    if first:  # per prompt, for paired intervals at the trained depth
                        ex[a]["rank"] = r.astype(int).tolist()
                        ex[a]["kl"] = [round(float(x), 6) for x in k]
                rows.append((_step_split(which, t), {"n_tokens": int(r.size), **ex}))
        lenses = {T: arms["jlens"]} if first else {base_lens.loops: base_lens, T: arms["jlens"]}
        summary["subspace"] = lt.subspace_overlap(lenses, self.k)
        if T in self.swap_depths or not job.cfg.model.is_looped:
            summary["swap"] = self._swaps(model, arms, kb, correct_train, T, self.band)
            summary["swap_extra"] = [
                self._swaps(model, arms, kb, correct_train, T, b) for b in self.extra_bands
            ]
        summary["wall_s"] = time.perf_counter() - t0
        rows.insert(0, (SUMMARY, {"n_tokens": int(correct_train[1].size), **summary}))
        extra = {**job.extra, "lens_loops": self.loops}
        if not job.cfg.model.is_looped:
            extra["fixed_depth"] = job.cfg.model.n_layers
        records = []
        for split, row in rows:
            records += fixed_depth_records(
                [{"depth": T, "sum_nll": 0.0, **row}], job.cfg, dataset=job.cfg.data.dataset,
                split=split, tag=self._tag(job), protocol=job.protocol, extra=extra,
            )  # fmt: skip
        return records, arms["jlens"]

    def _swaps(self, model, arms, kb, correct_train, T: int, fractions) -> dict[str, Any]:
        """The swap test over the band ``fractions`` of T, per direction arm and edit position."""
        from looplm.lens import twohop as lt
        from looplm.lens.interventions import band_from_fractions

        band = band_from_fractions(fractions[0], fractions[1], T)
        p, ok = correct_train
        swaps = {}
        for a, where in (("jlens", "query"), ("logit", "query"), ("jlens", "all"),
                         ("logit", "all")):  # fmt: skip
            lens = arms["jlens"] if a == "jlens" else _logit(model, T)
            s = lt.swap_test(model, lens, kb, p, band, select=ok, batch_size=self.batch_size,
                             where=where)  # fmt: skip
            swaps[a if where == "query" else f"{a}@all"] = {
                "success_rate": float(s["success"].mean()) if s["success"].size else None,
                "control_rate": float(s["control"].mean()) if s["control"].size else None,
                "changed_rate": float(s["changed"].mean()) if s["changed"].size else None,
                "control_changed_rate": (
                    float(s["control_changed"].mean()) if s["control_changed"].size else None
                ),
                "n": int(s["success"].size),
                **{k: v.astype(int).tolist() for k, v in s.items()},
            }
        return {"band": list(band), "fractions": list(fractions), "arms": swaps}


def _logit(model: Any, T: int) -> Any:
    from looplm.lens.jacobian import logit_lens

    return logit_lens(model, T)
