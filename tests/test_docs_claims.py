"""Every time or speed README.md and docs/ state has a measurement behind it: the paragraph that
states it (or the one right before or after it) links to ``benchmarks/RESULTS.md``, where the run
and its machine are recorded, and every such link's section exists.

Left out: the findings pages (docs/paper.md, paper_measured.md, findings.md, lens_findings.md),
which are themselves the reports of measured runs and name their machine, and the generated
settings reference docs/configuration.md (settings, not measurements).
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
REPORTS = {
    "paper.md",
    "paper_measured.md",
    "findings.md",
    "lens_findings.md",
    "configuration.md",
    "findings_review.md",
}  # findings_review.md: the review log of those pages
# a number with a time unit, a throughput, a speed-up factor, or a comparison word
CLAIM = re.compile(
    r"\d(?:[.,]\d+)?\s?(?:s|sec|seconds?|min|minutes?|h|hours?)\b(?![-/])"
    r"|\d[\d,.]*\s?(?:tokens?/s|tok/s)|\d(?:\.\d+)?×|\bfaster\b|\bslower\b",
)
LINK = re.compile(r"benchmarks/RESULTS\.md(#[\w-]+)?")


def pages() -> list[Path]:
    docs = [p for p in sorted((REPO / "docs").glob("*.md")) if p.name not in REPORTS]
    return [REPO / "README.md", *docs]


def paragraphs(text: str) -> list[str]:
    """Blank-line separated blocks (a fenced code block counts as one)."""
    out, cur, fenced = [], [], False
    for line in text.splitlines():
        if line.startswith("```"):
            fenced = not fenced
        if not line.strip() and not fenced:
            if cur:
                out.append("\n".join(cur))
            cur = []
        else:
            cur.append(line)
    if cur:
        out.append("\n".join(cur))
    return out


def unsupported_claims(text: str) -> list[str]:
    paras = paragraphs(text)
    bad = []
    for i, p in enumerate(paras):
        if not CLAIM.search(p):
            continue
        near = paras[max(0, i - 1) : i + 2]
        if not any(LINK.search(q) for q in near):
            bad.append(CLAIM.search(p).group(0) + " in: " + p[:160].replace("\n", " "))
    return bad


@pytest.mark.parametrize("page", pages(), ids=lambda p: p.name)
def test_every_stated_time_links_to_its_measurement(page: Path) -> None:
    assert unsupported_claims(page.read_text(encoding="utf-8")) == []


def test_linked_sections_exist() -> None:
    results = (REPO / "benchmarks" / "RESULTS.md").read_text(encoding="utf-8")
    anchors = {
        "#" + re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-")
        for h in re.findall(r"^#+ (.+)$", results, re.M)
    }
    for page in pages():
        for anchor in LINK.findall(page.read_text(encoding="utf-8")):
            assert not anchor or anchor in anchors, (page.name, anchor)


def test_the_check_catches_an_unlinked_time() -> None:
    assert unsupported_claims("The demo takes 5 min on 2 cores.")
    assert unsupported_claims("Decoding is 1.6× faster with halting.")
    ok = "The demo takes 5 min ([measured](benchmarks/RESULTS.md#documented-run-times))."
    assert not unsupported_claims(ok)
    assert not unsupported_claims("2 methods × 3 seeds, a d × d matrix, 16 × 128-token steps")
