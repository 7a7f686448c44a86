"""A results store as committed data (looplm.results.export): the line format, the round trip
into a store, and the paper report read from an export matching the one read from the store."""

from __future__ import annotations

import gzip
import json
import math
import subprocess
import sys

import pytest
import yaml

from looplm.errors import LoopLMError
from looplm.experiments import paper
from looplm.experiments.runner import load_experiment, run_experiment
from looplm.results import export as X
from looplm.results.export import load_records
from looplm.results.store import EvalRecord, ResultsStore
from tests.conftest import REPO
from tests.test_paper import _tiny_grid


def _records() -> list[EvalRecord]:
    diag = {"kind": "diagnostics", "checkpoint": "/home/someone/runs/x/ckpt.pt",
            "R_per_step": [0.0, 0.0], "gain_per_step": [1.2, 0.99995000000001],
            "anchor_energy_per_step": [1.0, 2.0],
            "per_step": {"ratio": [0.0, 0.0], "gain": [1.2, 0.99995000000001],
                         "bias_energy": [3.0, 4.0], "gain_std": [0.1, 0.2]},
            "steering": {"ray_cosine": {"min": 0.1}, "anchor_distance_per_step": [1.0]},
            "mean_depth": float("nan")}  # fmt: skip
    return [
        EvalRecord(
            method="scse",
            depth=8,
            seed=1,
            dataset="d",
            split="test",
            n_tokens=100,
            sum_nll=123.456789012345678,
            extra={"kind": "fixed"},
        ),
        EvalRecord(
            method="scse",
            depth=4,
            seed=0,
            eval_tag="diagnostics",
            n_tokens=10,
            sum_nll=1 / 3,
            extra=diag,
        ),
        EvalRecord(method="looped", depth=8, seed=0, n_tokens=100, sum_nll=250.0),
    ]


def test_export_is_sorted_lines_with_exact_numbers_and_nothing_unread(tmp_path) -> None:
    recs = _records()
    with ResultsStore(tmp_path / "a" / "results.sqlite") as st:
        st.put_many(recs)
    out = tmp_path / "data" / "a.jsonl"
    got = X.export_store(tmp_path / "a" / "results.sqlite", out)
    assert got["rows"] == 3 and got["bytes"] == out.stat().st_size
    lines = out.read_text().splitlines()
    rows = [json.loads(line) for line in lines]
    # one line per row, sorted by identity (method, then depth, ...), keys sorted, no spaces
    assert [(r["method"], r["depth"]) for r in rows] == [("looped", 8), ("scse", 4), ("scse", 8)]
    assert all(list(r) == sorted(r) and ", " not in line for r, line in zip(rows, lines))
    assert "created_at" not in rows[0] and "updated_at" not in rows[0]
    diag = rows[1]["extra"]
    assert "checkpoint" not in diag and "anchor_energy_per_step" not in diag
    assert set(diag["per_step"]) == {"ratio", "gain"} and set(diag["steering"]) == {"ray_cosine"}
    # the source store is untouched by the trimming (a deep copy)
    assert "checkpoint" in ResultsStore(tmp_path / "a" / "results.sqlite").query()[1].extra
    # round trip: numbers exact, identities equal, the trimmed extra kept
    back = X.read_export(out)
    assert [r.identity() for r in back] == sorted(r.identity() for r in recs)
    assert back[2].sum_nll == recs[0].sum_nll and back[1].sum_nll == 1 / 3
    assert back[1].extra["gain_per_step"][1] == 0.99995000000001
    assert math.isnan(back[1].extra["mean_depth"])
    # import into a fresh store and export again: the same bytes
    n = X.import_export(out, tmp_path / "b" / "results.sqlite")
    assert n == 3 and len(ResultsStore(tmp_path / "b" / "results.sqlite")) == 3
    again = tmp_path / "again.jsonl"
    X.export_store(tmp_path / "b" / "results.sqlite", again)
    assert again.read_bytes() == out.read_bytes()
    # the report layer reads an export directly
    assert [r.identity() for r in load_records(out)] == [r.identity() for r in back]


def test_compressed_export_is_reproducible_and_found_in_the_data_folder(tmp_path) -> None:
    recs = _records()
    a, b = tmp_path / "x.jsonl.gz", tmp_path / "y.jsonl.gz"
    X.write_export(recs, a)
    X.write_export(list(reversed(recs)), b)
    assert a.read_bytes() == b.read_bytes()  # no time stamp, order-independent
    assert gzip.decompress(a.read_bytes()).decode() == X.export_text(recs)
    assert [r.identity() for r in X.read_export(a)] == sorted(r.identity() for r in recs)
    store = tmp_path / "runs" / "grid" / "results.sqlite"
    assert X.data_file(tmp_path / "data", store) == tmp_path / "data" / "grid.jsonl"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / "grid.jsonl.gz").write_bytes(a.read_bytes())
    assert X.data_file(tmp_path / "data", store).name == "grid.jsonl.gz"


