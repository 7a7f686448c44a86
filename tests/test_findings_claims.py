"""Verdicts of the experiment grids' claims (looplm.experiments.findings): each test's words come from the
rows by its stated criterion, and each can fail."""

from __future__ import annotations

import json

import pytest
from test_results_scaling import TRUE, iso_depth_sweep

from looplm.errors import LoopLMError
from looplm.experiments.findings import check_claims, claim_verdict, grid_findings, refresh_blocks
from looplm.experiments.findings.claims import _Rows
from looplm.results.export import write_export
from looplm.results.store import EvalRecord
from looplm.results.vocabulary import (
    IN_DIRECTION,
    NOT_DISTINGUISHABLE,
    NOT_REPRODUCED,
    NOT_RUN,
    NOT_TESTABLE,
    REPRODUCED,
)

DEPTHS = (1, 2, 4, 8, 32)


def frontier(method: str, seed: int, difficulty: int, acc_at: dict[int, float], n: int = 100):
    """Frontier rows of one (method, seed, difficulty): ``acc_at`` maps T to accuracy in [0, 1]."""
    return [
        EvalRecord(
            method=method,
            seed=seed,
            depth=t,
            split=f"difficulty={difficulty}",
            dataset="graph_nodes",
            protocol="p",
            model_hash=f"{method}{seed}",
            extra={"n_correct": round(a * n), "n_examples": n},
        )  # fmt: skip
        for t, a in acc_at.items()
    ]


def _verdict(claim: dict, records: list[EvalRecord]):
    return claim_verdict(check_claims([claim], "test")[0], _Rows(records, "wikitext-2"))


NEAR_PERFECT = {"text": "near-perfect", "test": "threshold", "metric": "min_accuracy",
                "method": "gated", "difficulties": [1, 2], "depth": 8, "op": ">", "value": 98}  # fmt: skip


def test_threshold_needs_the_whole_interval_on_the_claimed_side():
    perfect = [r for s in range(3) for d in (1, 2) for r in frontier("gated", s, d, {8: 1.0})]
    assert _verdict(NEAR_PERFECT, perfect).word == REPRODUCED
    # 100, 99, 97 at the harder difficulty: the mean (98.67) is above 98, its interval is not
    mixed = [*frontier("gated", 0, 1, {8: 1.0}), *frontier("gated", 0, 2, {8: 1.0}),
             *frontier("gated", 1, 1, {8: 1.0}), *frontier("gated", 1, 2, {8: 0.99}),
             *frontier("gated", 2, 1, {8: 1.0}), *frontier("gated", 2, 2, {8: 0.97})]  # fmt: skip
    v = _verdict(NEAR_PERFECT, mixed)
    assert v.word == IN_DIRECTION, v.evidence
    assert v.evidence[0].startswith("gated lowest of d=1–2 at T=8: 98.7% (needs > 98; margin")
    low = [r for s in range(3) for d in (1, 2) for r in frontier("gated", s, d, {8: 0.9})]
    assert _verdict(NEAR_PERFECT, low).word == NOT_REPRODUCED
    one = [r for d in (1, 2) for r in frontier("gated", 0, d, {8: 1.0})]
    assert _verdict(NEAR_PERFECT, one).word == NOT_TESTABLE  # one seed: no interval
    assert _verdict(NEAR_PERFECT, []).word == NOT_RUN


def test_ordering_is_paired_by_seed_and_reads_each_methods_deepest_T():
    claim = {"text": "x", "test": "ordering", "metric": "accuracy", "method": "gated",
             "than": ["unshared"], "difficulties": [5, 6], "depth": "max"}  # fmt: skip
    recs = []
    for s, base in enumerate((0.6, 0.7, 0.8)):  # the seeds differ a lot, the pairs little
        for d in (5, 6):
            recs += frontier("gated", s, d, {8: 0.1, 32: base + 0.05})
            recs += frontier("unshared", s, d, {6: base})
    v = _verdict(claim, recs)
    assert v.word == REPRODUCED, v.evidence
    assert "gated d=5–6 at T=32 − unshared d=5–6 at T=6: +5 ± 0" in v.evidence[0]
    flipped = {**claim, "method": "unshared", "than": ["gated"]}
    assert _verdict(flipped, recs).word == NOT_REPRODUCED


