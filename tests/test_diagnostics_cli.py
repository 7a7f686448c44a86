"""`looplm diagnose` end to end on tiny checkpoints made here (CPU, bool_logic inputs)."""

from __future__ import annotations

import json

import pytest
import torch

from looplm import build_model
from looplm.cli import main
from looplm.model.checkpoint import save_checkpoint
from looplm.results.store import ResultsStore
from looplm.settings.config import load_config


@pytest.fixture(autouse=True)
def _one_thread():
    """These tensors are tiny: one intra-op thread is faster, much faster on a busy shared CPU."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _checkpoint(path, recurrence: str):
    # the tiny preset, narrowed further so the test stays fast on a shared CPU
    cfg = load_config(
        None,
        [
            "model.preset=tiny",
            f"model.recurrence={recurrence}",
            "model.dropout=0.0",
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            f"name=tiny-{recurrence}",
        ],
    )
    torch.manual_seed(0)
    model = build_model("tiny", recurrence, dropout=0.0, d_model=32, n_heads=2, d_ff=64)
    save_checkpoint(path, model, cfg, state={"step": 0})
    return str(path)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpts")
    return {r: _checkpoint(root / r, r) for r in ("scse", "looped")}


def test_diagnose_cli_writes_numbers_figures_and_store(ckpts, tmp_path, capsys):
    out, store = tmp_path / "diag", tmp_path / "results.sqlite"
    argv = ["diagnose", ckpts["scse"], ckpts["looped"], "--out", str(out), "--loops", "3"]
    argv += ["--batches", "1", "--batch-size", "2", "--steer-inputs", "2", "--check-steps", "2"]
    argv += ["--store", str(store)]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "scse" in printed and "looped" in printed
    for name in ("summary.json", "r_t.png", "anchor_steps.png", "convergence.png"):
        assert (out / name).stat().st_size > 0, name
    for label in ("scse", "looped"):
        for name in ("diagnostics.json", "steering.npz", "steering.png"):
            assert (out / label / name).stat().st_size > 0, (label, name)
    scse = json.loads((out / "scse" / "diagnostics.json").read_text())
    looped = json.loads((out / "looped" / "diagnostics.json").read_text())
    assert scse["method"] == "scse" and scse["data"]["dataset"] == "bool_logic"
    assert scse["per_step"]["ratio"] == [0.0, 0.0, 0.0]
    assert scse["summary"]["bias_max_abs"] == 0.0 and scse["summary"]["raw_bias_max_abs"] == 0.0
    assert scse["summary"]["anchor_energy_last"] > 0
    assert scse["counterfactual"]["check"]["trivial"] is True
    assert looped["summary"]["bias_max_abs"] > 0 and looped["summary"]["R_t0"] > 0
    assert looped["counterfactual"]["check"]["lemma1_max_rel_error"] < 1e-4
    assert len(looped["convergence"]["kl_per_loop"]) == 3
    assert looped["steering"]["dose"]["source_channel"] is True
    with ResultsStore(store) as s:
        rows = s.query(eval_tag="diagnostics")
    assert sorted(r.method for r in rows) == ["looped", "scse"]
    assert all(r.depth == 3 and r.n_tokens > 0 for r in rows)
    assert rows[0].extra["R_per_step"] is not None


def test_diagnose_cli_rerun_updates_store_without_duplicates(ckpts, tmp_path):
    out, store = tmp_path / "d", tmp_path / "r.sqlite"
    argv = ["diagnose", ckpts["looped"], "--out", str(out), "--loops", "2", "--batches", "1"]
    argv += ["--batch-size", "1", "--steer-inputs", "1", "--check-steps", "0", "--no-plots"]
    argv += ["--store", str(store)]
    assert main(argv) == 0 and main(argv) == 0
    with ResultsStore(store) as s:
        assert len(s) == 1
    assert not (out / "r_t.png").exists()


def test_diagnose_cli_bad_input_is_one_line_error(ckpts, tmp_path, capsys):
    assert main(["diagnose", ckpts["scse"], "--loops", "0", "--out", str(tmp_path)]) == 2
    assert "loop depth T must be" in capsys.readouterr().err
    assert main(["diagnose", str(tmp_path / "missing"), "--out", str(tmp_path)]) == 2
    assert "does not exist" in capsys.readouterr().err
    cfg = load_config(None, ["model.preset=tiny", "model.recurrence=unshared", "model.n_layers=1"])
    save_checkpoint(tmp_path / "u", build_model("tiny", "unshared", n_layers=1), cfg)
    assert main(["diagnose", str(tmp_path / "u"), "--out", str(tmp_path)]) == 2
    err = capsys.readouterr().err
    assert err.startswith("error:") and "looped model" in err
