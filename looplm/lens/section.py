"""Findings of the ``lens`` evaluation kind: the three workspace criteria per model family.

:func:`lens_findings` reads the store rows the kind wrote (:mod:`looplm.evaluate.kinds.lens`) and
judges, per method over its seeds:

1. **band** — loop steps t < T where ``KL(p_T ‖ logit lens_t) − KL(p_T ‖ J-lens_t)`` at the query
   position has a 95% bootstrap interval above zero (per-prompt values averaged over the seeds,
   prompts resampled); holds for a run of at least two consecutive steps;
2. **overlap** — the mean top-k subspace overlap between distinct steps of the depth-T fit, and
   (looped models) within the deepest fit and between the depth-T and the deepest fit at the same
   step, above the random baseline's 95th percentile in every seed;
3. **swap** — the bridge swap's success minus the unrelated-pair control (J-lens directions, the
   pre-registered band, query position) has a 95% bootstrap interval above zero (per prompt over
   the seeds it was swapped in).

Every interval is a 95% percentile bootstrap interval over prompts (:data:`INTERVAL`). Each
criterion gets a word of the verdict vocabulary (:mod:`looplm.results.vocabulary`) by the rule of
:data:`LENS_VERDICTS`: the effects of criteria 1 and 3 are judged by the vocabulary's one rule
(:func:`~looplm.results.vocabulary.decide`) under its margin policy (minimum effects
:data:`KL_MARGIN` and :data:`SWAP_MARGIN`), so a gain of +0.0004 nats or a swap effect of one swap
in 1,152 is **not distinguishable**, not a direction; criterion 2 passes for any residual stream
(the unshared model included), so its pass is worded **holds by construction**. A family takes
its weakest criterion's word, as a paper claim over several points does.

:func:`lens_figures` draws the bridge rank, fidelity, overlap and swap figures.
"""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.results.sections import ReportSection, register_section
from looplm.results.stats import paired_bootstrap_ci
from looplm.results.store import EvalRecord, group_by
from looplm.results.vocabulary import (
    BY_CONSTRUCTION,
    IN_DIRECTION,
    NATS,
    NOT_DISTINGUISHABLE,
    NOT_REPRODUCED,
    NOT_RUN,
    POINTS,
    REPRODUCED,
    decide,
    weakest,
)

SUMMARY = "lens:summary"
INTERVAL = "95% percentile bootstrap interval over prompts (per-prompt values averaged over seeds)"
KL_MARGIN = NATS  # the margin policy's minimum effect for a KL gain (nats)
SWAP_MARGIN = POINTS / 100  # ... and for a swap effect (2 percentage points, as a fraction)
# The verdict words for one pre-registered criterion (1 band, 2 overlap, 3 swap).
LENS_VERDICTS: dict[str, str] = {
    REPRODUCED: "the criterion holds as pre-registered: (1) at least 2 consecutive steps whose "
    f"interval of the KL gain lies above 0, with mean gains of at least {KL_MARGIN:g} nats; (3) "
    f"the swap effect's interval above 0, its mean at least {100 * SWAP_MARGIN:g} points",
    IN_DIRECTION: "the means reach the minimum effect on the criterion's side but the intervals "
    f"do not exclude 0: (1) at least 2 consecutive steps with a mean KL gain of {KL_MARGIN:g} "
    f"nats or more; (3) a mean swap effect of {100 * SWAP_MARGIN:g} points or more",
    BY_CONSTRUCTION: "(2) every seed's overlaps above the random 95th percentile: any residual "
    "stream passes (the unshared model does too), so this is a check, not a finding",
    NOT_DISTINGUISHABLE: "no mean reaches the minimum effect either way: (1) no step's mean KL "
    f"gain is {KL_MARGIN:g} nats or more from 0; (3) the mean swap effect is within "
    f"{100 * SWAP_MARGIN:g} points of 0",
    NOT_REPRODUCED: "the means reach the minimum effect only on the wrong side ((1): steps where "
    "the J-lens loses, none where it wins), or (2) an overlap at or below the percentile",
    NOT_RUN: "the criterion has no rows",
}
CRITERIA = ("band", "overlap", "swap")


