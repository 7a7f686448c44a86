"""The claims of an experiment grid's ``findings:`` section, validated, and their verdicts
computed from the grid's rows (see :mod:`looplm.experiments.findings`).

Every accuracy is in percent, pooled by answers over the named difficulties (a frontier row holds
``n_correct`` of ``n_examples`` per method, seed, difficulty and T). φ comes from the recurrence
scaling law fitted to the grid's scaling rows (:mod:`looplm.scaling.fit`), its interval a 95%
percentile bootstrap over :data:`PHI_BOOT` resamples of the sweep points (seed 0).
"""

from __future__ import annotations

import json
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from looplm.errors import LoopLMError
from looplm.experiments.findings.tables import PHI_BOOT, check_tables, render_table
from looplm.results.store import EvalRecord
from looplm.results.vocabulary import (
    IN_DIRECTION,
    NOT_REPRODUCED,
    NOT_RUN,
    NOT_TESTABLE,
    REPRODUCED,
    weakest,
)
from looplm.settings.config import CONFIG_DIR

TESTS = ("threshold", "ordering", "climb", "phi_value", "phi_order", "untestable")
METRICS = ("accuracy", "min_accuracy", "stability", "ppl")
SHAPES = ("abrupt_from_chance", "gradual")
CLAIM_KEYS = {"text", "test", "metric", "method", "methods", "also", "than", "difficulties",
              "depth", "from_depth", "op", "value", "better", "shape", "chance", "min_rise",
              "reason", "margin"}  # fmt: skip
OPS = {">": 1, "<": -1, "~": 0}  # ~: a claimed tie, within the minimum effect
EXPERIMENTS = CONFIG_DIR / "experiments"
# What each test needs for each word; printed under a grid's table (the tests it uses).
CRITERIA = {
    "threshold": "per-seed values (method − rival where a rival is named) against the stated "
    "number: **reproduced** when the 95% t-interval of their mean lies on the claimed side, "
    "**reproduced in direction** when only the mean does; a difference or a change (a threshold "
    "at 0, a rival, a from_depth) must also reach the minimum effect, else **not "
    "distinguishable**; ~ claims a tie: **reproduced** when the interval lies within ± the "
    "minimum effect; a method and its rival identical on every seed (both at a floor or a "
    "ceiling) are **not testable at this scale**",
    "ordering": "paired per-seed differences method − rival: **reproduced** when the mean "
    "reaches the minimum effect on the claimed side and the 95% t-interval excludes 0 for every "
    "rival, **reproduced in direction** when only the mean does, **not distinguishable** when "
    "the mean is smaller than the minimum effect, **not testable at this scale** when the two are "
    "identical on every seed (a saturated measure orders nothing)",
    "climb": "every seed's accuracy-vs-T curve at each named difficulty, up to its peak: "
    "*abrupt* when one step between evaluated T carries ≥ 50% of the rise, *from chance* when "
    "it starts within 5 points of chance, and a climb at all only when it rises by at least "
    "min_rise points (default 10); **reproduced** when every curve has the claimed shape, "
    "**reproduced in direction** when every seed-mean curve has it, **not reproduced** otherwise "
    "(fewer than 2 seeds: **not testable at this scale**)",
    "phi_value": "φ's 95% percentile bootstrap interval: **reproduced** when it holds the "
    "paper's value and excludes 0 and 1, **not reproduced** when an end the fit did not pin at "
    "its bound excludes the paper's value, **not testable at this scale** when it holds the value "
    "and 0 or 1 too (the fit cannot tell the value from a recurrence worth nothing or worth a "
    "whole layer) or excludes it only by an end pinned at the bound (an interval of [0, 0] is "
    "an artefact of the bound, not a measurement)",
    "phi_order": "φ's 95% percentile bootstrap intervals of the two methods: **reproduced** "
    "when they are disjoint in the claimed order, **reproduced in direction** when only the "
    "point estimates are in it, **not reproduced** otherwise, **not testable at this scale** when "
    "either interval holds both 0 and 1 (that φ is not placed at all)",
    "untestable": "the grid cannot measure the claim; the reason is stated",
}
FITS_SUFFIX = ".fits.json"  # the φ fits' memo beside a grid's export (docs/data/phi.fits.json)
# a generated block: from a line that opens with its marker to the next end marker
BLOCK = re.compile(
    r"^<!-- generated: findings (\w+)[^\n]*-->\n.*?\n<!-- end generated -->", re.S | re.M
)


