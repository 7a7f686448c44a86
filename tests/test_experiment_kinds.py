"""The frontier, propagation and scaling evaluation kinds inside real (tiny) sweeps, and the
report sections they feed."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from looplm.experiments.runner import run_experiment
from looplm.results.store import ResultsStore
from tests.test_experiments import make_experiment


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


TINY = {"d_model": 16, "n_heads": 2, "d_ff": 32, "dropout": 0.0}


def test_frontier_and_propagation_rows_and_report(tmp_path) -> None:
    cfg = {
        "name": "f",
        "out_root": str(tmp_path / "runs"),
        "torch_threads": 1,
        "base": {
            "model": {"preset": "tiny", **TINY, "attention": "adjacency", "positions": "none"},
            "data": {"dataset": "graph_nodes", "train_difficulty": [1, 2]},
            "train": {"steps": 3, "batch_size": 4, "warmup": 1, "depth_max": 3, "device": "cpu"},
            "eval": {"n_examples": 8},
        },
        "methods": [
            "looped",
            {
                "name": "looped_ps",
                "recurrence": "looped",
                "overrides": ["train.objective=per_step"],
            },
        ],  # fmt: skip
        "seeds": [0, 1],
        "evaluate": {
            "depths": [1, 3],
            "frontier": {"depths": [1, 2, 4], "difficulties": [1, 2, 3], "n_examples": 6},
            "propagation": {"difficulties": [2], "max_loops": 4, "n_examples": 4},
        },
        "report": {"seeds": [0, 1], "reference": "looped"},
    }
    path = tmp_path / "f.yaml"
    path.write_text(yaml.safe_dump(cfg))
    out = run_experiment(path, progress=False)
    per_run = 2 + 3 * 3 + 1  # fixed depths, frontier cells, propagation
    assert out["rows_written"] == 4 * per_run
    recs = ResultsStore(tmp_path / "runs" / "results.sqlite").query()
    front = [r for r in recs if r.split.startswith("difficulty=")]
    assert len(front) == 4 * 9 and all(r.extra["train_difficulty"] == [1, 2] for r in front)
    assert {r.eval_tag for r in front} == {"cap=6ex"}
    prop = [r for r in recs if r.split == "propagation"]
    assert len(prop) == 4 and all(len(r.extra["distance"]) == r.n_tokens for r in prop)
    md = (tmp_path / "runs" / "report" / "report.md").read_text()
    assert (
        "Computational frontier" in md
        and "Extrapolation: accuracy pooled over difficulties > 2" in md
    )
    assert "Propagation depth" in md and "looped_ps" in md
    res = json.loads((tmp_path / "runs" / "report" / "results.json").read_text())
    assert res["frontier"][0]["grid"]["looped"]["difficulties"] == [1, 2, 3]
    assert run_experiment(path, progress=False)["rows_written"] == 0  # resumable


def test_scaling_rows_carry_the_fit_inputs(tmp_path) -> None:
    path = make_experiment(tmp_path, steps=2)
    raw = yaml.safe_load(open(path))
    raw["methods"] = ["looped"]
    raw["seeds"] = [0]
    raw["base"]["model"].update(prelude_layers=1, coda_layers=1)
    raw["variants"] = [
        {
            "name": f"r{r}",
            "overrides": [
                f"model.core_layers={4 // r}",
                f"train.depth_min={r}",
                f"train.depth_max={r}",
            ],
        }  # fmt: skip
        for r in (1, 2, 4)
    ]
    raw["evaluate"] = {
        "depths": [1],
        "max_tokens": 128,
        "scaling": {"split": "valid", "max_tokens": 128},
    }
    (tmp_path / "s.yaml").write_text(yaml.safe_dump(raw))
    run_experiment(tmp_path / "s.yaml", progress=False, report=False)
    recs = ResultsStore(tmp_path / "runs" / "results.sqlite").query()
    pts = sorted((r for r in recs if "n_rec" in r.extra), key=lambda r: r.extra["r"])
    assert [r.extra["r"] for r in pts] == [1, 2, 4] and [r.depth for r in pts] == [1, 2, 4]
    per_layer = pts[2].extra["n_rec"]  # r = 4: a one-layer core
    assert [r.extra["n_rec"] for r in pts] == [4 * per_layer, 2 * per_layer, per_layer]
    assert len({r.extra["n_once"] for r in pts}) == 1
    assert all(r.extra["train_tokens"] == 2 * 8 * 16 for r in pts)
    assert all(r.eval_tag.startswith("scaling") for r in pts)
    assert (
        len({r.protocol for r in pts}) == 3
    )  # one protocol per training variant, one sweep protocol
    assert {r.extra["sweep_protocol"] for r in pts} == {pts[0].protocol.rsplit("-", 1)[0]}
