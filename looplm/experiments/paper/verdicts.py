"""Verdicts computed from the stored rows: one vocabulary, each word with the criterion it needs.

A catalogue entry states its claims as data under ``paper.claims`` (see :mod:`looplm.experiments.paper`)::

    claims:
      - text: SCSE improves on the looped baseline at every depth.
        test: ordering          # ordering | threshold | construction | untestable
        method: scse
        than: [looped]          # ordering: every method it must beat
        depths: [8, 24, 48]     # the points the claim names (or budgets: / steps:)
        scale: 50m              # a tier of TIERS (default: the 22M tier)
        metric: ppl             # a per-seed metric (default ppl); better: lower (default) | higher

and :func:`claim_verdict` turns the entry's results store into one word of :data:`VERDICTS`.
Prose may explain a verdict, never upgrade it: the docs' verdict words are checked against these.
A prose row names the claims it speaks for in an HTML comment (invisible when rendered), with the
claim's text exactly as in the YAML (``|`` written ``\\|`` inside a table), all on one line::

    | Table 2 | the learned anchor ... | **not reproduced**: ... <!-- claim table02: the
    learned anchor has the lowest PPL: embedding and frozen-random anchors are higher at every
    depth --> |

and :func:`prose_links` reads them back (the tests compare the row's word with the computed one).

The tests, per named point (a depth, budget or step) and, for an ordering, per rival method:

* ``ordering`` — the paired per-seed differences ``method − rival`` (matched by seed); the point
  passes when the mean has the claimed sign by at least the minimum effect and the 95%
  t-interval (n − 1 degrees of freedom) excludes 0, leans when the mean alone does, is not
  distinguishable when the mean is smaller than the minimum effect, fails otherwise (``op: "~"``:
  a claimed tie, passing when the interval lies within ± the minimum effect).
* ``threshold`` — the per-seed values against a stated number (``op`` ``>``, ``<`` or ``~``,
  ``value``): passes when the whole 95% t-interval of the mean lies on the claimed side, leans
  when the mean does, fails otherwise. A threshold at 0 or on a change (``from_depth`` /
  ``from_step``) is a difference and needs the minimum effect too.

Every word comes from :func:`looplm.results.vocabulary.decide` under its one margin policy
(:data:`~looplm.results.vocabulary.MARGIN_POLICY`; a claim may state its own ``margin``).
* ``construction`` — a quantity the method's equations fix (e.g. SCSE's ``R_t = 0``): it must
  equal ``equals`` exactly in every seed. That is a check of the implementation, not a
  reproduction, so the best it can earn is "holds by construction" (a miss is "not reproduced":
  the implementation is wrong).
* ``untestable`` — the claim cannot be measured by this grid (``reason`` says why).
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from typing import Any

from looplm.errors import LoopLMError
from looplm.experiments.paper.metrics import seed_values
from looplm.results.vocabulary import (  # noqa: F401  (the vocabulary, re-exported)
    BY_CONSTRUCTION,
    IN_DIRECTION,
    NOT_DISTINGUISHABLE,
    NOT_REPRODUCED,
    NOT_RUN,
    NOT_TESTABLE,
    ORDER,
    REPRODUCED,
    VERDICTS,
    claim_margin,
    judge,
    weakest,
)

_ORDER = ORDER
TESTS = ("ordering", "threshold", "construction", "untestable")
CLAIM_KEYS = {"text", "test", "method", "methods", "than", "depths", "budgets", "steps",
              "thresholds", "from_depth", "from_step", "scale", "metric", "better", "op", "value",
              "equals", "dataset", "reason", "margin"}  # fmt: skip
# Diagnostics summaries measured once per checkpoint (a claim on them names no point).
SUMMARY_METRICS = {"bias_max", "raw_bias_max", "median_convergence_loop", "still_updating_at_8",
                   "ray_cosine_min", "ray_cosine_max", "dose_fraction_rms", "dose_fraction_min",
                   "dose_fraction_max"}  # fmt: skip
OPS = {">": 1, ">=": 1, "<": -1, "<=": -1, "~": 0}  # ~: a claimed tie (within the margin)


@dataclass
class Verdict:
    """The computed verdict of one claim: its word, the criterion, and the evidence per part."""

    word: str
    criterion: str
    evidence: list[str] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {"verdict": self.word, "criterion": self.criterion, "evidence": self.evidence}


def check_claim(raw: Any, where: str) -> dict[str, Any]:
    """A ``paper.claims`` item, validated (one-line errors naming the key)."""
    from looplm.evaluate.kinds.base import check_keys
    from looplm.experiments.paper.metrics import TIER_NAMES

    claim = dict(check_keys(raw, CLAIM_KEYS, where))
    test = claim.get("test")
    if test not in TESTS:
        raise LoopLMError(f"{where}.test={test!r}; allowed: {', '.join(TESTS)}")
    if not claim.get("text"):
        raise LoopLMError(f"{where} needs a text (the claim in the paper's words)")
    if claim.get("scale") not in TIER_NAMES:
        allowed = ", ".join(str(k) for k in TIER_NAMES if k)
        raise LoopLMError(f"{where}.scale={claim.get('scale')!r}; allowed: {allowed}")
    if test == "untestable":
        if not claim.get("reason"):
            raise LoopLMError(f"{where}: an untestable claim needs a reason")
        return claim
    if not (claim.get("method") or claim.get("methods")):
        raise LoopLMError(f"{where} needs a method")
    named = any(claim.get(k) for k in ("depths", "budgets", "steps", "thresholds"))
    if not named and claim.get("metric") not in SUMMARY_METRICS:
        raise LoopLMError(
            f"{where} needs the points it names: depths, budgets, steps or thresholds"
        )
    if test == "ordering" and not claim.get("than"):
        raise LoopLMError(f"{where}: an ordering needs than: [the methods it must beat]")
    if claim.get("better", "lower") not in ("lower", "higher"):
        raise LoopLMError(f"{where}.better={claim['better']!r}; allowed: lower, higher")
    if test == "ordering" and claim.get("op") not in (None, "~"):
        raise LoopLMError(f"{where}.op={claim['op']!r}; an ordering allows only ~ (a claimed tie)")
    if test == "threshold" and (claim.get("op") not in OPS or "value" not in claim):
        raise LoopLMError(f"{where}: a threshold needs op (one of {', '.join(OPS)}) and value")
    if test == "construction" and "equals" not in claim:
        raise LoopLMError(f"{where}: a construction check needs equals (the value it must have)")
    return claim


def _points(claim: dict[str, Any]) -> list[dict[str, Any]]:
    """The named points as selectors of :func:`seed_values`."""
    metric = claim.get("metric", "ppl")
    base = {"metric": metric, "scale": claim.get("scale"), "dataset": claim.get("dataset")}
    if claim.get("budgets"):
        return [{**base, "budget": int(b)} for b in claim["budgets"]]
    if claim.get("steps"):
        return [{**base, "step": int(s)} for s in claim["steps"]]
    if claim.get("thresholds"):
        return [{**base, "threshold": float(t)} for t in claim["thresholds"]]
    if claim.get("depths"):
        return [{**base, "depth": int(d)} for d in claim["depths"]]
    return [base]


def _where(point: dict[str, Any]) -> str:
    for key, fmt in (("depth", "T={}"), ("budget", "budget {}"), ("step", "t={}"),
                     ("threshold", "threshold {:g}")):  # fmt: skip
        if point.get(key) is not None:
            return fmt.format(point[key])
    return ""


def _values(m: Any, method: str, point: dict[str, Any], claim: dict[str, Any]) -> dict[int, float]:
    """Per-seed values at ``point``; with ``from_depth`` / ``from_step`` the change from that
    point (``v(point) − v(from)``, matched by seed)."""
    got = seed_values(m, method, point)
    for key, field_ in (("from_depth", "depth"), ("from_step", "step")):
        if claim.get(key) is not None:
            ref = seed_values(m, method, {**point, field_: int(claim[key])})
            got = {s: got[s] - ref[s] for s in sorted(set(got) & set(ref))}
    return got


def _level(m: Any, method: str, point: dict[str, Any], claim: dict[str, Any]) -> float | None:
    """The level a relative minimum effect is taken of: the mean at the point a change is
    measured from, else at the point itself."""
    for key, field_ in (("from_depth", "depth"), ("from_step", "step")):
        if claim.get(key) is not None:
            point = {**point, field_: int(claim[key])}
    got = seed_values(m, method, point)
    return sum(got.values()) / len(got) if got else None


def _combine(words: list[str]) -> str:
    return weakest(words)


def claim_verdict(claim: dict[str, Any], m: Any) -> Verdict:
    """The verdict of one validated claim from an entry's measured rows ``m``."""
    test = claim["test"]
    if test == "untestable":
        return Verdict(NOT_TESTABLE, VERDICTS[NOT_TESTABLE], [claim["reason"]])
    methods = claim.get("methods") or [claim["method"]]
    parts: list[tuple[str, str]] = []
    for point in _points(claim):
        for method in methods:
            got = _values(m, method, point, claim)
            if test == "construction":
                want = float(claim["equals"])
                for rival in claim.get("than") or []:  # a fixed difference method − rival
                    theirs = _values(m, rival, point, claim)
                    got = {s: got[s] - theirs[s] for s in sorted(set(got) & set(theirs))}
                if not got:
                    parts.append((NOT_RUN, f"{method} {_where(point)}: no rows"))
                    continue
                bad = {s: v for s, v in got.items() if not (v == want)}
                word = NOT_REPRODUCED if bad else BY_CONSTRUCTION
                vals = ", ".join(f"{v:.3g}" for v in got.values())
                vs = "".join(f" − {r}" for r in claim.get("than") or [])
                parts.append((word, f"{method}{vs} {_where(point)}: {vals} ({len(got)} seeds)"))
            elif test == "threshold":
                sign = OPS[claim["op"]]
                target = float(claim["value"])
                margin = claim_margin(claim, _level(m, method, point, claim), target)
                word, text = judge([v - target for v in got.values()], sign, margin)
                parts.append((word, f"{method} {_where(point)} − {target:g}: {text}"))
            else:  # ordering: method − rival, paired by seed
                sign = -1 if claim.get("better", "lower") == "lower" else 1
                sign = OPS[claim["op"]] if claim.get("op") else sign
                for rival in claim["than"]:
                    theirs = _values(m, rival, point, claim)
                    deltas = [got[s] - theirs[s] for s in sorted(set(got) & set(theirs))]
                    margin = claim_margin(claim, _level(m, rival, point, claim))
                    word, text = judge(deltas, sign, margin)
                    parts.append((word, f"{method} − {rival} {_where(point)}: {text}"))
    word = _combine([w for w, _ in parts])
    return Verdict(word, VERDICTS[word], [t for _, t in parts])


