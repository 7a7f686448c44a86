"""The findings pages speak the verdict vocabulary of :mod:`looplm.experiments.paper.verdicts` and nothing else.

Every bold verdict-like phrase in the pages must be one of ``VERDICTS`` (no "partly", no
"reproduced exactly"), every row of a verdict table opens with one such word (or says the page's
numbers cannot settle it), and the criteria table of docs/paper.md is the module's text.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from looplm.experiments.paper.verdicts import BY_CONSTRUCTION, VERDICTS

ROOT = Path(__file__).resolve().parents[1]
PAGES = ["docs/paper.md", "docs/findings.md", "docs/lens_findings.md", "README.md"]
# A bold phrase that reads like a verdict: any of these stems inside it.
VERDICT_LIKE = re.compile(
    r"reproduc|replicat|partly|partial|testable|construction|confirm|not yet run",
    re.IGNORECASE,
)
# The one unbolded phrase a verdict cell may open with when the page cannot apply a criterion.
FROM_THE_PAGE = "not testable from the reported numbers"
BOLD = re.compile(r"\*\*(.+?)\*\*")
CELL_SPLIT = re.compile(r"(?<!\\)\|")


def bad_bold_verdicts(text: str) -> list[str]:
    """Bold phrases that look like verdicts but are not a word of ``VERDICTS``."""
    return [
        m.group(1)
        for m in BOLD.finditer(text)
        if VERDICT_LIKE.search(m.group(1)) and m.group(1).strip() not in VERDICTS
    ]


def verdict_cells(text: str) -> list[str]:
    """The last cell of every body row of every table whose last header cell is ``verdict``."""
    cells: list[str] = []
    in_table = False
    for line in text.splitlines():
        if not line.startswith("|"):
            in_table = False
            continue
        parts = [c.strip() for c in CELL_SPLIT.split(line.strip())[1:-1]]
        if not in_table:
            in_table = parts[-1].lower() == "verdict"
            continue
        if set(parts[-1]) <= set("-: "):
            continue  # the separator row
        cells.append(parts[-1])
    return cells


def test_the_checker_catches_words_outside_the_vocabulary() -> None:
    """The checks below can fail: the old words are caught, the vocabulary's own pass."""
    assert bad_bold_verdicts("| x | **partly**: a | **reproduced exactly** |") == [
        "partly",
        "reproduced exactly",
    ]
    assert bad_bold_verdicts(" ".join(f"**{w}**" for w in VERDICTS)) == []
    assert bad_bold_verdicts("**all 22 methods × 3 seeds** and **bytes**") == []
    table = "| claim | verdict |\n| --- | --- |\n| a | **partly** |\n| b | text |\n\nafter"
    assert verdict_cells(table) == ["**partly**", "text"]


@pytest.mark.parametrize("page", PAGES)
def test_bold_verdict_words_are_the_vocabulary(page: str) -> None:
    text = (ROOT / page).read_text(encoding="utf-8")
    assert bad_bold_verdicts(text) == [], f"{page}: bold verdict words outside VERDICTS"


@pytest.mark.parametrize("page", ["docs/paper.md", "docs/findings.md"])
def test_every_verdict_row_opens_with_one_verdict(page: str) -> None:
    """One verdict per claim: each verdict cell opens with a bold vocabulary word, or says that
    the page's numbers cannot settle the criterion; a by-construction verdict says what it is."""
    cells = verdict_cells((ROOT / page).read_text(encoding="utf-8"))
    assert cells, f"{page} has no verdict table"
    what_it_is = VERDICTS[BY_CONSTRUCTION].rsplit(": ", 1)[-1]
    for cell in cells:
        m = re.match(r"\*\*(.+?)\*\*", cell)
        if m is None:
            assert cell.startswith(FROM_THE_PAGE), (
                f"{page}: a verdict cell without a verdict: {cell}"
            )
            continue
        assert m.group(1) in VERDICTS, f"{page}: {m.group(1)!r} is not a verdict word"
        if m.group(1) == BY_CONSTRUCTION and page == "docs/paper.md":
            assert what_it_is in cell, f"{page}: say '{what_it_is}' beside: {cell[:80]}"


def test_paper_doc_criteria_table_is_the_modules() -> None:
    """docs/paper.md's "Verdicts" table lists exactly the module's words and criteria, in order."""
    text = (ROOT / "docs/paper.md").read_text(encoding="utf-8")
    section = text.split("## Verdicts: computed, never typed", 1)[1].split("\n## ", 1)[0]
    rows = [line for line in section.splitlines() if line.startswith("|")]
    header, _sep, *body = rows
    assert [c.strip() for c in header.strip("|").split("|")] == ["verdict", "criterion"]
    table = [tuple(c.strip() for c in CELL_SPLIT.split(r.strip())[1:-1]) for r in body]
    assert table == list(VERDICTS.items())


@pytest.mark.parametrize("page", ["docs/paper.md", "docs/findings.md"])
def test_the_one_margin_policy_is_stated_word_for_word(page: str) -> None:
    """docs/paper.md and docs/findings.md quote the engine's margin policy exactly (so a change of
    a minimum effect in looplm.results.vocabulary fails here until both pages say it)."""
    from looplm.results.vocabulary import MARGIN_POLICY

    text = (ROOT / page).read_text(encoding="utf-8")
    assert f"> {MARGIN_POLICY}\n" in text, f"{page}: quote MARGIN_POLICY as a '> ' paragraph"
