"""The findings pages are generated from, and agree with, the measured results committed under
docs/data/ (one export per grid, `looplm results export`).

* docs/paper_measured.md is exactly what `looplm paper report --data docs/data --out
  docs/paper_measured.md` writes (skipped, with the missing files named, until a data file of the
  page is committed; from then on a stale page fails);
* every figure a findings page links exists;
* every verdict row of docs/paper.md names the claims it speaks for (``<!-- claim ENTRY: TEXT -->``),
  every claim of the catalogue is named by a row, and each row's word is the verdict computed
  from the committed data (skipped per grid until its data file is committed);
* docs/findings.md quotes, for every experiment grid with a ``findings:`` section, the block
  `looplm findings GRID --data docs/data` computes (measured tables and one verdict per claim).
"""

from __future__ import annotations

import difflib
import functools
import json
import re
from pathlib import Path

import pytest

from looplm.experiments import paper
from looplm.experiments.findings import findings_grids
from looplm.experiments.findings.claims import BLOCK as BLOCK_RE
from looplm.experiments.paper.report import entry_verdicts
from looplm.experiments.paper.verdicts import (
    IN_DIRECTION,
    NOT_REPRODUCED,
    prose_disagreements,
    prose_links,
)
from looplm.results.export import data_file

ROOT = Path(__file__).resolve().parents[1]
DATA = ROOT / "docs" / "data"
PAGE = "docs/paper_measured.md"
REGENERATE = "looplm paper report --data docs/data --out docs/paper_measured.md"
FINDINGS = ["docs/paper.md", "docs/paper_measured.md", "docs/findings.md", "docs/lens_findings.md"]
IMAGE = re.compile(r"!\[[^\]]*\]\(([^)\s]+)\)")


@functools.cache
def _grids() -> dict[Path, list[paper.Entry]]:
    """Each grid's data file (committed or not) → the catalogue entries that read it."""
    out: dict[Path, list[paper.Entry]] = {}
    for e in paper.catalogue():
        if e.is_experiment:
            out.setdefault(data_file(DATA, e.experiment().store), []).append(e)
    return out


def _missing(files) -> str:
    return ", ".join(str(f.relative_to(ROOT)) for f in sorted(files))


def test_the_generated_page_is_regenerated_from_the_committed_data() -> None:
    files = set(_grids())
    present = {f for f in files if f.is_file()}
    if not present:
        pytest.skip(f"{PAGE}: none of its data files is committed yet ({_missing(files)})")
    text = paper.paper_report(
        data=DATA, figures_dir=ROOT / "docs" / "paper_measured", link_base=ROOT / "docs", draw=False
    )
    committed = (ROOT / PAGE).read_text(encoding="utf-8")
    if committed != text:
        diff = difflib.unified_diff(
            committed.splitlines(), text.splitlines(), "committed", "regenerated", lineterm="", n=1
        )
        shown = "\n".join(list(diff)[:40])
        pytest.fail(f"{PAGE} is stale; regenerate it with `{REGENERATE}`:\n{shown}")