def verdict_table(claims: list[dict[str, Any]], m: Any) -> list[str]:
    """Markdown rows ``| claim | verdict | evidence |`` of an entry's claims."""
    rows = ["| claim | computed verdict | evidence |", "|---|---|---|"]
    for c in claims:
        v = claim_verdict(c, m)
        evidence = "; ".join(v.evidence).replace("|", "\\|")
        text = c["text"].replace("|", "\\|")
        rows.append(f"| {text} | **{v.word}** | {evidence} |")
    return rows


LINK = re.compile(r"<!-- claim (\w+): (.+?) -->")
_CELLS = re.compile(r"(?<!\\)\|")


@dataclass
class ProseLink:
    """One claim a prose table row speaks for: the entry, the claim's text, the row's verdict
    word (the bold word its last cell opens with; None when it has none) and the line number."""

    entry: str
    text: str
    word: str | None
    line: int


def prose_links(markdown: str) -> list[ProseLink]:
    """Every ``<!-- claim ENTRY: TEXT -->`` link of a page's table rows (the word: the bold word
    the last cell opens with) and list items (a line opening with ``- ``; the word: the first
    bold vocabulary word of the item's line)."""
    out = []
    for i, line in enumerate(markdown.splitlines(), 1):
        links = LINK.findall(line)
        if not links:
            continue
        if line.startswith("|"):
            cells = [c.strip() for c in _CELLS.split(line.strip())[1:-1]]
            m = re.match(r"\*\*(.+?)\*\*", cells[-1]) if cells else None
            word = m.group(1) if m and m.group(1) in VERDICTS else None
        elif line.lstrip().startswith("- "):
            bold = [b for b in re.findall(r"\*\*(.+?)\*\*", line) if b in VERDICTS]
            word = bold[0] if bold else None
        else:
            continue
        out += [ProseLink(e, t.replace("\\|", "|").strip(), word, i) for e, t in links]
    return out


def prose_disagreements(markdown: str, computed: dict[tuple[str, str], str]) -> list[str]:
    """Where a page's linked rows disagree with the computed verdicts: one line per linked claim
    that ``computed`` (``(entry, claim text) → word``) holds and whose row carries another word
    (or none). Links to claims missing from ``computed`` are left to the caller."""
    out = []
    for link in prose_links(markdown):
        want = computed.get((link.entry, link.text))
        if want is not None and link.word != want:
            got = f"**{link.word}**" if link.word else "no verdict word"
            out.append(f"line {link.line}: {link.entry} {link.text!r}: {got}, computed **{want}**")
    return out
