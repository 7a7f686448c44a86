"""Frontier evaluation: accuracy over T × difficulty from one unroll, propagation steps against
independently computed distances, the climb-shape statistic, and the stored-record figures."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import looplm
from looplm.errors import LoopLMError
from looplm.frontier.measure import (
    frontier_accuracy,
    propagation_steps,
    propagation_summary,
)
from looplm.frontier.section import (
    accuracy_grid,
    climb_shape,
    climb_table,
    extrapolation_by_seed,
    paired_accuracy_delta,
    plot_heatmap,
    plot_propagation,
)
from looplm.results.store import EvalRecord


def _graph_model():
    torch.manual_seed(0)
    return looplm.build_model(
        "tiny", "looped", d_model=32, n_heads=2, d_ff=64, dropout=0.0, attention="adjacency",
        positions="none",
    ).eval()  # fmt: skip


def _answering_graph_model():
    """A graph model whose readout always picks one of the two answers ("Y" / "N"): the answer
    rows of the tied embedding are ±u, every other row is small, so about half the answers are
    right and the counts say something (an untrained model's argmax almost never hits Y or N)."""
    model = _graph_model()
    with torch.no_grad():
        w = model.tok_emb.weight
        u = torch.randn(w.shape[1], generator=torch.Generator().manual_seed(3))
        w.mul_(1e-3)
        w[ord("Y")], w[ord("N")] = u, -u
    return model


def test_frontier_rows_match_a_direct_evaluation_per_depth() -> None:
    model = _answering_graph_model()
    rows = frontier_accuracy(model, "graph_nodes", [1, 3], [2, 4], n_examples=20, batch_size=8)
    assert [(r["difficulty"], r["depth"]) for r in rows] == [(2, 1), (2, 3), (4, 1), (4, 3)]
    # the same examples scored one depth at a time by a plain forward give the same counts and NLL
    from looplm.frontier.measure import _batches

    for r in rows:
        c = n = 0
        nll = 0.0
        for b in _batches("graph_nodes", r["difficulty"], 20, 8, model.config.context):
            valid = b.targets != -100
            with torch.no_grad():
                logits = model(b.input_ids, loops=r["depth"])[valid]
            c += int((logits.argmax(-1) == b.targets[valid]).sum())
            n += int(valid.sum())
            nll += float(F.cross_entropy(logits.float(), b.targets[valid], reduction="sum"))
        assert 0 < c < n  # neither all wrong nor all right: the comparison has teeth
        assert (r["n_correct"], r["n_examples"]) == (c, n)
        assert r["sum_nll"] == pytest.approx(nll, rel=1e-5)


def test_frontier_and_propagation_refuse_bad_input() -> None:
    model = _graph_model()
    with pytest.raises(LoopLMError, match="n_examples=0 must be a positive integer"):
        frontier_accuracy(model, "graph_nodes", [1], [2], n_examples=0)
    with pytest.raises(LoopLMError, match="max_loops=0 must be a positive integer"):
        propagation_steps(model, [2], 0)
    causal = looplm.build_model(
        "tiny", "looped", d_model=32, n_heads=2, d_ff=64, dropout=0.0, positions="none"
    ).eval()
    with pytest.raises(LoopLMError, match="model.attention=adjacency.*'causal'"):
        propagation_steps(causal, [2], 4, n_examples=4)
    from looplm.frontier.kind import Frontier, Propagation

    with pytest.raises(LoopLMError, match=r"evaluate.frontier.n_examples=-3 must be"):
        Frontier.configure({"frontier": {"depths": [1], "difficulties": [1], "n_examples": -3}})
    with pytest.raises(LoopLMError, match=r"evaluate.propagation.max_loops='8' must be"):
        Propagation.configure({"propagation": {"difficulties": [1], "max_loops": "8"}})


def test_propagation_steps_respect_distances_and_summary() -> None:
    p = propagation_steps(_graph_model(), [2, 3], 6, n_examples=16, batch_size=8)
    reach = p["distance"] > 0
    assert (p["min_step"][reach] == p["distance"][reach]).all()  # one hop per step at 0/1/0
    torch.manual_seed(0)
    deep = looplm.build_model(
        "tiny", "looped", d_model=32, n_heads=2, d_ff=64, dropout=0.0, attention="adjacency",
        positions="none", core_layers=2, prelude_layers=1,
    ).eval()  # fmt: skip
    q = propagation_steps(deep, [4], 4, n_examples=8, batch_size=8)
    r = q["distance"] > 0
    # one prelude layer takes the first hop, then two hops per loop step (worked out by hand)
    earliest = {1: 0, 2: 1, 3: 1, 4: 2}
    assert set(np.unique(q["distance"][r])) <= set(earliest)
    assert [earliest[int(d)] for d in q["distance"][r]] == q["min_step"][r].tolist()
    assert (q["min_step"][~r] == -1).all()
    n = p["distance"].size
    assert n == p["first_correct"].size == p["difficulty"].size
    assert set(np.unique(p["difficulty"])) == {2, 3}
    fake = {
        "distance": np.array([1, 2, 3, 1, 2, -1, 3]),
        "first_correct": np.array([1, 2, 3, 0, 4, 0, -1]),
        "difficulty": np.zeros(7, dtype=int),
    }
    s = propagation_summary(fake)
    assert s["n_reachable"] == 6 and s["n_reachable_correct"] == 5
    assert s["early"] == pytest.approx(1 / 5) and s["exact"] == pytest.approx(3 / 5)
    assert s["first_correct_by_distance"][2]["mean"] == 3.0


def test_climb_shape_separates_abrupt_from_gradual() -> None:
    T = [1, 2, 4, 8, 16]
    abrupt = climb_shape(T, [0.5, 0.5, 0.51, 0.98, 0.99])
    gradual = climb_shape(T, [0.55, 0.65, 0.75, 0.85, 0.95])
    assert abrupt["abrupt"] and abrupt["max_step_at"] == 8
    assert abrupt["max_step_share"] == pytest.approx(0.47 / 0.49)
    assert not gradual["abrupt"] and gradual["max_step_share"] == pytest.approx(0.25)
    assert abrupt["from_chance"] and not gradual["from_chance"]
    late = climb_shape(T + [32], [0.5, 0.6, 0.7, 0.8, 0.9, 0.52])  # rises, then falls past training
    assert not late["abrupt"] and late["max_step_share"] == pytest.approx(0.25)
    assert late["peak_at"] == 16 and late["drop_after_peak"] == pytest.approx(0.38)
    # one jump that starts well above chance: abrupt in shape, but not "from chance"
    jump = climb_shape(T, [0.7, 0.7, 0.7, 0.99, 0.99])
    assert jump["abrupt"] and not jump["from_chance"] and jump["start"] == pytest.approx(0.7)
    assert jump["max_step_share"] == pytest.approx(1.0) and jump["max_step_at"] == 8


def _rec(method, seed, d, T, c, n=100, **extra):
    return EvalRecord(
        method=method, protocol="p", dataset="graph_nodes", split=f"difficulty={d}", depth=T,
        seed=seed, n_tokens=n, sum_nll=1.0, extra={"n_correct": c, "n_examples": n, **extra},
    )  # fmt: skip


def test_reports_refuse_mixed_grids_and_skip_fixed_depth_climbs() -> None:
    from looplm.frontier.section import _train_range

    recs = [_rec("gated", 0, 1, T, 60 + 10 * T) for T in (1, 2, 4)]
    twin = dataclasses.replace(recs[1], model_hash="other", eval_tag="cap=9ex")
    with pytest.raises(LoopLMError, match="two frontier rows for method 'gated', seed 0, "
                       "difficulty 1, T=2"):  # fmt: skip
        accuracy_grid(recs + [twin], "gated")
    a = [_rec("gated", 0, 1, 1, 50, train_difficulty=[1, 3])]
    b = [_rec("gated", 1, 1, 1, 50, train_difficulty=[1, 4])]
    assert _train_range(a + a) == (1, 3)
    with pytest.raises(LoopLMError, match=r"different difficulty ranges \[\(1, 3\), \(1, 4\)\]"):
        _train_range(a + b)
    fixed = [_rec("unshared_6l", 0, 1, T, 50 + 5 * min(T, 6), fixed_depth=6) for T in (1, 4, 8)]
    rows = climb_table(recs + fixed, ["gated", "unshared_6l"])
    assert {r["method"] for r in rows} == {"gated"}


def test_grids_extrapolation_deltas_and_figures(tmp_path) -> None:
    recs = []
    for seed in (0, 1, 2):
        for d in (1, 2, 6):
            for T in (1, 4, 16):
                good = 95 if T >= d else 50
                recs += [
                    _rec("gated", seed, d, T, good),
                    _rec("per_step", seed, d, T, good - 5 * (d > 2)),
                ]
    diffs, depths, mean, std, n = accuracy_grid(recs, "gated")
    assert diffs == [1, 2, 6] and depths == [1, 4, 16] and n == 3
    assert mean[2, 2] == pytest.approx(0.95) and mean[2, 1] == pytest.approx(0.5)
    assert accuracy_grid(recs, "absent")[:2] == ([], [])  # a method without rows: empty grid
    a = extrapolation_by_seed(recs, "gated", above=2)
    b = extrapolation_by_seed(recs, "per_step", above=2)
    delta = paired_accuracy_delta(a, b)
    assert delta["delta"] == pytest.approx(0.05) and delta["seeds"] == [0, 1, 2]
    rows = climb_table(recs, ["gated"])
    assert {r["difficulty"] for r in rows} == {1, 2, 6}
    assert plot_heatmap(recs, ["gated", "per_step"], tmp_path / "h.png", title="t",
                        train_difficulty=(1, 2)).stat().st_size > 0  # fmt: skip
    pts = {"distance": np.array([1, 2, 2, -1]), "first_correct": np.array([1, 2, 3, 0])}
    assert plot_propagation(pts, tmp_path / "p.png", title="t").stat().st_size > 0