def test_a_difference_against_a_margin():
    """within two points: method − rival > −2, paired by seed."""
    claim = {"text": "x", "test": "threshold", "metric": "accuracy", "method": "gated",
             "than": ["unshared"], "difficulties": [4, 4], "depth": "max", "op": ">",
             "value": -2}  # fmt: skip
    close = [r for s in range(3) for r in (*frontier("gated", s, 4, {32: 0.70 + 0.01 * s}),
                                           *frontier("unshared", s, 4, {6: 0.705 + 0.01 * s}))]  # fmt: skip
    assert _verdict(claim, close).word == REPRODUCED
    far = [r for s in range(3) for r in (*frontier("gated", s, 4, {32: 0.60 + 0.01 * s}),
                                         *frontier("unshared", s, 4, {6: 0.70 + 0.01 * s}))]  # fmt: skip
    v = _verdict(claim, far)
    assert v.word == NOT_REPRODUCED, v.evidence
    assert v.evidence[0] == (
        "gated d=4 at T=32 − unshared d=4 at T=6: -10.0% (needs > −2; margin -8 ± 0 (95% t "
        "half-width, 3 seeds))"
    )


def test_climb_shapes_from_every_seed_curve():
    claim = {"text": "x", "test": "climb", "shape": "abrupt_from_chance", "method": "gated",
             "difficulties": [2, 2]}  # fmt: skip
    abrupt = {1: 0.5, 2: 1.0, 4: 1.0, 8: 1.0, 32: 1.0}
    recs = [r for s in range(3) for r in frontier("gated", s, 2, abrupt)]
    v = _verdict(claim, recs)
    assert v.word == REPRODUCED and "3/3 seed curves" in v.evidence[0], v.evidence
    late = {1: 0.75, 2: 1.0, 4: 1.0, 8: 1.0, 32: 1.0}  # abrupt, but not from chance
    assert _verdict(claim, [r for s in range(3) for r in frontier("gated", s, 2, late)]).word == (
        NOT_REPRODUCED
    )
    gradual = {1: 0.5, 2: 0.6, 4: 0.7, 8: 0.8, 32: 0.9}
    steps = [r for s in range(3) for r in frontier("gated", s, 2, gradual)]
    assert _verdict({**claim, "shape": "gradual"}, steps).word == REPRODUCED
    assert _verdict(claim, steps).word == NOT_REPRODUCED
    flat = {1: 0.5, 2: 0.51, 4: 0.5, 8: 0.52, 32: 0.5}  # a 2-point wobble is no climb
    v = _verdict({**claim, "shape": "gradual"}, [r for s in range(3)
                                                 for r in frontier("gated", s, 2, flat)])  # fmt: skip
    assert v.word == NOT_REPRODUCED and "no climb" in v.evidence[0]


def test_ppl_orderings_are_lower_is_better_at_every_named_depth():
    claim = {"text": "x", "test": "ordering", "metric": "ppl", "method": "scse",
             "than": ["looped"], "depth": [8, 48]}  # fmt: skip

    def fixed(method, seed, depth, ppl):
        import math

        return EvalRecord(method=method, seed=seed, depth=depth, dataset="wikitext-2",
                          split="test", n_tokens=1000, sum_nll=1000 * math.log(ppl))  # fmt: skip

    recs = [fixed("scse", s, t, 100 + s) for s in range(3) for t in (8, 48)]
    recs += [fixed("looped", s, 8, 110 + s) for s in range(3)]
    recs += [fixed("looped", s, 48, 100.5 + s) for s in range(3)]
    v = _verdict(claim, recs)
    # 0.5 PPL of 100 is below the policy's minimum effect (2% of the rival's level): a tie
    assert v.word == NOT_DISTINGUISHABLE, v.evidence
    assert "minimum effect 2.03" in v.evidence[-1]
    recs += [fixed("looped", s, 48, 103 + s) for s in range(3)]  # now 3 PPL better at T = 48
    assert _verdict(claim, recs).word == REPRODUCED
    recs += [fixed("looped", s, 48, 97 + s) for s in range(3)]  # now SCSE is worse at T = 48
    assert _verdict(claim, recs).word == NOT_REPRODUCED


def test_a_tie_claim_is_judged_against_the_same_minimum_effect():
    """op ~ (\"stable\"): reproduced when the interval lies within ± 2 points, in direction when
    only the mean does, not reproduced when the mean is outside; the old rule (> −2 with no
    margin) called a 1.3-point drop with a 3-point interval reproduced in direction."""
    stable = {"text": "stable", "test": "threshold", "metric": "stability", "method": "gated",
              "difficulties": [1, 1], "depth": 32, "from_depth": 8, "op": "~", "value": 0}  # fmt: skip
    flat = [r for s in range(3) for r in frontier("gated", s, 1, {8: 1.0, 32: 0.995})]
    assert _verdict(stable, flat).word == REPRODUCED
    noisy = [r for s, a in enumerate((0.96, 1.0, 1.0))
             for r in frontier("gated", s, 1, {8: 1.0, 32: a})]  # fmt: skip
    assert _verdict(stable, noisy).word == IN_DIRECTION  # mean −1.3, interval reaches −7
    fall = [r for s in range(3) for r in frontier("gated", s, 1, {8: 1.0, 32: 0.9 + 0.01 * s})]
    assert _verdict(stable, fall).word == NOT_REPRODUCED