def check_claims(raw: Any, where: str) -> list[dict[str, Any]]:
    """A ``findings.claims`` list, validated (one-line errors naming the bad key or value)."""
    from looplm.evaluate.kinds.base import check_keys

    if not isinstance(raw, list) or not raw:
        raise LoopLMError(f"{where} must be a non-empty list of claims")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        c = dict(check_keys(item, CLAIM_KEYS, at))
        test = c.get("test")
        if test not in TESTS:
            raise LoopLMError(f"{at}.test={test!r}; allowed: {', '.join(TESTS)}")
        if not c.get("text"):
            raise LoopLMError(f"{at} needs a text (the claim in the source's words)")
        if test == "untestable":
            if not c.get("reason"):
                raise LoopLMError(f"{at}: an untestable claim needs a reason")
            out.append(c)
            continue
        if not (c.get("method") or c.get("methods")):
            raise LoopLMError(f"{at} needs a method (or methods)")
        if test in ("ordering", "phi_order") and not c.get("than"):
            raise LoopLMError(f"{at}: {test} needs than: [the methods compared with]")
        if test in ("threshold", "ordering"):
            if c.get("metric") not in METRICS:
                raise LoopLMError(f"{at}.metric={c.get('metric')!r}; allowed: {', '.join(METRICS)}")
            if c.get("depth") is None:
                raise LoopLMError(f"{at} needs depth (an int, a list of them, or max)")
            if c["metric"] != "ppl" and not c.get("difficulties"):
                raise LoopLMError(f"{at}: metric {c['metric']} needs difficulties: [lo, hi]")
        if test == "threshold" and (c.get("op") not in OPS or "value" not in c):
            raise LoopLMError(f"{at}: a threshold needs op (one of {', '.join(OPS)}) and value")
        if test == "climb" and (c.get("shape") not in SHAPES or not c.get("difficulties")):
            raise LoopLMError(
                f"{at}: a climb needs difficulties and shape (one of {', '.join(SHAPES)})"
            )
        if test == "phi_value" and "value" not in c:
            raise LoopLMError(f"{at}: phi_value needs value (the paper's φ)")
        if c.get("better", "higher") not in ("lower", "higher"):
            raise LoopLMError(f"{at}.better={c['better']!r}; allowed: lower, higher")
        out.append(c)
    return out


@dataclass
class Verdict:
    """One claim's computed word, its test's criterion, and the evidence per part."""

    word: str
    evidence: list[str] = field(default_factory=list)


@dataclass
class GridFindings:
    """A grid's claims with their verdicts, what they were computed from and on which models."""

    grid: str
    source: str
    data: str  # the file read (its name), or "" when none exists yet
    n_rows: int
    models: dict[str, str]  # method → model description
    verdicts: list[tuple[dict[str, Any], Verdict]]
    tables: list[list[str]] = field(default_factory=list)  # measured tables (Markdown lines)
    missing: str = ""  # where the rows were looked for, when there are none
    unmeasured: list[str] = field(default_factory=list)  # the config's methods with no rows
    # φ fits computed afresh: (the memo file beside the export, its entries) for save_fits()
    fits: tuple[Path, dict[str, Any]] | None = None

    def save_fits(self) -> Path | None:
        """Write the φ fits computed afresh to the memo beside the export (``<grid>.fits.json``),
        so that the next computation from the same rows reads them instead of refitting."""
        if self.fits is None:
            return None
        from looplm.io import atomic_write_text

        path, memo = self.fits
        atomic_write_text(path, json.dumps(memo, indent=1, sort_keys=True) + "\n")
        return path

    def block(self) -> str:
        """The generated Markdown block a page quotes (markers included)."""
        from looplm.results.tables import md_escape

        head = (
            f"<!-- generated: findings {self.grid} (`looplm findings {self.grid} --data "
            "docs/data`; do not edit by hand) -->"
        )
        src = (
            f"Computed from `{self.data}` ({self.n_rows:,} rows)"
            if self.data
            else f"No rows of this grid yet ({self.missing})"
        )
        models = "; ".join(f"`{m}` {d}" for m, d in self.models.items())
        lines = [head, f"{src}. Models: {models}."]
        if self.data and self.unmeasured:
            names = ", ".join(f"`{m}`" for m in self.unmeasured)
            lines[-1] += f" Not measured yet (no rows, so in no table and no verdict): {names}."
        lines.append("")
        for table in self.tables:
            lines += [*table, ""]
        lines += [
            f"| claim of {self.source} | measured (computed from the rows) | verdict |",
            "|---|---|---|",
        ]
        for claim, v in self.verdicts:
            evidence = md_escape("; ".join(v.evidence))
            lines.append(f"| {md_escape(claim['text'])} | {evidence} | **{v.word}** |")
        used = list(dict.fromkeys(c["test"] for c, _ in self.verdicts))
        lines += ["", "Criteria: " + "; ".join(f"*{t}*: {CRITERIA[t]}" for t in used) + "."]
        return "\n".join([*lines, "<!-- end generated -->"])


