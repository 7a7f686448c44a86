"""`looplm report STORE`: tables (markdown), figures (PNG) and results.json from a results store."""

from __future__ import annotations

import argparse
from pathlib import Path

from looplm.errors import LoopLMError


def _parse_seeds(text: str) -> str | list[int]:
    text = text.strip()
    if text in ("default", "expanded", "auto", "all"):
        return text
    try:
        seeds = [int(x) for x in text.split(",") if x.strip() != ""]
    except ValueError:
        raise LoopLMError(
            f"bad --seeds {text!r}; allowed: default, expanded, auto, all, or ids like 0,1,2"
        ) from None
    if not seeds:
        raise LoopLMError("--seeds is empty; give ids like 0,1,2 or default/expanded/auto/all")
    return seeds


_PRINTED = ("### Paired deltas", "## Recurrence scaling law")


def key_tables(markdown: str) -> str:
    """The report's paired-delta tables (each under its context heading) and the φ table: the
    sections ``looplm report`` prints, the rest stays in ``report.md``."""
    out: list[str] = []
    context, keep = "", False
    for line in markdown.splitlines():
        if line.startswith("## ") or line.startswith("### "):
            keep = line.startswith(_PRINTED)
            if line.startswith("## ") and not keep:
                context = line
            elif keep:
                if context and line.startswith("### "):
                    out += [context, ""]
                context = ""
                out.append(line)
            continue
        if keep and not line.startswith("!["):
            out.append(line)
    return "\n".join(out).strip()


def run(args: argparse.Namespace) -> int:
    """Build the report; prints its paired-delta and φ tables and the paths written."""
    from looplm.results.report import write_report

    out = Path(args.out) if args.out else Path(args.store).resolve().parent / "report"
    result = write_report(
        args.store,
        out,
        reference=args.reference or "scse",
        seeds=_parse_seeds(args.seeds),
        train_depth_max=args.train_depth_max,
        allow_incomplete=args.allow_incomplete,
        n_boot=args.n_boot,
        boot_seed=args.boot_seed,
        ppl_shift=args.ppl_shift,
        figures=not args.no_figures,
        require_reference=args.reference is not None,  # named on purpose: must be in the store
    )
    if not args.quiet:
        tables = key_tables(Path(result.report_md).read_text(encoding="utf-8"))
        if tables:
            print(tables + "\n")
    print(f"wrote {result.report_md}")
    print(f"wrote {result.results_json}")
    for fig in result.figures:
        print(f"wrote {fig}")
    if result.incomplete:
        print(f"warning: {len(result.incomplete)} incomplete summaries (marked ⚠ in the report)")
    return 0


def register(subparsers: argparse._SubParsersAction) -> None:
    """Add the ``report`` command."""
    p = subparsers.add_parser(
        "report",
        help="tables, figures and results.json from a results store",
        description="Turn a results store (SQLite, or its JSON export) into paper-style markdown "
        "tables, PNG figures and a results.json summary.",
    )
    p.add_argument("store", help="results store (.sqlite) or a JSON export of one")
    p.add_argument("--out", default=None, help="output folder (default: <store folder>/report)")
    p.add_argument(
        "--reference",
        default=None,
        help="method for paired deltas (default scse; a method of the store)",
    )
    p.add_argument(
        "--seeds",
        default="auto",
        help="required seed set (default: auto): ids like 0,1,2, or a named set: "
        "auto (0-4 where complete, else 0,1,2), default (0,1,2), expanded (0-4), all",
    )
    p.add_argument("--train-depth-max", type=int, default=8, help="largest training depth (8)")
    p.add_argument(
        "--allow-incomplete",
        action="store_true",
        help="mark summaries with missing/duplicate seeds instead of failing",
    )
    p.add_argument("--n-boot", type=int, default=10_000, help="bootstrap resamples (10000)")
    p.add_argument("--boot-seed", type=int, default=0, help="bootstrap RNG seed (0)")
    p.add_argument("--ppl-shift", type=float, default=None, help="fixed c for log(PPL - c) axes")
    p.add_argument("--no-figures", action="store_true", help="skip the PNG figures")
    p.add_argument(
        "--quiet", action="store_true", help="print only the paths written (not the tables)"
    )
    p.set_defaults(func=run)
