"""The measured tables a grid's findings block shows above its claims (``findings.tables``):

* ``accuracy`` — frontier accuracy (%) per method and column, each column a difficulty range
  pooled by answers at one T (``{difficulties: [4, 8], depth: max}``);
* ``ppl`` — fixed-depth PPL per method at each of ``depths``, and the paired difference
  ``reference − method`` (positive: the method is better);
* ``phi`` — φ per method with its 95% percentile bootstrap interval.

Every row names its model; every ± names its kind in the table's caption.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from looplm.errors import LoopLMError

KINDS = ("accuracy", "ppl", "phi")
PHI_BOOT = 200  # bootstrap resamples of φ's interval (the report's number)
TABLE_KEYS = {"kind", "columns", "depths", "reference", "methods"}


def check_tables(raw: Any, where: str) -> list[dict[str, Any]]:
    """A ``findings.tables`` list, validated (one-line errors)."""
    from looplm.evaluate.kinds.base import check_keys

    if raw is None:
        return []
    if not isinstance(raw, list):
        raise LoopLMError(f"{where} must be a list of tables")
    out = []
    for i, item in enumerate(raw):
        at = f"{where}[{i}]"
        t = dict(check_keys(item, TABLE_KEYS, at))
        if t.get("kind") not in KINDS:
            raise LoopLMError(f"{at}.kind={t.get('kind')!r}; allowed: {', '.join(KINDS)}")
        if t["kind"] == "accuracy" and not t.get("columns"):
            raise LoopLMError(f"{at}: an accuracy table needs columns: [{{difficulties, depth}}]")
        if t["kind"] == "ppl" and not (t.get("depths") and t.get("reference")):
            raise LoopLMError(f"{at}: a ppl table needs depths and reference")
        out.append(t)
    return out


def _spread(values: list[float], fmt: str = ".1f") -> str:
    if not values:
        return "–"
    sd = np.std(values, ddof=1) if len(values) > 1 else math.nan
    text = f"{np.mean(values):{fmt}}"
    return text + (f" ± {sd:{fmt}}" if math.isfinite(sd) else "") + f" ({len(values)})"


def render_table(spec: dict[str, Any], rows: Any, models: dict[str, str]) -> list[str]:
    """Markdown lines of one table from a grid's indexed rows (:class:`~looplm.experiments.findings.claims._Rows`)."""
    methods = spec.get("methods") or list(models)
    if spec["kind"] == "accuracy":
        return _accuracy(spec, rows, models, methods)
    if spec["kind"] == "ppl":
        return _ppl(spec, rows, models, methods)
    return _phi(rows, models, methods)


def _accuracy(spec, rows, models, methods) -> list[str]:
    cols = spec["columns"]

    def head(c: dict[str, Any]) -> str:
        lo, hi = c["difficulties"][0], c["difficulties"][-1]
        span = f"d={lo}" if lo == hi else f"d={lo}–{hi}"
        Ts = {rows.depth(m, c["depth"]) for m in methods} - {0}
        return f"{span}, T={Ts.pop() if len(Ts) == 1 else c['depth']}"

    lines = [
        "Accuracy (%), pooled by answers over each column's difficulties at its T (max: each "
        "method's deepest evaluated T); mean ± s.d. over seeds (number of seeds):",
        "",
        "| method | model | " + " | ".join(head(c) for c in cols) + " |",
        "|---|---|" + "---:|" * len(cols),
    ]
    for m in methods:
        cells = [_spread(list(rows.accuracy(m, c["difficulties"], c["depth"]).values()))
                 for c in cols]  # fmt: skip
        if any(c != "–" for c in cells):
            lines.append(f"| `{m}` | {models.get(m, '–')} | " + " | ".join(cells) + " |")
    return lines


def _ppl(spec, rows, models, methods) -> list[str]:
    from looplm.results.stats import t_halfwidth

    depths, ref = list(spec["depths"]), spec["reference"]
    lines = [
        f"Fixed-depth PPL, mean ± s.d. over seeds (number of seeds); Δ = `{ref}` − method, "
        "paired by seed, mean ± 95% t half-width (positive: the method is better):",
        "",
        "| method | model | "
        + " | ".join(f"T = {d}" for d in depths)
        + " | "
        + " | ".join(f"Δ T = {d}" for d in depths)
        + " |",
        "|---|---|" + "---:|" * (2 * len(depths)),
    ]
    for m in methods:
        got = {d: rows.ppl_at(m, d) for d in depths}
        if not any(got.values()):
            continue
        cells = [_spread(list(got[d].values())) for d in depths]
        for d in depths:
            base = rows.ppl_at(ref, d)
            deltas = [base[s] - got[d][s] for s in sorted(set(base) & set(got[d]))]
            if m == ref or not deltas:
                cells.append("–")
                continue
            hw = t_halfwidth(deltas) if len(deltas) > 1 else math.nan
            tail = f" ± {hw:.1f}" if math.isfinite(hw) else ""
            cells.append(f"{np.mean(deltas):+.1f}{tail}")
        lines.append(f"| `{m}` | {models.get(m, '–')} | " + " | ".join(cells) + " |")
    return lines


def _phi(rows, models, methods) -> list[str]:
    lines = [
        f"φ of the law fitted to each method's points, with its 95% percentile bootstrap "
        f"interval ({PHI_BOOT} resamples of the points, seed 0):",
        "",
        "| method | model | points | φ | 95% bootstrap interval |",
        "|---|---|---:|---:|---|",
    ]
    for m in methods:
        got = rows.phi(m)
        if got is None:
            continue
        n = len(rows.scaling.get(m, []))
        lines.append(
            f"| `{m}` | {models.get(m, '–')} | {n} | {got[0]:.2f} | [{got[1]:.2f}, {got[2]:.2f}] |"
        )
    return lines
