"""`looplm findings`: the verdicts of the experiment grids' claims, computed from their rows.

looplm findings                                   # every grid with a findings: section
looplm findings frontier_graph --data docs/data   # from the committed export
looplm findings --data docs/data --write docs/findings.md   # refresh the page's blocks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path


def register(sub: argparse._SubParsersAction) -> None:
    """Add the ``findings`` command."""
    p = sub.add_parser(
        "findings",
        help="computed verdicts of the experiment grids' claims (tables for the findings pages)",
        description="For each experiment grid with a findings: section (configs/experiments/), "
        "compute one verdict per claim from the grid's rows — its results store, or with --data "
        "its committed export — and print the generated Markdown block the pages quote.",
    )
    p.add_argument("grids", nargs="*", help="grid names or config paths (default: all)")
    p.add_argument(
        "--data",
        help="read each grid's rows from its export in this folder (<folder>/<grid>.jsonl, "
        "see `looplm results export`) instead of its results store",
    )
    p.add_argument(
        "--write",
        metavar="PAGE",
        help="replace the page's '<!-- generated: findings GRID -->' blocks in place",
    )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.errors import LoopLMError
    from looplm.experiments.findings import findings_grids, grid_findings, refresh_blocks
    from looplm.experiments.findings.claims import BLOCK
    from looplm.io import atomic_write_text

    names = args.grids or list(findings_grids())
    blocks = {}
    for name in names:
        found = grid_findings(name, data=args.data)
        saved = found.save_fits() if args.data else None
        if saved:
            print(f"{saved}: the φ fits, for the next run from the same rows", file=sys.stderr)
        blocks[found.grid] = found.block()
        print(blocks[found.grid], end="\n\n", flush=True)
    if args.write:
        page = Path(args.write)
        if not page.is_file():
            raise LoopLMError(f"--write {args.write!r}: no such page")
        text = page.read_text(encoding="utf-8")
        present = {m.group(1) for m in BLOCK.finditer(text)}
        for grid in sorted(set(blocks) - present):
            print(f"{page}: no block for {grid} (add a line '<!-- generated: findings {grid} -->', "
                  "an empty line and '<!-- end generated -->' where it belongs)", file=sys.stderr)  # fmt: skip
        new = refresh_blocks(text, blocks)
        if new != text:
            atomic_write_text(page, new)
        print(f"{page}: {'updated' if new != text else 'already current'}")
    return 0
