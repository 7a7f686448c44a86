"""The sweep runner: a tiny grid trains, evaluates into the store and reports; re-running skips
finished training and evaluations and leaves exactly one row per evaluation identity."""

from __future__ import annotations

import json
import random

import pytest
import torch
import yaml

from looplm.errors import LoopLMError
from looplm.evaluate.records import eval_tag, model_hash
from looplm.experiments.runner import load_experiment, run_experiment
from looplm.results.store import IDENTITY_FIELDS, ResultsStore

WORDS = "the a cat dog sat ran on under mat log and then it was big small red".split()


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # the sweep sets torch_threads: 1


def _text(rng: random.Random, n_words: int) -> str:
    lines = []
    for _ in range(n_words // 12):
        lines.append(" ".join(rng.choice(WORDS) for _ in range(12)) + " .")
    return "\n".join(lines) + "\n"


def make_experiment(tmp_path, steps: int = 4) -> str:
    rng = random.Random(0)
    corpus = tmp_path / "corpus"
    corpus.mkdir(exist_ok=True)
    for name, n in (("train.txt", 3000), ("valid.txt", 600), ("test.txt", 600)):
        (corpus / name).write_text(_text(rng, n))
    other = tmp_path / "other.txt"
    other.write_text(_text(random.Random(1), 300).upper())
    lam = tmp_path / "l.jsonl"
    lam.write_text("".join(json.dumps({"text": _text(rng, 24).strip()}) + "\n" for _ in range(3)))
    cfg = {
        "name": "t",
        "out_root": str(tmp_path / "runs"),
        "torch_threads": 1,
        "protocol": "tiny-test",
        "base": {
            "model": {
                "preset": "tiny",
                "d_model": 32,
                "n_heads": 2,
                "d_ff": 64,
                "context": 16,
                "dropout": 0.0,
            },
            "data": {"dataset": f"text:{corpus}", "cache_dir": str(tmp_path / "cache")},
            "train": {
                "steps": steps,
                "batch_size": 8,
                "warmup": 1,
                "log_every": 2,
                "depth_max": 4,
                "device": "cpu",
            },
        },
        "methods": ["scse", "looped"],
        "seeds": [0, 1],
        "evaluate": {
            "split": "test",
            "max_tokens": 256,
            "depths": "1-4",
            "batch_size": 16,
            "adaptive": {
                "ceiling": 6,
                "budgets": [2, 4],
                "kl_thresholds": [1e-3],
                "router_probs": [0.5],
                "calib_split": "validation",
                "calib_max_tokens": 512,
                "timing_depths": [2, 6],
            },
            "transfer": [
                {"dataset": f"text:{other}", "split": "all", "max_tokens": 128, "depths": [1, 4]}
            ],
            "lambada": {"path": str(lam), "max_examples": 3, "depths": [1, 4]},
        },
        "report": {"seeds": [0, 1], "train_depth_max": 4},
    }
    path = tmp_path / "exp.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return str(path)


def test_sweep_runs_resumes_and_keeps_one_row_per_identity(tmp_path):
    path = make_experiment(tmp_path)
    exp = load_experiment(path)
    assert len(exp.runs) == 4 and len({r.model_hash for r in exp.runs}) == 2  # seed-free hash
    first = run_experiment(path, progress=False)
    per_run = 4 + 4 + 2 + 2  # fixed depths, adaptive modes, transfer depths, LAMBADA depths
    assert first["trained"] == 4 and first["rows_written"] == 4 * per_run
    store_path = exp.store
    recs = ResultsStore(store_path).query()
    assert len(recs) == 4 * per_run
    assert len({r.identity() for r in recs}) == len(recs)
    adaptive = [r for r in recs if r.adaptive_mode]
    assert {r.adaptive_mode for r in adaptive} == {
        "maxtoken:budget=2",
        "maxtoken:budget=4",
        "kl:thr=0.001",
        "router:p=0.5",
    }
    assert all(r.depth == 6 and 1 <= r.extra["mean_depth"] <= 6 for r in adaptive)
    assert {r.calibration for r in adaptive if r.adaptive_mode.startswith("maxtoken")} == {
        "validation@512tok"
    }
    assert {r.eval_tag for r in recs if r.dataset == "lambada"} == {"cap=3ex"}
    assert (exp.report_dir / "report.md").is_file()
    assert "Adaptive depth" in (exp.report_dir / "supplement.md").read_text()
    ckpt = exp.runs[0].ckpt / "state.json"
    mtime = ckpt.stat().st_mtime_ns
    stamps = {r.identity(): r.updated_at for r in recs}

    second = run_experiment(path, progress=False)
    assert second["trained"] == 0 and second["skipped_training"] == 4
    assert second["rows_written"] == 0 and second["evals_skipped"] == 4 * per_run
    assert ckpt.stat().st_mtime_ns == mtime
    again = ResultsStore(store_path).query()
    assert {r.identity(): r.updated_at for r in again} == stamps  # nothing rewritten

    # lose two rows: only those are recomputed
    with ResultsStore(store_path) as store:
        assert store.delete(method="looped", adaptive_mode="kl:thr=0.001") == 2
    third = run_experiment(path, progress=False, report=False)
    assert third["rows_written"] == 2 and third["evals_skipped"] == 4 * per_run - 2
    final = ResultsStore(store_path).query()
    assert len(final) == 4 * per_run == len({r.identity() for r in final})

    # --redo recomputes one kind of evaluation and replaces its rows in place
    fourth = run_experiment(path, progress=False, report=False, train=False, redo=["lambada"])
    assert fourth["rows_written"] == 4 * 2 and fourth["trained"] == 0
    redone = ResultsStore(store_path).query()
    assert len(redone) == len(final) == len({r.identity() for r in redone})
    with pytest.raises(LoopLMError, match="redo"):
        run_experiment(path, progress=False, redo=["bogus"])


def test_changed_training_config_under_existing_run_is_an_error(tmp_path):
    path = make_experiment(tmp_path)
    run_experiment(path, progress=False, report=False)
    changed = make_experiment(tmp_path, steps=5)
    with pytest.raises(LoopLMError, match="different config"):
        run_experiment(changed, progress=False, report=False)


def test_identity_helpers():
    from looplm.settings.config import load_config

    a = load_config(None, ["train.seed=0", "train.device=cpu"])
    b = load_config(None, ["train.seed=3", "train.log_every=7"])
    c = load_config(None, ["train.lr=0.001"])
    assert model_hash(a) == model_hash(b) != model_hash(c)
    assert eval_tag("x", max_tokens=4096) == "x,cap=4096tok" and eval_tag("") == ""
    assert eval_tag(max_examples=5) == "cap=5ex"
    # the store keys rows by all identity fields, seed and eval tag included
    assert {"model_hash", "seed", "eval_tag", "adaptive_mode"} <= set(IDENTITY_FIELDS)


def test_bad_experiment_configs(tmp_path):
    p = tmp_path / "bad.yaml"
    p.write_text(yaml.safe_dump({"base": {}, "methods": ["scse"], "bogus": 1}))
    with pytest.raises(LoopLMError, match="unknown key experiment.bogus"):
        load_experiment(p)
    p.write_text(yaml.safe_dump({"base": {}, "methods": ["nope"]}))
    with pytest.raises(LoopLMError, match="unknown recurrence|nope"):
        load_experiment(p)
    p.write_text(
        yaml.safe_dump({"base": {}, "methods": ["scse"], "evaluate": {"adaptive": {"ceil": 3}}})
    )
    with pytest.raises(LoopLMError, match="evaluate.adaptive.ceil"):
        load_experiment(p)


def test_method_entries_name_a_recurrence_with_its_own_settings(tmp_path) -> None:
    path = make_experiment(tmp_path)
    raw = yaml.safe_load(open(path))
    raw["methods"] = [
        "scse",
        {
            "name": "looped_alpha",
            "recurrence": "looped",
            "args": {"learn_gain": True, "injection_gain": 0.15},
            "overrides": ["model.init=depth_scaled"],
        },
    ]
    raw["seeds"] = [0]
    (tmp_path / "m.yaml").write_text(yaml.safe_dump(raw))
    exp = load_experiment(tmp_path / "m.yaml")
    by = {r.method: r for r in exp.runs}
    cfg = by["looped_alpha"].cfg
    assert cfg.model.recurrence == "looped" and cfg.method_label == "looped_alpha"
    assert cfg.model.recurrence_args == {"learn_gain": True, "injection_gain": 0.15}
    assert cfg.model.init == "depth_scaled" and by["scse"].cfg.model.init == "normal"
    assert by["scse"].cfg.method_label == "scse"
    assert by["looped_alpha"].run_dir.parts[-2:] == ("looped_alpha", "seed0")
    raw["methods"] = ["scse", {"name": "scse"}]
    (tmp_path / "d.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(LoopLMError, match="method name 'scse' appears twice"):
        load_experiment(tmp_path / "d.yaml")
    raw["methods"] = [{"name": "x", "recurrence": "nope"}]
    (tmp_path / "u.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(LoopLMError, match="unknown recurrence 'nope'"):
        load_experiment(tmp_path / "u.yaml")


def test_full_section_extends_the_default_grid(tmp_path) -> None:
    path = make_experiment(tmp_path)
    raw = yaml.safe_load(open(path))
    raw["full"] = {"seeds": [0, 1, 2], "base": {"train": {"steps": 9}}}
    (tmp_path / "f.yaml").write_text(yaml.safe_dump(raw))
    small = load_experiment(tmp_path / "f.yaml")
    big = load_experiment(tmp_path / "f.yaml", full=True)
    assert len(small.runs) == 4 and len(big.runs) == 6
    assert {r.cfg.train.steps for r in big.runs} == {9} and small.runs[0].cfg.train.steps == 4
    assert big.runs[0].cfg.model.d_model == small.runs[0].cfg.model.d_model  # merged, not replaced
    with pytest.raises(LoopLMError, match="has no 'full' section"):
        load_experiment(path, full=True)
    raw["full"] = {"bogus": 1}
    (tmp_path / "b.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(LoopLMError, match="unknown key full.bogus"):
        load_experiment(tmp_path / "b.yaml", full=True)


def test_sweep_does_not_retrain_a_cell_whose_evaluations_are_all_stored(tmp_path):
    """A grid whose checkpoints are gone but whose rows were kept (e.g. imported from a committed
    export) trains only the cells with a missing row."""
    import shutil

    path = make_experiment(tmp_path)
    exp = load_experiment(path)
    run_experiment(path, progress=False, report=False)
    for plan in exp.runs:
        shutil.rmtree(plan.run_dir / "ckpt")
    with ResultsStore(exp.store) as store:
        assert (
            store.delete(method="looped", seed=1, depth=2, dataset=exp.runs[0].cfg.data.dataset)
            == 1
        )
    again = run_experiment(path, progress=False, report=False)
    assert again["trained"] == 1 and again["skipped_training"] == 3
    assert again["rows_written"] == 1
    assert [p.has_checkpoint for p in exp.runs].count(True) == 1