def findings_grids(folder: str | Path = EXPERIMENTS) -> dict[str, Path]:
    """Every experiment config in ``folder`` with a ``findings:`` section: grid name → path."""
    from looplm.settings import load_yaml

    out = {}
    for p in sorted(Path(folder).glob("*.yaml")):
        raw = load_yaml(p.read_text(encoding="utf-8")) or {}
        if raw.get("findings"):
            out[str(raw.get("name") or p.stem)] = p
    return out


def grid_findings(
    config: str | Path, *, data: str | Path | None = None, memo: bool = True
) -> GridFindings:
    """The verdicts of one grid's claims from its rows: the export of its store in ``data``
    (``docs/data/<grid>.jsonl``) when given, else its results store; no file: not yet run.
    φ fits are read from the memo beside the export (``<grid>.fits.json``) when it holds these
    points (``memo=False``: always refit)."""
    from looplm.experiments.runner import load_experiment
    from looplm.results.export import data_file, load_records
    from looplm.settings import load_yaml

    path = Path(config)
    if not path.is_file():
        grids = findings_grids()
        if str(config) not in grids:
            raise LoopLMError(
                f"grid {str(config)!r}: no such config; grids with findings: {', '.join(grids)}"
            )
        path = grids[str(config)]
    meta = (load_yaml(path.read_text(encoding="utf-8")) or {}).get("findings") or {}
    claims = check_claims(meta.get("claims"), f"{path.name}: findings.claims")
    specs = check_tables(meta.get("tables"), f"{path.name}: findings.tables")
    exp = load_experiment(path)
    file = data_file(data, exp.store) if data is not None else Path(exp.store)
    recs = load_records(file) if file.is_file() else []
    cfgs: dict[str, list[Any]] = {}
    for plan in exp.runs:
        cfgs.setdefault(plan.method, []).append(plan.cfg)
    models = {m: describe_models(cs) for m, cs in cfgs.items()}
    fits = file.parent / f"{file.name.split('.')[0]}{FITS_SUFFIX}"
    known = json.loads(fits.read_text(encoding="utf-8")) if memo and data and fits.is_file() else {}
    rows = _Rows(recs, exp.runs[0].cfg.data.dataset if exp.runs else "", known)
    verdicts = [(c, claim_verdict(c, rows) if recs else _not_run(c)) for c in claims]
    tables = [render_table(t, rows, models) for t in specs] if recs else []
    found = GridFindings(exp.name, str(meta.get("source", "the source")),
                         file.name if recs else "", len(recs), models, verdicts, tables)  # fmt: skip
    measured = {r.method for r in recs}
    found.unmeasured = [m for m in cfgs if m not in measured]
    if not recs:
        found.missing = (
            f"no `{file.name}` committed in the data folder"
            if data is not None
            else f"no results store `{file}`: run `looplm sweep {path.stem}`"
        )
    if rows.memo_new:
        found.fits = (fits, rows.memo)
    return found