def _step(split: str) -> tuple[str, int] | None:
    parts = split.split(":")
    if len(parts) == 3 and parts[0] == "lens" and parts[2].startswith("t="):
        return parts[1], int(parts[2][2:])
    return None


def is_lens_record(rec: EvalRecord) -> bool:
    """A row of the ``lens`` evaluation kind (reported in the lens section only)."""
    return rec.split.startswith("lens:")


def lens_records(store: str | Path, protocol: str | None = None) -> list[EvalRecord]:
    """Every lens row of ``store`` — a SQLite store or its export (``docs/data/lens.jsonl``) —
    optionally of one protocol."""
    from looplm.results.export import load_records

    recs = load_records(store)
    return [r for r in recs if is_lens_record(r) and protocol in (None, r.protocol)]


def _mean_over_seeds(per_seed: list[np.ndarray]) -> np.ndarray:
    return np.mean(np.stack(per_seed), axis=0)


def _interval(values: np.ndarray, n_boot: int) -> dict[str, float]:
    lo, hi = paired_bootstrap_ci(values, n_boot=n_boot)
    return {"mean": float(np.mean(values)), "lo": lo, "hi": hi}


def _runs(steps: Sequence[int]) -> list[list[int]]:
    """Runs of consecutive integers."""
    out: list[list[int]] = []
    for t in steps:
        if out and t == out[-1][-1] + 1:
            out[-1].append(t)
        else:
            out.append([t])
    return out


def _swap_effect(summaries: list[dict[str, Any]], key: str, arm: str, n_boot: int):
    """Success − control per prompt (averaged over the seeds a prompt was swapped in)."""
    per_prompt: dict[int, list[float]] = defaultdict(list)
    succ, ctrl = [], []
    for s in summaries:
        block = s.get(key)
        if isinstance(block, list):  # swap_extra: a list of bands
            block = block[0] if block else None
        if not block or arm not in block["arms"]:
            return None
        a = block["arms"][arm]
        for i, x, c in zip(a["prompt"], a["success"], a["control"]):
            per_prompt[int(i)].append(float(x) - float(c))
        succ.append(a["success_rate"])
        ctrl.append(a["control_rate"])
    if not per_prompt:
        return None
    d = np.array([np.mean(v) for v in per_prompt.values()])
    return {
        "band": block["band"],
        "success": float(np.mean(succ)),
        "control": float(np.mean(ctrl)),
        "effect": _interval(d, n_boot),
        "n_prompts": int(d.size),
    }


def lens_findings(
    store: str | Path, protocol: str | None = None, n_boot: int = 10_000
) -> dict[str, Any]:
    """Per method: the three criteria, their numbers and a verdict (see the module docstring)."""
    recs = lens_records(store, protocol)
    if not recs:
        raise LoopLMError(
            f"{store}: no lens rows{f' of protocol {protocol!r}' if protocol else ''}"
        )
    return findings_from_records(recs, n_boot)


def findings_from_records(recs: Sequence[EvalRecord], n_boot: int = 10_000) -> dict[str, Any]:
    """:func:`lens_findings` of lens rows already read (one protocol)."""
    by_method: dict[str, list[EvalRecord]] = defaultdict(list)
    for r in recs:
        by_method[r.method].append(r)
    out: dict[str, Any] = {}
    for method, rows in sorted(by_method.items()):
        out[method] = _method_findings(rows, n_boot)
    return out