@pytest.mark.parametrize("page", FINDINGS)
def test_every_figure_a_findings_page_links_exists(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    links = IMAGE.findall(text)
    missing = [link for link in links if not (ROOT / page).parent.joinpath(link).is_file()]
    assert missing == [], f"{page} links figures that do not exist: {missing}"


def test_every_verdict_row_names_existing_claims_and_every_claim_is_named() -> None:
    links = prose_links((ROOT / "docs/paper.md").read_text(encoding="utf-8"))
    claims = {(e.id, c["text"]) for e in paper.catalogue() for c in e.claims}
    named = {(link.entry, link.text) for link in links}
    assert sorted(named - claims) == [], "docs/paper.md names claims no entry has (renamed?)"
    assert sorted(claims - named) == [], "claims that no verdict row of docs/paper.md names"


def test_a_row_that_disagrees_with_the_computed_verdict_is_caught() -> None:
    page = (
        "| claim | verdict |\n|---|---|\n"
        "| a | **reproduced in direction**: mean only <!-- claim table05: x \\| y --> |\n"
        "| b | not testable from the reported numbers <!-- claim table06: z --> |\n"
        "| c | **reproduced in direction** <!-- claim table07: w --> |\n"
    )
    links = prose_links(page)
    assert [(k.entry, k.text, k.word, k.line) for k in links] == [
        ("table05", "x | y", IN_DIRECTION, 3),
        ("table06", "z", None, 4),
        ("table07", "w", IN_DIRECTION, 5),
    ]
    computed = {("table05", "x | y"): NOT_REPRODUCED, ("table06", "z"): IN_DIRECTION,
                ("table07", "w"): IN_DIRECTION}  # fmt: skip
    assert prose_disagreements(page, computed) == [
        "line 3: table05 'x | y': **reproduced in direction**, computed **not reproduced**",
        "line 4: table06 'z': no verdict word, computed **reproduced in direction**",
    ]
    item = "- **Stable** (**reproduced**): text <!-- claim grid_a: stable -->\n- plain <!-- claim grid_a: b -->"
    assert [(k.entry, k.text, k.word) for k in prose_links(item)] == [
        ("grid_a", "stable", "reproduced"),
        ("grid_a", "b", None),
    ]
    assert prose_disagreements(item, {("grid_a", "stable"): NOT_REPRODUCED}) == [
        "line 1: grid_a 'stable': **reproduced**, computed **not reproduced**"
    ]


@pytest.mark.parametrize(
    "grid", sorted(f.name for f, es in _grids().items() if any(e.claims for e in es))
)
def test_prose_verdicts_are_the_computed_ones(grid: str) -> None:
    """Once a grid's data file is committed, every docs/paper.md row naming one of its entries'
    claims carries the verdict `looplm paper report` computes from that file."""
    path, entries = next((f, es) for f, es in _grids().items() if f.name == grid)
    entries = [e for e in entries if e.claims]
    if not path.is_file():
        pytest.skip(f"{path.relative_to(ROOT)} is not committed yet (export the grid's store)")
    computed = {(e.id, c["text"]): v.word for e in entries for c, v in entry_verdicts(e, data=DATA)}
    bad = prose_disagreements((ROOT / "docs/paper.md").read_text(encoding="utf-8"), computed)
    assert bad == [], "docs/paper.md verdict words that are not the computed ones:\n" + "\n".join(
        bad
    )


LENS_DATA = data_file(DATA, "runs/lens/results.sqlite")
LENS_PAGE = "docs/lens_findings.md"
LENS_BLOCK = re.compile(
    r"<!-- generated: lens findings table[^>]*-->\n(.*?)\n<!-- end generated -->", re.S
)


def test_the_lens_findings_table_is_the_one_computed_from_the_committed_data() -> None:
    """docs/lens_findings.md's criteria table is `looplm report`'s lens findings table of the
    committed export docs/data/lens.jsonl.gz (configs/experiments/lens.yaml's store), word for
    word."""
    from looplm.lens.section import findings_table, lens_findings

    block = LENS_BLOCK.search((ROOT / LENS_PAGE).read_text(encoding="utf-8"))
    assert block, f"{LENS_PAGE} has no '<!-- generated: lens findings table -->' block"
    if not LENS_DATA.is_file():
        pytest.skip(f"{LENS_DATA.relative_to(ROOT)} is not committed yet")
    want = findings_table(lens_findings(LENS_DATA)).strip()
    if block.group(1).strip() != want:
        diff = difflib.unified_diff(
            block.group(1).strip().splitlines(), want.splitlines(), "page", "computed", lineterm=""
        )
        pytest.fail(
            f"{LENS_PAGE}'s lens table is stale; replace the block with the table `looplm report "
            f"{LENS_DATA.relative_to(ROOT)}` writes:\n" + "\n".join(list(diff)[:30])
        )


FINDINGS_PAGE = "docs/findings.md"


@pytest.mark.parametrize("grid", sorted(findings_grids()))
def test_findings_page_blocks_are_the_computed_verdicts(grid: str) -> None:
    """docs/findings.md quotes, for every experiment grid with a findings: section, exactly the
    block `looplm findings GRID --data docs/data` computes from the committed export (a grid
    without one reads "not yet run" until its rows are committed)."""
    from looplm.experiments.findings import grid_findings

    text = (ROOT / FINDINGS_PAGE).read_text(encoding="utf-8")
    blocks = {m.group(1): m.group(0) for m in BLOCK_RE.finditer(text)}
    assert grid in blocks, f"{FINDINGS_PAGE} has no '<!-- generated: findings {grid} -->' block"
    want = grid_findings(grid, data=DATA).block()
    if blocks[grid] != want:
        diff = difflib.unified_diff(
            blocks[grid].splitlines(), want.splitlines(), "page", "computed", lineterm=""
        )
        pytest.fail(
            f"{FINDINGS_PAGE}'s {grid} block is stale; run `looplm findings --data docs/data "
            f"--write {FINDINGS_PAGE}`:\n" + "\n".join(list(diff)[:30])
        )


def _findings_computed() -> dict[tuple[str, str], str]:
    from looplm.experiments.findings import grid_findings

    return {
        (grid, claim["text"]): v.word
        for grid in findings_grids()
        for claim, v in grid_findings(grid, data=DATA).verdicts
    }


def test_findings_prose_verdicts_are_the_computed_ones() -> None:
    """A prose line of docs/findings.md that names a claim (``<!-- claim GRID: TEXT -->``) carries
    the word `looplm findings` computes, and every prose line outside the generated blocks that
    states a verdict names its claim (a verdict word no test reads could go stale)."""
    from looplm.results.vocabulary import NOT_RUN, VERDICTS

    text = (ROOT / FINDINGS_PAGE).read_text(encoding="utf-8")
    prose = BLOCK_RE.sub("", text)
    computed = _findings_computed()
    links = prose_links(prose)
    unknown = [(k.entry, k.text) for k in links if (k.entry, k.text) not in computed]
    assert unknown == [], f"{FINDINGS_PAGE} names claims no grid states: {unknown}"
    bad = prose_disagreements(prose, computed)
    assert bad == [], "docs/findings.md verdict words that are not the computed ones:\n" + (
        "\n".join(bad)
    )
    linked = {k.line for k in links}
    unlinked = [
        f"line {i}: {line[:80]}"
        for i, line in enumerate(prose.splitlines(), 1)
        if i not in linked
        and any(w in VERDICTS and w != NOT_RUN for w in re.findall(r"\*\*(.+?)\*\*", line))
    ]
    assert unlinked == [], "verdict words without a <!-- claim GRID: TEXT --> link:\n" + (
        "\n".join(unlinked)
    )


def test_the_committed_phi_fits_are_those_of_the_committed_rows() -> None:
    """Each grid's φ fits (docs/data/<grid>.fits.json) are keyed by the hash of the committed
    points: a grid whose rows changed without its memo being refreshed fails here, not slowly."""
    from looplm.experiments.findings import grid_findings

    for grid in findings_grids():
        found = grid_findings(grid, data=DATA)
        assert found.fits is None, (
            f"{grid}: φ fitted afresh (docs/data lacks the fits of these rows); run `looplm "
            "findings --data docs/data --write docs/findings.md` and commit the .fits.json"
        )


@pytest.mark.slow
def test_the_committed_phi_fits_are_what_refitting_gives() -> None:
    """Refit every memoised φ from the committed rows (minutes): the memo holds the fit."""
    from looplm.experiments.findings import grid_findings
    from looplm.experiments.findings.claims import FITS_SUFFIX

    for fits in sorted(DATA.glob(f"*{FITS_SUFFIX}")):
        grid = fits.name[: -len(FITS_SUFFIX)]
        memo = json.loads(fits.read_text(encoding="utf-8"))
        fresh = grid_findings(grid, data=DATA, memo=False)
        assert fresh.fits is not None and sorted(fresh.fits[1]) == sorted(memo), grid
        for key, fit in memo.items():
            for k in ("phi", "low", "high"):
                assert fresh.fits[1][key][k] == pytest.approx(fit[k], rel=1e-6, abs=1e-9), (grid, k)