def test_bad_exports_are_one_line_errors(tmp_path) -> None:
    with pytest.raises(LoopLMError, match=r"must end in \.jsonl or \.jsonl\.gz"):
        X.write_export([], tmp_path / "x.json")
    with pytest.raises(LoopLMError, match="does not exist"):
        X.export_store(tmp_path / "none.sqlite", tmp_path / "x.jsonl")
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"method": "scse", "depth": 1, "seed": 0}\nnot json\n')
    with pytest.raises(LoopLMError, match=r"bad.jsonl:2: not a JSON line"):
        X.read_export(bad)
    bad.write_text('{"method": "scse", "depth": 1, "seed": 0, "colour": 1}\n')
    with pytest.raises(LoopLMError, match=r"bad.jsonl:1: unknown EvalRecord field"):
        X.read_export(bad)
    bad.write_text('{"method": "scse", "depth": 0, "seed": 0}\n')
    with pytest.raises(LoopLMError, match=r"bad.jsonl:1: EvalRecord.depth must be >= 1"):
        X.read_export(bad)
    packed = tmp_path / "bad.jsonl.gz"
    packed.write_bytes(b"not gzip")
    with pytest.raises(LoopLMError, match="is unreadable"):
        X.read_export(packed)


def test_cli_exports_and_imports(tmp_path) -> None:
    with ResultsStore(tmp_path / "g" / "results.sqlite") as st:
        st.put_many(_records())
    run = [sys.executable, "-m", "looplm", "results"]
    out = subprocess.run([*run, "export", str(tmp_path / "g" / "results.sqlite"), "--out",
                          str(tmp_path / "g.jsonl")], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["rows"] == 3, out.stderr
    out = subprocess.run([*run, "import", str(tmp_path / "g.jsonl"), "--store",
                          str(tmp_path / "h.sqlite")], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 0 and json.loads(out.stdout)["rows"] == 3, out.stderr
    out = subprocess.run([*run, "import", str(tmp_path / "g.txt"), "--store",
                          str(tmp_path / "h.sqlite")], cwd=REPO, capture_output=True, text=True)  # fmt: skip
    assert out.returncode == 2 and "must end in .jsonl" in out.stderr


def test_paper_report_from_the_export_is_the_report_from_the_store(tmp_path) -> None:
    """A clean clone regenerates the page: the entry's report read from its grid's export (in a
    data folder) equals the one read from the store, verdicts and figure links included."""
    _tiny_grid(tmp_path)
    child = tmp_path / "table22.yaml"
    diag = {"split": "test", "loops": 3, "batches": 1, "batch_size": 2, "steer_inputs": 0}
    child.write_text(yaml.safe_dump({
        "extends": "grid.yaml", "methods": ["scse", "looped"], "seeds": [0, 1],
        "evaluate": {"diagnostics": diag},
        "paper": {"id": "table22", "reported": [
            {"method": "looped", "metric": "gain", "step": 2, "value": 1.0},
            {"method": "scse", "reference": "looped", "depth": 4, "metric": "delta_ppl",
             "value": -1.0}],
            "claims": [
                {"text": "R_t is zero", "test": "construction", "method": "scse",
                 "metric": "R", "steps": [0, 2], "equals": 0},
                {"text": "scse beats looped", "test": "ordering", "method": "scse",
                 "than": ["looped"], "depths": [1, 4]}]},
    }))  # fmt: skip
    run_experiment(child, progress=False, report=False)
    entry, store = paper.load_entry(child), load_experiment(child).store
    data = tmp_path / "data"
    missing = paper.entry_report(entry, data=data)
    assert f"data {data / 'runs.jsonl'} (export of {store}), not committed yet, 0 rows" in missing
    X.export_store(store, data / "runs.jsonl")
    kw = {"figures_dir": tmp_path / "fig", "link_base": tmp_path}
    from_store = paper.entry_report(entry, **kw)
    from_data = paper.entry_report(entry, data=data, **kw)  # draws from the trimmed rows
    assert paper.entry_report(entry, data=data, draw=False, **kw) == from_data  # links only
    head = "Measured (CPU analogue): "
    assert f"{head}store {store}, " in from_store
    assert f"{head}data {data / 'runs.jsonl'} (export of {store}), " in from_data

    def body(text: str) -> list[str]:
        return [line for line in text.splitlines() if not line.startswith(head)]

    assert body(from_data) == body(from_store)
    assert "| R_t is zero | **holds by construction** |" in from_data
    assert "](fig/table22/anchor_steps.png)" in from_data