def _method_findings(rows: list[EvalRecord], n_boot: int) -> dict[str, Any]:
    T = min(r.depth for r in rows)  # the trained depth: the shallowest lens depth
    deep = max(r.depth for r in rows)
    seeds = sorted({r.seed for r in rows})
    summ = {(r.depth, r.seed): r.extra for r in rows if r.split == SUMMARY}
    steps: dict[tuple[str, int, int], dict[int, dict]] = defaultdict(dict)
    for r in rows:
        st = _step(r.split)
        if st:
            steps[(st[0], r.depth, st[1])][r.seed] = r.extra
    res: dict[str, Any] = {"loops": T, "deep": deep, "seeds": seeds}
    # accuracy
    res["accuracy"] = {
        w: float(np.mean([summ[(T, s)]["sets"][w]["accuracy"] for s in seeds if (T, s) in summ]))
        for w in ("two_hop", "heldout")
    }
    res["band"] = _band_criterion(steps, T, seeds, n_boot)
    res["overlap"] = _overlap_criterion(summ, T, deep, seeds)
    res["swap"] = _swap_criterion([summ[(T, s)] for s in seeds if (T, s) in summ], n_boot)
    # the family's word: its weakest criterion's (the combination rule of paper claims)
    # (a criterion that holds by construction discriminates nothing: it does not lift or lower it)
    res["verdict"] = weakest([res[k]["verdict"] for k in CRITERIA
                              if res[k]["verdict"] != BY_CONSTRUCTION])  # fmt: skip
    res["criteria_met"] = [i for i, k in enumerate(CRITERIA, 1)
                           if res[k]["holds"] and res[k]["verdict"] != BY_CONSTRUCTION]  # fmt: skip
    res["by_construction"] = [i for i, k in enumerate(CRITERIA, 1)
                              if res[k]["verdict"] == BY_CONSTRUCTION]  # fmt: skip
    res["wall_s"] = float(sum(summ[k].get("wall_s", 0.0) for k in summ))
    return res


def _band_criterion(steps: dict, T: int, seeds: list[int], n_boot: int) -> dict[str, Any]:
    """Criterion 1 (and, reported: the bridge rank difference, the tuned arm)."""
    per_step = []
    for t in range(T):
        cell = steps.get(("two_hop", T, t), {})
        if len(cell) < len(seeds) or any("kl" not in cell[s]["jlens"] for s in seeds):
            continue
        kl_j = _mean_over_seeds([np.asarray(cell[s]["jlens"]["kl"]) for s in seeds])
        kl_l = _mean_over_seeds([np.asarray(cell[s]["logit"]["kl"]) for s in seeds])
        rk_j = _mean_over_seeds([np.asarray(cell[s]["jlens"]["rank"], float) for s in seeds])
        rk_l = _mean_over_seeds([np.asarray(cell[s]["logit"]["rank"], float) for s in seeds])
        row = {
            "t": t,
            "kl_jlens": float(kl_j.mean()),
            "kl_logit": float(kl_l.mean()),
            "kl_gain": _interval(kl_l - kl_j, n_boot),
            "rank_jlens": float(rk_j.mean()),
            "rank_logit": float(rk_l.mean()),
            "rank_gain": _interval(rk_l - rk_j, n_boot),
            "rank_r1_jlens": float(
                np.mean([cell[s]["jlens"]["bridge_rank_r1_mean"] for s in seeds])
            ),
            "rank_r1_logit": float(
                np.mean([cell[s]["logit"]["bridge_rank_r1_mean"] for s in seeds])
            ),
            "top1_r1_jlens": float(np.mean([cell[s]["jlens"]["bridge_top1_r1"] for s in seeds])),
            "top1_r1_logit": float(np.mean([cell[s]["logit"]["bridge_top1_r1"] for s in seeds])),
        }
        if all("tuned" in cell[s] for s in seeds):
            row["kl_tuned"] = float(np.mean([cell[s]["tuned"]["kl_mean"] for s in seeds]))
            row["rank_tuned"] = float(
                np.mean([cell[s]["tuned"]["bridge_rank_mean"] for s in seeds])
            )
        per_step.append(row)
    for r in per_step:
        g = r["kl_gain"]
        r["word"] = decide(g["mean"], g["lo"], g["hi"], +1, KL_MARGIN)
    winning = [r["t"] for r in per_step if r["word"] == REPRODUCED]
    runs = [r for r in _runs(winning) if len(r) >= 2]
    ahead = [r["t"] for r in per_step if r["word"] in (REPRODUCED, IN_DIRECTION)]
    leaning = [r for r in _runs(ahead) if len(r) >= 2]
    if not per_step:
        word = NOT_RUN
    elif runs:
        word = REPRODUCED
    elif leaning:
        word = IN_DIRECTION
    elif not any(r["word"] == NOT_REPRODUCED for r in per_step):
        word = NOT_DISTINGUISHABLE
    else:
        word = NOT_REPRODUCED
    return {"steps": winning, "bands": runs, "holds": bool(runs), "per_step": per_step,
            "verdict": word}  # fmt: skip