def _scaling(method: str, phi: float) -> list[EvalRecord]:
    r, once, rec, d, loss = iso_depth_sweep(dict(TRUE, phi=phi), noise=0.001, seed=2)
    return [
        EvalRecord(
            method=method,
            model_hash=f"{method}{i}",
            depth=int(ri),
            seed=0,
            n_tokens=1000,
            sum_nll=float(li) * 1000,
            extra={"n_once": oi, "n_rec": ni, "train_tokens": di, "r": int(ri)},
        )  # fmt: skip
        for i, (ri, oi, ni, di, li) in enumerate(zip(r, once, rec, d, loss))
    ]


def test_phi_claims_read_the_bootstrap_interval(monkeypatch):
    monkeypatch.setattr("looplm.experiments.findings.claims.PHI_BOOT", 10)
    recs = _scaling("looped", 0.46) + _scaling("trunc", 0.2) + _scaling("hc", 0.8)
    value = {"text": "x", "test": "phi_value", "method": "looped", "value": 0.46}
    v = _verdict(value, recs)
    assert v.word == REPRODUCED and v.evidence[0].startswith("looped φ = 0.4"), v.evidence
    assert _verdict({**value, "value": 0.65}, recs).word == NOT_REPRODUCED
    lower = {"text": "x", "test": "phi_order", "method": "trunc", "than": ["looped"],
             "better": "lower"}  # fmt: skip
    assert _verdict(lower, recs).word == REPRODUCED
    assert _verdict({**lower, "method": "hc"}, recs).word == NOT_REPRODUCED
    assert _verdict({**lower, "method": "hc", "better": "higher"}, recs).word == REPRODUCED
    assert _verdict({**lower, "method": "none"}, recs).word == NOT_RUN


@pytest.mark.parametrize(
    ("claim", "message"),
    [
        ({"text": "x", "test": "vibes", "method": "a"}, "test='vibes'; allowed: threshold"),
        (
            {
                "text": "x",
                "test": "ordering",
                "method": "a",
                "metric": "accuracy",
                "depth": 8,
                "difficulties": [1, 2],
            },
            "ordering needs than",
        ),  # fmt: skip
        (
            {
                "text": "x",
                "test": "threshold",
                "method": "a",
                "metric": "accuracy",
                "depth": 8,
                "difficulties": [1, 2],
            },
            "needs op",
        ),  # fmt: skip
        (
            {
                "text": "x",
                "test": "threshold",
                "method": "a",
                "metric": "loss",
                "depth": 8,
                "op": ">",
                "value": 1,
            },
            "metric='loss'; allowed: accuracy",
        ),  # fmt: skip
        ({"text": "x", "test": "untestable"}, "needs a reason"),
        (
            {"text": "x", "test": "climb", "method": "a", "difficulties": [1, 2], "shape": "steep"},
            "shape",
        ),  # fmt: skip
        ({"test": "untestable", "reason": "r"}, "needs a text"),
        ({"text": "x", "test": "untestable", "reason": "r", "colour": 1}, "colour"),
    ],
)
def test_bad_claims_get_one_line_errors(claim, message):
    with pytest.raises(LoopLMError, match=message):
        check_claims([claim], "grid.yaml: findings.claims")