def describe_models(cfgs: Sequence[Any]) -> str:
    """What one method's rows were measured on: tokenizer, width, parameters, steps and tokens
    seen (a corpus) or rows per step (a generated task): ``bytes d64 86.4k params, 500 steps of
    32 graph_nodes rows``; a method trained in several variants gets the ranges (``36 models:
    bytes d32–64, 20.1k–125k params, 100–900 steps, 205k–1.84M tokens``)."""
    from looplm.data import CORPORA
    from looplm.experiments.paper.report import count_text, model_facts

    facts = {(*model_facts(cfg), cfg.train.batch_size, cfg.data.dataset) for cfg in cfgs}
    tok, _, _, _, _, batch, dataset = min(facts)

    def span(i: int, fmt: Any = str) -> str:
        lo, hi = min(f[i] for f in facts), max(f[i] for f in facts)
        return fmt(lo) if lo == hi else f"{fmt(lo)}–{fmt(hi)}"

    seen = f"{span(4, count_text)} tokens" if dataset in CORPORA else f"of {batch} {dataset} rows"
    sep = ", " if dataset in CORPORA else " "
    text = f"{tok} d{span(1)} {span(2, count_text)} params, {span(3)} steps{sep}{seen}"
    return text if len(facts) == 1 else f"{len(facts)} models: {text}"


def refresh_blocks(text: str, blocks: dict[str, str]) -> str:
    """``text`` with each ``<!-- generated: findings GRID -->`` block replaced by ``blocks[GRID]``
    (blocks of other grids are left as they are)."""
    return BLOCK.sub(lambda m: blocks.get(m.group(1), m.group(0)), text)


def _not_run(claim: dict[str, Any]) -> Verdict:
    if claim["test"] == "untestable":
        return Verdict(NOT_TESTABLE, [claim["reason"]])
    return Verdict(NOT_RUN, ["no rows"])