def _overlap_criterion(summ: dict, T: int, deep: int, seeds: list[int]) -> dict[str, Any]:
    """Criterion 2: within the depth-T fit, within the deepest fit and same-step across them."""
    ov: dict[str, Any] = {"per_seed": {}}
    holds = bool(seeds)
    for s in seeds:
        a = summ.get((T, s))
        if a is None:
            holds = False
            continue
        sub = a["subspace"]
        p95 = sub["random"]["p95"]
        seed_row = {"within_T": sub["within"][str(T)] if str(T) in sub["within"]
                    else sub["within"][T], "p95": p95}  # fmt: skip
        ok = seed_row["within_T"] > p95
        if deep > T:
            b = summ.get((deep, s))
            if b is None:
                ok = False
            else:
                w = b["subspace"]["within"]
                ss = b["subspace"]["same_step"]
                seed_row["within_deep"] = w.get(str(deep), w.get(deep))
                seed_row["same_step"] = ss.get(str(deep), ss.get(deep))
                ok = ok and seed_row["within_deep"] > p95 and seed_row["same_step"] > p95
        seed_row["holds"] = ok
        holds = holds and ok
        ov["per_seed"][s] = seed_row
    ov["holds"] = holds
    ov["extrapolated"] = deep > T
    # in direction: the seed means of every judged overlap above the seed-mean percentile
    rows = list(ov["per_seed"].values())
    keys = ("within_T", "within_deep", "same_step") if deep > T else ("within_T",)
    means = [np.mean([r.get(k, math.nan) for r in rows]) for k in keys] if rows else []
    p95 = np.mean([r["p95"] for r in rows]) if rows else math.nan
    # every residual stream passes (the unshared model too): a check, not a finding
    ov["verdict"] = NOT_RUN if not rows else (BY_CONSTRUCTION if holds else NOT_REPRODUCED)
    ov["seed_means_above"] = bool(means) and all(m > p95 for m in means)
    return ov


def _swap_criterion(sums: list[dict[str, Any]], n_boot: int) -> dict[str, Any]:
    """Criterion 3 (J-lens directions, the pre-registered band, query position) and, reported,
    the other swap variants."""
    swap: dict[str, Any] = {
        "jlens": _swap_effect(sums, "swap", "jlens", n_boot),
        "logit": _swap_effect(sums, "swap", "logit", n_boot),
        "jlens@all": _swap_effect(sums, "swap", "jlens@all", n_boot),
        "early:jlens": _swap_effect(sums, "swap_extra", "jlens", n_boot),
        "early:jlens@all": _swap_effect(sums, "swap_extra", "jlens@all", n_boot),
        "early:logit@all": _swap_effect(sums, "swap_extra", "logit@all", n_boot),
    }
    main = swap["jlens"]
    if main:
        e = main["effect"]
        swap["verdict"] = decide(e["mean"], e["lo"], e["hi"], +1, SWAP_MARGIN)
    else:
        swap["verdict"] = NOT_RUN
    swap["holds"] = swap["verdict"] == REPRODUCED
    return swap