def test_a_grids_block_from_its_committed_export_and_the_page_refresh(tmp_path, capsys):
    """frontier_graph's claims computed from an export in a data folder, the block the page
    quotes, and `looplm findings --write` replacing only that block."""
    from looplm.cli import main

    recs = []
    for s in range(3):
        for d in (1, 2, 3, 4):
            for m in ("gated", "gated_per_step", "scse", "looped"):
                recs += frontier(m, s, d, {t: 0.5 if t < d else 1.0 for t in DEPTHS})
        for d in (5, 8, 12):
            for m in ("gated", "gated_per_step", "scse", "looped"):
                recs += frontier(m, s, d, {t: 0.9 for t in DEPTHS})
            recs += frontier("unshared_6l", s, d, {6: 0.55 + 0.01 * s})
    write_export(recs, tmp_path / "frontier_graph.jsonl")
    found = grid_findings("frontier_graph", data=tmp_path)
    words = {c["text"][:20]: v.word for c, v in found.verdicts}
    assert words == {
        "accuracy climbs once": REPRODUCED,
        "it climbs abruptly f": NOT_TESTABLE,  # stated as untestable from these rows
        "the recurrence (with": REPRODUCED,
        "(implied) the three ": NOT_TESTABLE,  # every model equally stable: nothing to order
        "depth recurrence ext": REPRODUCED,
        "fixed-depth models b": REPRODUCED,
        "intermediate per-ste": NOT_TESTABLE,  # per-step identical on every seed
    }
    block = found.block()
    assert block.startswith("<!-- generated: findings frontier_graph ")
    assert f"Computed from `frontier_graph.jsonl` ({len(recs):,} rows)" in block
    assert "`unshared_6l` bytes d64 410k params, 500 steps of 32 graph_nodes rows" in block
    page = tmp_path / "page.md"
    stale = "<!-- generated: findings frontier_graph -->\nold\n<!-- end generated -->"
    other = "<!-- generated: findings phi -->\nkept\n<!-- end generated -->"
    page.write_text(f"# Page\n\n{stale}\n\ntext\n\n{other}\n", encoding="utf-8")
    assert main(["findings", "frontier_graph", "--data", str(tmp_path), "--write", str(page)]) == 0
    assert "updated" in capsys.readouterr().out
    assert page.read_text(encoding="utf-8") == f"# Page\n\n{block}\n\ntext\n\n{other}\n"
    assert refresh_blocks(page.read_text(encoding="utf-8"), {"frontier_graph": block}) == (
        page.read_text(encoding="utf-8")
    )
    empty = grid_findings("frontier_graph", data=tmp_path / "none")
    assert {v.word for _, v in empty.verdicts} == {NOT_RUN, NOT_TESTABLE}  # untestable stays so
    assert "No rows of this grid yet (no `frontier_graph.jsonl` committed in the data folder)" in (
        empty.block()
    )


def test_a_partly_run_grid_names_its_unmeasured_methods_and_their_claims_wait(tmp_path):
    """An export holding some of the config's methods: the block says which are not measured,
    their tables have no rows for them, and a claim naming one reads not yet run."""
    recs = []
    for s in range(3):
        for d in (5, 8, 12):
            recs += frontier("gated", s, d, {32: 0.9})
            recs += frontier("unshared_6l", s, d, {6: 0.55 + 0.01 * s})
    write_export(recs, tmp_path / "frontier_graph.jsonl")
    found = grid_findings("frontier_graph", data=tmp_path)
    assert found.unmeasured == ["gated_per_step", "scse", "looped"]
    block = found.block()
    assert (
        "Not measured yet (no rows, so in no table and no verdict): `gated_per_step`, `scse`, "
        "`looped`." in block
    )
    words = {c["text"][:20]: v.word for c, v in found.verdicts}
    assert words["depth recurrence ext"] == REPRODUCED
    assert words["intermediate per-ste"] == NOT_RUN  # the per-step variant has no rows
    assert "| `scse` |" not in block


def test_unknown_grid_is_a_one_line_error(capsys):
    from looplm.cli import main

    assert main(["findings", "nope"]) == 2
    err = capsys.readouterr().err
    assert "grid 'nope': no such config; grids with findings: frontier_bool" in err
    assert json  # the module's imports stay used


def test_methods_under_also_are_shown_but_stay_outside_the_verdict():
    claim = {**NEAR_PERFECT, "also": ["looped"]}
    recs = [r for s in range(3) for d in (1, 2) for r in frontier("gated", s, d, {8: 1.0})]
    recs += [r for s in range(3) for d in (1, 2) for r in frontier("looped", s, d, {8: 0.6})]
    v = _verdict(claim, recs)
    assert v.word == REPRODUCED
    assert v.evidence[-1].startswith("outside the verdict: looped lowest of d=1–2 at T=8: 60.0%")
    assert v.evidence[-1].endswith("alone: not reproduced")
    assert _verdict({**NEAR_PERFECT, "methods": ["gated", "looped"]}, recs).word == NOT_REPRODUCED


def test_a_marker_quoted_inside_a_line_is_not_a_block():
    page = (
        "Blocks sit between `<!-- generated: findings GRID -->` markers.\n\n"
        "<!-- generated: findings a -->\nold\n<!-- end generated -->\n"
    )
    new = "<!-- generated: findings a -->\nnew\n<!-- end generated -->"
    assert refresh_blocks(page, {"a": new, "GRID": "x"}) == page.replace("old", "new")