class _Rows:
    """A grid's rows, indexed for the claims: frontier accuracy counts and scaling points."""

    def __init__(
        self, records: Sequence[EvalRecord], dataset: str = "", memo: dict | None = None
    ) -> None:
        from looplm.frontier.section import frontier_records
        from looplm.results.sections import difficulty_of
        from looplm.scaling.fit import is_scaling_record

        self.counts: dict[str, dict[tuple[int, int, int], tuple[int, int]]] = {}
        for r in frontier_records(records):
            key = (r.seed, difficulty_of(r), r.depth)
            self.counts.setdefault(r.method, {})[key] = (
                r.extra["n_correct"],
                r.extra["n_examples"],
            )
        self.scaling: dict[str, list[EvalRecord]] = {}
        self._phi: dict[str, tuple[float, float, float] | None] = {}
        self.memo = dict(memo or {})  # points key → a φ fit computed before (FITS_SUFFIX)
        self.memo_new = False
        self.ppl: dict[str, dict[tuple[int, int], float]] = {}
        for r in records:
            if is_scaling_record(r):
                self.scaling.setdefault(r.method, []).append(r)
            elif (difficulty_of(r) is None and not r.adaptive_mode and r.dataset == dataset
                  and r.n_tokens > 0 and not r.eval_tag.startswith("diagnostics")):  # fmt: skip
                self.ppl.setdefault(r.method, {})[(r.seed, r.depth)] = r.ppl

    def depth(self, method: str, depth: Any) -> int:
        """``depth`` as a T of ``method`` (``max``: its deepest evaluated T)."""
        if depth == "max":
            return max((k[2] for k in self.counts.get(method, {})), default=0)
        return int(depth)

    def accuracy(self, method: str, diffs: Sequence[int], depth: Any, *, lowest: bool = False):
        """seed → accuracy (%) pooled over difficulties ``diffs[0]..diffs[1]`` at ``depth``
        (``lowest``: the lowest difficulty's accuracy instead of the pooled one)."""
        lo, hi = int(diffs[0]), int(diffs[-1])
        T = self.depth(method, depth)
        per: dict[int, list[tuple[int, int]]] = {}
        for (seed, d, t), c in self.counts.get(method, {}).items():
            if t == T and lo <= d <= hi:
                per.setdefault(seed, []).append(c)
        full = max((len(v) for v in per.values()), default=0)
        per = {s: v for s, v in per.items() if len(v) == full}  # a seed missing a difficulty: out
        if lowest:
            return {s: 100.0 * min(c / max(n, 1) for c, n in v) for s, v in sorted(per.items())}
        return {s: 100.0 * sum(c for c, _ in v) / max(sum(n for _, n in v), 1)
                for s, v in sorted(per.items())}  # fmt: skip

    def ppl_at(self, method: str, depth: Any) -> dict[int, float]:
        """seed → fixed-depth PPL of ``method`` at ``depth`` on the grid's corpus."""
        T = self.depth(method, depth)
        return {s: v for (s, t), v in sorted(self.ppl.get(method, {}).items()) if t == T}

    def curves(self, method: str, diffs: Sequence[int]) -> dict[tuple[int, int], dict[int, float]]:
        """(seed, difficulty) → {T: accuracy as a fraction} over the named difficulties."""
        lo, hi = int(diffs[0]), int(diffs[-1])
        out: dict[tuple[int, int], dict[int, float]] = {}
        for (seed, d, t), (c, n) in sorted(self.counts.get(method, {}).items()):
            if lo <= d <= hi:
                out.setdefault((seed, d), {})[t] = c / max(n, 1)
        return out

    def phi(self, method: str) -> tuple[float, float, float] | None:
        """(φ, 95% low, 95% high) of ``method``'s scaling rows; None without any."""
        from looplm.scaling.fit import bootstrap_records, fit_records

        if method not in self._phi:
            grp = self.scaling.get(method)
            got = None
            if grp:
                key = _points_key(grp)
                hit = self.memo.get(key)
                if hit is None:
                    fit = fit_records(grp)
                    ci = bootstrap_records(grp, fit=fit, n_boot=PHI_BOOT, seed=0)
                    hit = {"method": method, "points": len(grp), "phi": fit.phi,
                           "low": ci.low, "high": ci.high, "n_boot": PHI_BOOT, "seed": 0}  # fmt: skip
                    self.memo[key] = hit
                    self.memo_new = True
                got = (float(hit["phi"]), float(hit["low"]), float(hit["high"]))
            self._phi[method] = got
        return self._phi[method]


