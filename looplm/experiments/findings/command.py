"""`looplm findings`: the verdicts of the experiment grids' claims, computed from their rows.

looplm findings                                   # every grid with a findings: section
looplm findings frontier_graph --data docs/data   # from the committed export
looplm findings --data docs/data --write docs/findings.md   # refresh the page's blocks
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from looplm.experiments.settings import FindingsSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (FindingsSettings,)


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
    add_options(p, FindingsSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.errors import LoopLMError
    from looplm.experiments.findings.claims import (
        BLOCK,
        findings_grids,
        grid_findings,
        refresh_blocks,
    )
    from looplm.io import atomic_write_text

    s = from_args(FindingsSettings, args)
    names = args.grids or list(findings_grids())
    blocks = {}
    for name in names:
        found = grid_findings(name, data=s.data)
        saved = found.save_fits() if s.data else None
        if saved:
            print(f"{saved}: the φ fits, for the next run from the same rows", file=sys.stderr)
        blocks[found.grid] = found.block()
        print(blocks[found.grid], end="\n\n", flush=True)
    if s.write:
        page = Path(s.write)
        if not page.is_file():
            raise LoopLMError(f"--write {s.write!r}: no such page")
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
