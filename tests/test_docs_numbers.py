"""Numbers the findings and pretrained pages state in prose, outside any generated block, checked
against what they are computed from: the committed rows (docs/data), the benchmark results file
and the page's own measured table. A number edited by hand without its source fails here."""

from __future__ import annotations

import re
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]


def _read(page: str) -> str:
    return (ROOT / page).read_text(encoding="utf-8")


def _pretrained_speed_rows() -> dict[str, tuple[int, float]]:
    """checkpoint → (layer applications per token, measured ms per token) of pretrained.md's
    speed table."""
    out = {}
    for line in _read("docs/pretrained.md").splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 7 and "= " in cells[2] and cells[0] != "checkpoint":
            out[cells[0]] = (int(cells[2].rsplit("= ", 1)[1]), float(cells[6]))
    return out


def test_the_per_layer_decode_times_are_the_measured_rows_divided_by_the_applications() -> None:
    rows = _pretrained_speed_rows()
    assert set(rows) == {"Parcae-140M", "Huginn-0125", "Ouro-1.4B"}, rows
    text = re.sub(r"\s+", " ", _read("docs/pretrained.md"))
    per = {}
    for name, (apps, ms) in rows.items():
        per[name] = ms / apps
        stated = f"{name} {ms:g} / {apps} = {ms / apps:.2f}"
        assert stated in text, f"pretrained.md should say '{stated}'"
    lo, hi = min(per.values()), max(per.values())
    assert f"about {lo:.1f}–{hi:.1f} ms per layer application" in text


def test_the_measured_gpu_column_is_the_benchmark_results_file() -> None:
    results = _read("benchmarks/RESULTS.md")
    bench = {}
    for line in results.splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 10 and re.fullmatch(r"[\d.]+", cells[7] or "x"):
            bench[cells[0]] = float(cells[7])
    names = {"Parcae-140M": "parcae-140m", "Huginn-0125": "huginn-0125", "Ouro-1.4B": "ouro-1.4b"}
    for name, (_apps, ms) in _pretrained_speed_rows().items():
        assert abs(bench[names[name]] - ms) < 0.5 + 1e-9, (name, ms, bench)


def test_the_virtual_stack_is_written_one_way() -> None:
    """Huginn's unrolled stack: prelude + core × T + coda, written '2 + 4 × T + 2' everywhere."""
    for page in ("docs/pretrained.md", "docs/lens_findings.md", "docs/lens.md", "README.md"):
        text = _read(page)
        assert not re.search(r"4\s*·\s*(32|T)|2 \+ 2 \+ 4", text), page
    assert "2 + 4 × 32 + 2 = 132" in _read("docs/pretrained.md")
    assert "2 + 4 × T + 2 at T = 16 recurrences: 68 layers" in re.sub(
        r"\s+", " ", _read("docs/lens_findings.md")
    )


def test_the_graph_climb_shares_at_depth_2_are_the_rows() -> None:
    """findings.md: 'at depth 2 one step carries X–Y% of the rise in the seed-mean curves (A–B%
    per seed)', computed from docs/data/frontier_graph.jsonl for the four looped methods."""
    from looplm.experiments.findings.claims import _Rows
    from looplm.frontier.section import climb_shape
    from looplm.results.export import load_records

    rows = _Rows(load_records(ROOT / "docs/data/frontier_graph.jsonl"))
    per_seed, means = [], []
    for m in ("gated", "gated_per_step", "scse", "looped"):
        curves = rows.curves(m, [2, 2])
        for c in curves.values():
            T = sorted(c)
            per_seed.append(climb_shape(T, [c[t] for t in T], 0.5)["max_step_share"])
        T = sorted(set.intersection(*(set(c) for c in curves.values())))
        mean = [float(np.mean([c[t] for c in curves.values()])) for t in T]
        means.append(climb_shape(T, mean, 0.5)["max_step_share"])
    pct = lambda xs: f"{100 * min(xs):.0f}–{100 * max(xs):.0f}%"  # noqa: E731
    text = re.sub(r"\s+", " ", _read("docs/findings.md"))
    stated = (f"at depth 2 one step carries {pct(means)} of the rise in the seed-mean curves "
              f"({pct(per_seed)} per seed)")  # fmt: skip
    assert stated in text, stated


def test_the_looped_lens_study_is_cited_where_its_findings_are() -> None:
    for page in ("docs/lens_findings.md", "README.md"):
        text = re.sub(r"\s+", " ", _read(page))
        assert "Wenlong Wang and Fergal Reid" in text and "arXiv:2609.01924" in text, page