def _points_key(records: Sequence[EvalRecord]) -> str:
    """A fit's identity: the sha256 of its points (exact floats, sorted) and the bootstrap's
    settings. Refitting the same points gives the same φ, so a memo entry under this key can
    stand for the fit (a changed row changes the key)."""
    import hashlib

    from looplm.scaling.fit import scaling_points

    pts = scaling_points(records)
    rows = sorted(zip(*(pts[k].tolist() for k in ("r", "n_once", "n_rec", "d", "loss"))))
    text = json.dumps({"points": rows, "n_boot": PHI_BOOT, "seed": 0}, sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()


def _metric(rows: _Rows, claim: dict[str, Any], method: str) -> dict[int, float]:
    diffs, depth, metric = claim.get("difficulties"), claim["depth"], claim["metric"]
    if metric == "ppl":  # fixed-depth perplexity on the grid's corpus
        return rows.ppl_at(method, depth)
    if metric == "stability":  # accuracy at depth − accuracy at from_depth, per seed
        at = rows.accuracy(method, diffs, depth)
        ref = rows.accuracy(method, diffs, claim.get("from_depth", 1))
        return {s: at[s] - ref[s] for s in sorted(set(at) & set(ref))}
    return rows.accuracy(method, diffs, depth, lowest=metric == "min_accuracy")


def _label(rows: _Rows, claim: dict[str, Any], method: str) -> str:
    if claim["metric"] == "ppl":
        return f"{method} PPL at T={rows.depth(method, claim['depth'])}"
    lo, hi = claim["difficulties"][0], claim["difficulties"][-1]
    span = f"d={lo}" if lo == hi else f"d={lo}–{hi}"
    T = rows.depth(method, claim["depth"])
    what = {"accuracy": "", "min_accuracy": "lowest of ", "stability": ""}[claim["metric"]]
    if claim["metric"] == "stability":
        return f"{method} {span}, T={T} − T={claim.get('from_depth', 1)}"
    return f"{method} {what}{span} at T={T}"


def claim_verdict(claim: dict[str, Any], rows: _Rows) -> Verdict:
    """The verdict of one validated claim from a grid's indexed rows. The methods under ``also``
    are measured the same way and shown beside it, each with its own word, outside the verdict
    (the claim is about its ``method``; the others are context)."""
    verdict = _verdict_of(claim, rows)
    beside = []
    for other in claim.get("also") or []:
        v = _verdict_of({**claim, "methods": [other]}, rows)
        beside += [f"{e}, alone: {v.word}" for e in v.evidence]
    if beside:
        verdict.evidence.append("outside the verdict: " + "; ".join(beside))
    return verdict


def _verdict_of(claim: dict[str, Any], rows: _Rows) -> Verdict:
    from looplm.results.vocabulary import claim_margin, judge

    test = claim["test"]
    if test == "untestable":
        return Verdict(NOT_TESTABLE, [claim["reason"]])
    if test == "climb":
        return _climb(claim, rows)
    if test in ("phi_value", "phi_order"):
        return _phi(claim, rows)
    better = claim.get("better", "lower" if claim["metric"] == "ppl" else "higher")
    sign = OPS.get(claim.get("op"), 1 if better == "higher" else -1)
    unit = {"ppl": "", "stability": " points"}.get(claim["metric"], "%")
    parts: list[tuple[str, str]] = []
    depths = claim["depth"] if isinstance(claim["depth"], list) else [claim["depth"]]
    methods = claim.get("methods") or [claim["method"]]
    for method, depth in ((m, d) for m in methods for d in depths):
        point = {**claim, "depth": depth}
        got = _metric(rows, point, method)
        rivals = claim.get("than") or []
        if test == "threshold" and not rivals:
            target = float(claim["value"])
            level = float(np.mean(list(got.values()))) if got else None
            margin = claim_margin(claim, level, target)
            word, text = judge([v - target for v in got.values()], sign, margin)
            mean = f"{np.mean(list(got.values())):.1f}{unit}" if got else "no rows"
            need = f"needs {claim['op']} {_num(target)}; margin {text}"
            parts.append((word, f"{_label(rows, point, method)}: {mean} ({need})"))
            continue
        for rival in rivals:
            theirs = _metric(rows, point, rival)
            deltas = [got[s] - theirs[s] for s in sorted(set(got) & set(theirs))]
            vs = f"{_label(rows, point, method)} − {_label(rows, point, rival)}"
            target = float(claim["value"]) if test == "threshold" else 0.0
            level = float(np.mean(list(theirs.values()))) if theirs else None
            margin = claim_margin(claim, level, target)
            word, text = judge([d - target for d in deltas], sign, margin)
            if len(deltas) > 1 and all(d == 0 for d in deltas):
                # one value on every seed (a floor or a ceiling): nothing to order, no margin
                word, text = NOT_TESTABLE, text + ", identical on every seed"
            if test == "ordering":
                parts.append((word, f"{vs}: {text}"))
                continue
            mean = f"{np.mean(deltas):+.1f}{unit}" if deltas else "no rows"
            need = f"needs {claim['op']} {_num(target)}; margin {text}"
            parts.append((word, f"{vs}: {mean} ({need})"))
    return Verdict(weakest([w for w, _ in parts]), [t for _, t in parts])


def _num(x: float) -> str:
    return f"{x:g}".replace("-", "−")


def _climb(claim: dict[str, Any], rows: _Rows) -> Verdict:
    from looplm.frontier.section import climb_shape

    chance = float(claim.get("chance", 0.5))
    min_rise = float(claim.get("min_rise", 10)) / 100.0
    want = claim["shape"]

    def shape(curve: dict[int, float]) -> tuple[bool, str]:
        T = sorted(curve)
        s = climb_shape(T, [curve[t] for t in T], chance)
        if s["rise"] < min_rise or not math.isfinite(s["max_step_share"]):
            return False, f"no climb (rise {100 * s['rise']:.0f} points)"
        kind = "abrupt" if s["abrupt"] else "gradual"
        start = "from chance" if s["from_chance"] else f"from {100 * s['start']:.0f}%"
        ok = (s["abrupt"] and s["from_chance"]) if want == "abrupt_from_chance" else not s["abrupt"]
        return ok, f"{kind} {100 * s['max_step_share']:.0f}% {start}"

    words, evidence = [], []
    for method in claim.get("methods") or [claim["method"]]:
        curves = rows.curves(method, claim["difficulties"])
        if not curves:
            words.append(NOT_RUN)
            evidence.append(f"{method}: no rows")
            continue
        if len({seed for seed, _ in curves}) < 2:
            words.append(NOT_TESTABLE)
            evidence.append(f"{method}: 1 seed (a shape needs at least 2 seeds)")
            continue
        hits = sum(shape(c)[0] for c in curves.values())
        means = {}
        for d in sorted({d for _, d in curves}):
            per = [c for (s, dd), c in curves.items() if dd == d]
            T = sorted(set.intersection(*(set(c) for c in per)))
            means[d] = shape({t: float(np.mean([c[t] for c in per])) for t in T})
        if hits == len(curves):
            words.append(REPRODUCED)
        elif all(ok for ok, _ in means.values()):
            words.append(IN_DIRECTION)
        else:
            words.append(NOT_REPRODUCED)
        seed_mean = ", ".join(f"d={d} {txt}" for d, (_, txt) in means.items())
        evidence.append(
            f"{method}: {hits}/{len(curves)} seed curves {want.replace('_', ' ')}; "
            f"seed-mean curves: {seed_mean}"
        )
    return Verdict(weakest(words), evidence)


BOUND_TOL = 1e-6  # φ at the fit's bound 0 comes back as ~1e-20, not 0


def _spans_0_and_1(v: tuple[float, float, float]) -> bool:
    """An interval that holds both 0 and 1: the fit cannot place this φ at all. (One pinned at a
    bound still orders: [0, 0] says at most 0, below an interval placed above 0.)"""
    return v[1] <= BOUND_TOL and v[2] >= 1.0 - BOUND_TOL


def _phi(claim: dict[str, Any], rows: _Rows) -> Verdict:
    def text(m: str, v: tuple[float, float, float]) -> str:
        return f"{m} φ = {v[0]:.2f} [{v[1]:.2f}, {v[2]:.2f}]"

    method = (claim.get("methods") or [claim["method"]])[0]
    mine = rows.phi(method)
    if mine is None:
        return Verdict(NOT_RUN, [f"{method}: no scaling rows"])
    if claim["test"] == "phi_value":
        want = float(claim["value"])
        lo, hi = mine[1], mine[2]
        if want > hi + BOUND_TOL:  # excluded from above: only by an end the fit chose freely
            word = NOT_TESTABLE if hi <= BOUND_TOL else NOT_REPRODUCED
        elif want < lo - BOUND_TOL:
            word = NOT_TESTABLE if lo >= 1.0 - BOUND_TOL else NOT_REPRODUCED
        elif lo <= BOUND_TOL or hi >= 1.0 - BOUND_TOL:
            word = NOT_TESTABLE
        else:
            word = REPRODUCED
        return Verdict(word, [f"{text(method, mine)} (95% bootstrap) vs the paper's {want:g}"])
    words, evidence = [], []
    higher = claim.get("better", "higher") == "higher"
    for rival in claim["than"]:
        theirs = rows.phi(rival)
        if theirs is None:
            words.append(NOT_RUN)
            evidence.append(f"{rival}: no scaling rows")
            continue
        a, b = (mine, theirs) if higher else (theirs, mine)  # the claim: a above b
        if _spans_0_and_1(mine) or _spans_0_and_1(theirs):
            words.append(NOT_TESTABLE)
        elif a[1] > b[2] + BOUND_TOL:
            words.append(REPRODUCED)
        elif a[0] > b[0]:
            words.append(IN_DIRECTION)
        else:
            words.append(NOT_REPRODUCED)
        evidence.append(f"{text(method, mine)} vs {text(rival, theirs)} (95% bootstrap)")
    return Verdict(weakest(words), evidence)
