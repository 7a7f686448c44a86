"""Frontier evaluation: accuracy over T × difficulty from one unroll, propagation steps against
independently computed distances, the climb-shape statistic, and the stored-record figures."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import looplm
from looplm.evaluate.frontier import (
    frontier_accuracy,
    propagation_steps,
    propagation_summary,
)
from looplm.results.frontier import (
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


def test_frontier_rows_match_a_direct_evaluation_per_depth() -> None:
    from looplm.data.synthetic import task_accuracy

    model = _graph_model()
    rows = frontier_accuracy(model, "graph_nodes", [1, 3], [2, 4], n_examples=20, batch_size=8)
    assert [(r["difficulty"], r["depth"]) for r in rows] == [(2, 1), (2, 3), (4, 1), (4, 3)]
    for r in rows:
        assert 0 <= r["n_correct"] <= r["n_examples"] and r["sum_nll"] > 0
    # the same examples scored one depth at a time by a plain forward give the same counts
    from looplm.evaluate.frontier import _batches

    for r in rows:
        c = n = 0
        for b in _batches("graph_nodes", r["difficulty"], 20, 8, model.config.context):
            valid = b.targets != -100
            pred = model(b.input_ids, loops=r["depth"])[valid].argmax(-1)
            c += int((pred == b.targets[valid]).sum())
            n += int(valid.sum())
        assert (r["n_correct"], r["n_examples"]) == (c, n)
    assert task_accuracy  # the per-batch evaluator of training stays available


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
    assert (q["min_step"][r] == np.ceil((q["distance"][r] - 1) / 2)).all()
    unshared = looplm.build_model(
        "tiny", "unshared", n_layers=3, d_model=32, n_heads=2, d_ff=64, dropout=0.0,
        attention="adjacency", positions="none",
    ).eval()  # fmt: skip
    u = propagation_steps(unshared, [2], 3, n_examples=8, batch_size=8)
    assert u["first_correct"].size > 0
    n = p["distance"].size
    assert n == p["first_correct"].size == p["difficulty"].size > 0
    assert set(np.unique(p["difficulty"])) <= {2, 3}
    assert bool((p["first_correct"] >= -1).all() and (p["first_correct"] <= 6).all())
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
    late = climb_shape(T + [32], [0.5, 0.6, 0.7, 0.8, 0.9, 0.52])  # rises, then falls past training
    assert not late["abrupt"] and late["max_step_share"] == pytest.approx(0.25)
    assert late["peak_at"] == 16 and late["drop_after_peak"] == pytest.approx(0.38)


def _rec(method, seed, d, T, c, n=100):
    return EvalRecord(
        method=method, protocol="p", dataset="graph_nodes", split=f"difficulty={d}", depth=T,
        seed=seed, n_tokens=n, sum_nll=1.0, extra={"n_correct": c, "n_examples": n},
    )  # fmt: skip


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