def test_the_table19_per_word_conversion_is_the_split_and_the_results_file() -> None:
    """findings.md's per-word conversion of the one-seed GPU rows: the tokens-per-word ratio of
    the tokenised test split and each row of benchmarks/RESULTS.md raised to it."""
    import math
    import os

    import pytest

    data = Path(os.environ.get("LOOPLM_DATA_DIR", ROOT.parent / "shared" / "data"))
    split = data / "wikitext-2" / "wiki.test.tokens"
    if not split.is_file():
        pytest.skip(f"needs WikiText-2 under {data} (LOOPLM_DATA_DIR)")
    from looplm.data.cache import get_split_tokens

    lines = split.read_text(encoding="utf-8").split("\n")
    words = sum(len(line.split()) for line in lines) + len(lines) - 1
    tokens = len(get_split_tokens("wikitext-2", "test", "gpt2", data))
    ratio = tokens / words
    text = re.sub(r"\s+", " ", _read("docs/findings.md"))
    assert f"{words:,} words" in text and f"{tokens:,} GPT-2 tokens" in text
    assert f"{ratio:.4f} tokens per word" in text
    rows = {}
    block = _read("benchmarks/RESULTS.md").split("**WikiText-2 diagnostic**", 1)[1]
    for line in block.split("\n\n", 2)[1].splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 6 and cells[1] == "1" and re.fullmatch(r"[\d.]+", cells[2]):
            rows[cells[0]] = float(cells[2])
    names = {"scse": "SCSE", "looped": "looped", "tuned_adapter": "tuned adapter",
             "norm_reset": "reset"}  # fmt: skip
    assert set(rows) == set(names), rows
    for method, ppl in rows.items():
        assert f"{names[method]} {math.exp(math.log(ppl) * ratio):.1f}" in text, method


def test_the_table19_gap_table_and_factors_are_the_committed_rows() -> None:
    """findings.md's Table 19 gap block is benchmarks/table19_gap.py's report of
    docs/data/table19_gap.jsonl, and every row names the model it came from."""
    import importlib
    import json
    import sys

    rows = [json.loads(x) for x in _read("docs/data/table19_gap.jsonl").splitlines() if x.strip()]
    for r in rows:
        assert {"d_model", "params", "steps", "tokenizer", "batch", "seed", "dataset"} <= set(r)
    sys.path.insert(0, str(ROOT / "benchmarks"))
    try:
        gap = importlib.import_module("table19_gap")
    finally:
        sys.path.remove(str(ROOT / "benchmarks"))
    page = _read("docs/findings.md")
    block = page.split("<!-- table19_gap:start -->\n", 1)[1].split("\n<!-- table19_gap:end -->")[0]
    assert block == gap.report(rows)
    assert {r["run"] for r in rows} == {
        f"{m}_{s}" for m in ("scse", "reset") for s in ("b8", "b32", "raw_b8")
    }
    text = re.sub(r"\s+", " ", page)
    by = {(r["run"], r["variant"], r["depth"]): r for r in rows}

    def span(values: list[float], sign: str = "") -> str:
        return f"{sign}{min(values):.2f}–{max(values):.2f}".replace(".00", "")

    t8 = [by[(f"scse_{s}", v, 8)]["ppl"] / by[(f"reset_{s}", v, 8)]["ppl"]
          for s in ("b8", "b32", "raw_b8") for v in ("windows128", "windows128_no_unk")
          if (f"scse_{s}", v, 8) in by]  # fmt: skip
    t48 = [by[(f"scse_{s}", "windows128", 48)]["ppl"] / by[(f"reset_{s}", "windows128", 48)]["ppl"]
           for s in ("b8", "b32", "raw_b8")]  # fmt: skip
    assert f"SCSE ÷ reset at T = 8 is {span(t8)}" in text
    assert f"T = 48 it is {span(t48)}" in text
    raw = [by[(f"{m}_raw_b8", "windows128", 8)]["ppl_per_word"]
           / by[(f"{m}_b8", "windows128", 8)]["ppl_per_word"] for m in ("scse", "reset")]  # fmt: skip
    assert f"×{min(raw):.1f}–{max(raw):.1f} the tokenised runs'" in text
    unk = [by[(r, "windows128_no_unk", 8)]["ppl"] / by[(r, "windows128", 8)]["ppl"]
           for r in ("scse_b8", "reset_b8", "scse_b32", "reset_b32")]  # fmt: skip
    assert f"raises it ×{min(unk):.1f}–{max(unk):.1f}" in text