def findings_table(findings: dict[str, Any]) -> str:
    """A Markdown table: per method each criterion's word and key numbers, and the family's
    verdict (its weakest criterion's word), followed by the rule behind the words."""
    lines = [
        "| method | two-hop acc. (trained / held-out) | 1. J-lens band (steps, mean KL gain) | "
        "2. overlap T / deep / same-step vs p95 (seed means) | 3. swap success − control "
        "[95% percentile bootstrap interval over prompts] | verdict (weakest criterion) |",
        "|---|---|---|---|---|---|",
    ]
    for m, f in findings.items():
        acc = f"{100 * f['accuracy']['two_hop']:.1f}% / {100 * f['accuracy']['heldout']:.1f}%"
        b = f["band"]
        if b["steps"]:
            gains = {r["t"]: r["kl_gain"]["mean"] for r in b["per_step"]}
            band = ", ".join(f"{t} ({gains[t]:+.3g})" for t in b["steps"])
        else:
            band = "none"
        band = f"**{b['verdict']}**: {band}"
        ov = f["overlap"]
        vals = list(ov["per_seed"].values())
        if vals:
            w = np.mean([v["within_T"] for v in vals])
            txt = f"{w:.2f}"
            if ov["extrapolated"]:
                wd = np.mean([v.get("within_deep", math.nan) for v in vals])
                sd = np.mean([v.get("same_step", math.nan) for v in vals])
                txt += f" / {wd:.2f} / {sd:.2f}"
            else:
                txt += " / – / –"
            txt += f" vs {vals[0]['p95']:.2f}"
        else:
            txt = "–"
        ov_txt = f"**{ov['verdict']}**: {txt}"
        s = f["swap"]["jlens"]
        if s:
            e = s["effect"]
            sw = (
                f"**{f['swap']['verdict']}**: {100 * s['success']:.1f}% − "
                f"{100 * s['control']:.1f}% [{100 * e['lo']:+.1f}, {100 * e['hi']:+.1f}]"
            )
        else:
            sw = f"**{f['swap']['verdict']}**"
        met = ", ".join(str(i) for i in f["criteria_met"]) or "none"
        built = ", ".join(str(i) for i in f.get("by_construction", []))
        met += f"; by construction: {built}" if built else ""
        verdict = f"**{f['verdict']}** (criteria met: {met})"
        lines.append(f"| {m} | {acc} | {band} | {ov_txt} | {sw} | {verdict} |")
    lines += [
        "",
        f"Intervals: {INTERVAL}. Minimum effects (the one margin policy): "
        f"{KL_MARGIN:g} nats of KL gain, {100 * SWAP_MARGIN:g} points of swap effect. "
        "Words, per criterion:",
        "",
    ]
    lines += [f"- **{w}**: {c}" for w, c in LENS_VERDICTS.items()]
    return "\n".join(lines)