def test_phi_fits_are_memoised_by_their_points(tmp_path, monkeypatch):
    """A φ fit computed from a data folder is kept beside the export (<grid>.fits.json) under the
    hash of its points; the next computation from the same rows reads it, a changed row refits."""
    monkeypatch.setattr("looplm.experiments.findings.claims.PHI_BOOT", 10)
    recs = _scaling("looped", 0.46) + _scaling("looped_trunc2", 0.2) + _scaling("hyper_looped", 0.8)
    write_export(recs, tmp_path / "phi.jsonl")
    first = grid_findings("phi", data=tmp_path)
    assert first.save_fits() == tmp_path / "phi.fits.json"
    memo = json.loads((tmp_path / "phi.fits.json").read_text())
    assert sorted(v["method"] for v in memo.values()) == ["hyper_looped", "looped", "looped_trunc2"]

    def no_refit(*a, **k):
        raise AssertionError("refitted although the memo holds these points")

    monkeypatch.setattr("looplm.scaling.fit.bootstrap_records", no_refit)
    again = grid_findings("phi", data=tmp_path)
    assert again.fits is None and again.block() == first.block()
    recs[0].sum_nll *= 1.01  # one changed row: its method is refitted
    write_export(recs, tmp_path / "phi.jsonl")
    with pytest.raises(AssertionError, match="refitted"):
        grid_findings("phi", data=tmp_path)


def test_an_ordering_of_identical_values_is_not_testable_and_phi_needs_a_placed_rival():
    claim = {"text": "x", "test": "ordering", "metric": "accuracy", "method": "gated",
             "than": ["looped"], "difficulties": [2, 2], "depth": 8}  # fmt: skip
    same = [r for s in range(3) for m in ("gated", "looped") for r in frontier(m, s, 2, {8: 1.0})]
    v = _verdict(claim, same)
    assert v.word == NOT_TESTABLE and "identical on every seed" in v.evidence[0]
    rows = _Rows([])
    rows._phi = {"wide": (0.7, 1e-20, 1.15), "low": (0.0, 1e-21, 2e-12), "mid": (0.5, 0.3, 0.7)}
    order = {"text": "x", "test": "phi_order", "method": "low", "than": ["wide"], "better": "lower"}
    assert claim_verdict(check_claims([order], "t")[0], rows).word == NOT_TESTABLE
    at_bound = {
        "text": "x",
        "test": "phi_order",
        "method": "low",
        "than": ["mid"],
        "better": "lower",
    }
    assert claim_verdict(check_claims([at_bound], "t")[0], rows).word == REPRODUCED
    value = {"text": "x", "test": "phi_value", "method": "low", "value": 0.0}
    assert claim_verdict(check_claims([value], "t")[0], rows).word == NOT_TESTABLE  # at the bound


def test_a_margin_between_two_models_at_chance_on_every_seed_is_not_testable():
    """'within two points of the fixed-depth model' holds vacuously when both sit at chance."""
    claim = {"text": "x", "test": "threshold", "metric": "accuracy", "method": "gated",
             "than": ["unshared"], "difficulties": [4, 4], "depth": "max", "op": ">",
             "value": -2}  # fmt: skip
    chance = [
        r for s in range(3) for m in ("gated", "unshared") for r in frontier(m, s, 4, {8: 0.5})
    ]
    v = _verdict(claim, chance)
    assert v.word == NOT_TESTABLE and v.evidence[0].endswith("identical on every seed)")


def test_a_phi_interval_pinned_at_the_fits_bound_tests_nothing():
    """φ = 0.00 [0.00, 0.00] (every resample at the fit's lower bound) excludes 0.38 only by an
    end the bound chose: not testable (the old rule said not reproduced); an interval whose free
    end excludes the value still is not reproduced. (An order against [0, 0] still reads: "at most
    0" is below an interval placed above 0; see the test above.)"""
    rows = _Rows([], "wikitext-2")
    rows._phi = {"trunc": (1e-20, 0.0, 1e-20), "free": (0.8, 0.6, 1.0), "loop": (0.7, 0.0, 1.15)}
    value = check_claims([{"text": "x", "test": "phi_value", "method": "trunc", "value": 0.38}],
                         "t")[0]  # fmt: skip
    assert claim_verdict(value, rows).word == NOT_TESTABLE
    assert claim_verdict({**value, "method": "free"}, rows).word == NOT_REPRODUCED
