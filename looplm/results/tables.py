"""Formatting shared by the report and the supplement: numbers, markdown tables, row order.

Rows are (method, model_hash); when a method has several model hashes in one table the row label
carries the short hash. Methods named ``unshared*`` are absolute references: they sort last and
are not bolded (as in the paper), unless they are the only rows.
"""

from __future__ import annotations

import math
import re
from collections.abc import Hashable, Sequence
from typing import Any

import numpy as np

from looplm.results.stats import Summary
from looplm.results.store import EvalRecord

REFERENCE_PREFIX = "unshared"  # method labels of the absolute (unshared-depth) references


ROW_CONTEXT = ("protocol", "dataset", "split", "eval_tag")  # what the rows of one table share


def decimals(x: float) -> int:
    if not math.isfinite(x) or x == 0:
        return 2
    return int(min(3, max(1, 3 - math.floor(math.log10(abs(x))))))


def table_decimals(values: Sequence[float]) -> int:
    """Decimals for a whole table: 1 for values in the hundreds (as the paper), more when small."""
    vals = [abs(v) for v in values if v is not None and math.isfinite(v) and v != 0]
    if not vals:
        return 2
    return int(min(3, max(1, 2 - math.floor(math.log10(float(np.median(vals)))))))


def fmt_num(x: float, decimals: int | None = None) -> str:
    """A number with ~4 significant digits (1–3 decimals); a real minus sign; 'n/a' for NaN."""
    if x is None or not math.isfinite(x):
        return "n/a"
    d = decimals(x) if decimals is None else decimals
    return f"{x:.{d}f}".replace("-", "−")


def fmt_mean_std(mean: float, std: float, decimals: int | None = None) -> str:
    """``mean ± std`` (std omitted when undefined, e.g. one seed)."""
    d = decimals(mean) if decimals is None else decimals
    if std is None or not math.isfinite(std):
        return fmt_num(mean, d)
    return f"{fmt_num(mean, d)} ± {fmt_num(std, d)}"


def md_escape(text: str) -> str:
    return str(text).replace("|", "\\|")


def slug(parts: Sequence[Any]) -> str:
    """File-name-safe text from the non-empty parts, joined by ``_``."""
    text = "_".join(str(p) for p in parts if p not in ("", None))
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "all"


def finite_or_none(obj: Any) -> Any:
    """Recursively replace NaN/inf by None so results.json is strict JSON."""
    if isinstance(obj, float):
        return obj if math.isfinite(obj) else None
    if isinstance(obj, dict):
        return {str(k): finite_or_none(v) for k, v in obj.items()}
    if isinstance(obj, (list, tuple)):
        return [finite_or_none(v) for v in obj]
    if isinstance(obj, (np.floating, np.integer)):
        return finite_or_none(obj.item())
    return obj


def method_order(methods: Sequence[str], reference: str) -> list[str]:
    """Shared-block methods by name, then the reference, then the unshared references."""
    others = sorted(m for m in methods if m != reference and not m.startswith(REFERENCE_PREFIX))
    tail = sorted(m for m in methods if m.startswith(REFERENCE_PREFIX) and m != reference)
    return others + ([reference] if reference in methods else []) + tail


def row_keys(records: Sequence[EvalRecord], reference: str) -> list[tuple[str, str]]:
    keys = sorted({(r.method, r.model_hash) for r in records})
    order = {m: i for i, m in enumerate(method_order([k[0] for k in keys], reference))}
    return sorted(keys, key=lambda k: (order[k[0]], k[1]))


def row_labels(keys: Sequence[tuple[str, str]]) -> dict[tuple[str, str], str]:
    count: dict[str, int] = {}
    for m, _ in keys:
        count[m] = count.get(m, 0) + 1
    return {(m, h): (f"{m} [{h[:8]}]" if count[m] > 1 and h else m) for m, h in keys}


def has_accuracy(rec: EvalRecord) -> bool:
    return "n_correct" in rec.extra and "n_examples" in rec.extra


def adaptive_family(mode: str) -> str:
    return mode.split(":", 1)[0]


def context_title(ctx: dict[str, str], code: bool = True) -> str:
    head = " / ".join(x for x in (ctx.get("dataset"), ctx.get("split")) if x) or "(no dataset)"
    q = "`" if code else ""
    bits = [f"{k} {q}{v}{q}" for k, v in ctx.items() if k not in ("dataset", "split") and v]
    return head + (" · " + ", ".join(bits) if bits else "")


def contenders(rows: Sequence[tuple[str, str]]) -> list[tuple[str, str]]:
    """The rows that compete for bold: all but the unshared references (unless only those)."""
    return [k for k in rows if not k[0].startswith(REFERENCE_PREFIX)] or list(rows)


def best_in_column(
    col: dict[Any, Summary],
    competing: Sequence[Hashable],
    dec: int,
    *,
    scale: float = 1.0,
    lower_is_better: bool = True,
) -> set[Any]:
    """Keys of ``col`` whose mean, as printed with ``dec`` decimals, is the column's best among
    ``competing`` (empty for a column of one row)."""
    vals = [col[k].mean * scale for k in competing if k in col and math.isfinite(col[k].mean)]
    if not vals or len(col) <= 1:
        return set()
    best = fmt_num(min(vals) if lower_is_better else max(vals), dec)
    return {k for k in competing if k in col and fmt_num(col[k].mean * scale, dec) == best}


def mean_std_table(
    rows: list[tuple[str, str]],
    labels: dict[tuple[str, str], str],
    columns: list[Any],
    header: list[str],
    cells: dict[tuple[tuple[str, str], Any], Summary],
    *,
    scale: float = 1.0,
    lower_is_better: bool = True,
) -> tuple[list[str], int]:
    """Markdown rows × columns table of mean ± std (with the seed count per row) and the best
    per column in bold; returns the lines and the decimals used (one choice for the table)."""
    text: dict[tuple[tuple[str, str], Any], str] = {}
    dec = table_decimals([s.mean * scale for s in cells.values()])
    for c in columns:
        col = {k: cells[(k, c)] for k in rows if (k, c) in cells}
        best = best_in_column(
            col, contenders(rows), dec, scale=scale, lower_is_better=lower_is_better
        )
        for k, s in col.items():
            t = fmt_mean_std(s.mean * scale, s.std * scale, dec)
            t = f"**{t}**" if k in best else t
            text[(k, c)] = t + ("" if s.complete else " ⚠")
    out = ["| Method | seeds | " + " | ".join(header) + " |", "|---|---|" + "---:|" * len(columns)]
    for k in rows:
        ns = sorted({cells[(k, c)].n for c in columns if (k, c) in cells})
        ntext = str(ns[0]) if len(ns) == 1 else f"{ns[0]}–{ns[-1]}"
        out.append(
            f"| {md_escape(labels[k])} | {ntext} | "
            + " | ".join(text.get((k, c), "–") for c in columns)
            + " |"
        )
    return out, dec