# long: four small figures drawn from one findings pass
def lens_figures(store: str | Path, out_dir: str | Path, protocol: str | None = None) -> list[Path]:
    """``lens_twohop_{bridge_rank,fidelity,overlap,swap}.png``."""
    from looplm.results.plotting import new_figure, save_png

    f = lens_findings(store, protocol, n_boot=1000)
    out = Path(out_dir)
    methods = list(f)
    paths = []
    # bridge rank per step: query position and first-relation position
    fig, axes = new_figure((11, 3.8), ncols=2)
    for i, m in enumerate(methods):
        ps = f[m]["band"]["per_step"]
        if not ps:
            continue
        t = [r["t"] for r in ps]
        c = f"C{i}"
        axes[0].plot(t, [r["rank_jlens"] for r in ps], "-o", color=c, label=f"{m} J-lens", ms=3)
        axes[0].plot(t, [r["rank_logit"] for r in ps], "--", color=c, label=f"{m} logit", lw=1)
        axes[1].plot(t, [r["top1_r1_jlens"] for r in ps], "-o", color=c, ms=3, label=f"{m} J-lens")
        axes[1].plot(t, [r["top1_r1_logit"] for r in ps], "--", color=c, lw=1, label=f"{m} logit")
    axes[0].set(xlabel="loop step t (T = 8)", ylabel="bridge rank (of 257)", yscale="log",
                title="bridge entity at the query position")  # fmt: skip
    axes[1].set(xlabel="loop step t (T = 8)", ylabel="bridge top-1 rate",
                title="bridge entity at the first relation's position")  # fmt: skip
    axes[1].legend(fontsize=6, ncol=2)
    paths.append(save_png(fig, out / "lens_twohop_bridge_rank.png", dpi=130))
    # fidelity: KL per step, three arms
    fig, axes = new_figure((3.2 * len(methods), 3.2), ncols=len(methods))
    axes = np.atleast_1d(axes)
    for ax, m in zip(axes, methods):
        ps = f[m]["band"]["per_step"]
        t = [r["t"] for r in ps]
        ax.plot(t, [r["kl_jlens"] for r in ps], "-o", ms=3, label="J-lens")
        ax.plot(t, [r["kl_logit"] for r in ps], "-s", ms=3, label="logit lens")
        if ps and "kl_tuned" in ps[0]:
            ax.plot(t, [r["kl_tuned"] for r in ps], "-^", ms=3, label="tuned lens")
        for st in f[m]["band"]["steps"]:
            ax.axvspan(st - 0.5, st + 0.5, color="0.9", zorder=0)
        ax.set(title=m, xlabel="loop step t", yscale="symlog")
        ax.set_yscale("symlog", linthresh=1e-3)
    axes[0].set_ylabel("KL(p_T ‖ lens_t), query position")
    axes[0].legend(fontsize=7)
    paths.append(save_png(fig, out / "lens_twohop_fidelity.png", dpi=130))
    # overlap matrices (first seed) at T
    recs = lens_records(store, protocol)
    fig, axes = new_figure((3.0 * len(methods), 3.0), ncols=len(methods))
    axes = np.atleast_1d(axes)
    for ax, m in zip(axes, methods):
        T = f[m]["loops"]
        s = [r for r in recs if r.method == m and r.split == SUMMARY and r.depth == T]
        if not s:
            continue
        mat = s[0].extra["subspace"]["matrix"]
        mat = np.asarray(mat.get(str(T), mat.get(T)))
        im = ax.imshow(mat, vmin=0, vmax=1, cmap="viridis")
        ax.set(title=f"{m} (seed {s[0].seed})", xlabel="step", ylabel="step")
    fig.colorbar(im, ax=list(axes), shrink=0.8, label="top-8 subspace overlap")
    paths.append(save_png(fig, out / "lens_twohop_overlap.png", dpi=130))
    # swap
    fig, ax = new_figure((8, 3.4))
    keys = [("jlens", "band 0.38–0.92, query"), ("jlens@all", "band 0.38–0.92, all pos."),
            ("early:jlens@all", "band 0.1–0.4, all pos."),
            ("early:logit@all", "band 0.1–0.4, all pos., logit dirs")]  # fmt: skip
    w = 0.8 / len(methods)
    for i, m in enumerate(methods):
        xs, succ, ctrl = [], [], []
        for j, (k, _) in enumerate(keys):
            s = f[m]["swap"].get(k)
            xs.append(j + i * w)
            succ.append(100 * s["success"] if s else 0)
            ctrl.append(100 * s["control"] if s else 0)
        ax.bar(xs, succ, w * 0.9, color=f"C{i}", label=m)
        ax.scatter(xs, ctrl, marker="_", color="k", s=60, zorder=3)
    ax.set_xticks([j + 0.4 - w / 2 for j in range(len(keys))], [lab for _, lab in keys],
                  fontsize=7)  # fmt: skip
    ax.set(ylabel="answer → r2(b') (%)", title="bridge swap (bars) vs unrelated-pair control (—)")
    ax.legend(fontsize=7)
    paths.append(save_png(fig, out / "lens_twohop_swap.png", dpi=130))
    return paths


@register_section
class LensSection(ReportSection):
    """The Jacobian-lens criteria table per protocol (the ``lens`` kind's rows)."""

    name = "lens"
    kinds = ("lens",)
    order = 45
    json_keys = ("lens",)

    def write(self, recs: list[EvalRecord]) -> None:
        self.report.md += ["## Jacobian lens on the two-hop task", ""]
        for (proto,), rows in sorted(group_by(recs, ("protocol",)).items()):
            f = findings_from_records(rows, n_boot=self.report.n_boot)
            self.report.md += [f"Protocol `{proto}`:", "", findings_table(f), ""]
            self.report.json["lens"].append({"protocol": proto, "findings": f})
