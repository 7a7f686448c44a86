"""The paper as code: every table/figure config's --full section against the paper's stated
protocol, the catalogue, reuse of shared grids, the diagnostics evaluation kind inside a sweep,
the paper-vs-measured report, and a killed grid resuming without retraining finished cells."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch
import yaml

from looplm.errors import LoopLMError
from looplm.experiments import paper
from looplm.experiments.paper.report import one_per_checkpoint
from looplm.experiments.runner import load_experiment, run_experiment
from looplm.results.store import ResultsStore
from tests.conftest import REPO
from tests.test_experiments import make_experiment

CONFIGS = REPO / "configs" / "paper"


@pytest.fixture(autouse=True, scope="module")
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)  # sweeps set torch_threads: 1


# --------------------------------------------------------------------------- the paper's protocol
# What the paper states (Appendix "Experimental Setup Details", "Seed Protocol and Aggregation",
# the table captions and their paragraphs): width, heads, SwiGLU width per scale; steps, tokens
# per optimizer step, corpus, evaluation depths, seeds and methods per table.
SIZES = {
    "22m": (384, 6, 1536),
    "50m": (768, 12, 3072),
    "95.6m": (1280, 20, 5120),
    "136.5m": (1664, 26, 6656),
    "4x320": (320, 5, 1280),
    "6x288": (288, 6, 1152),
}
DEPTHS = [4, 8, 12, 16, 24, 32, 48]
C4_DEPTHS = [4, 8, 16, 24, 32, 48, 96]
WT103 = {"dataset": "wikitext-103", "steps": 5000, "tokens_per_step": 4096, "depths": DEPTHS}
TIERS3 = {"": "22m", "50m": "50m", "95.6m": "95.6m"}
ADDITIVE = {"looped", "tuned_adapter", "step_conditioned"}
PROTOCOL = {
    "table01": {**WT103, "tiers": TIERS3, "seeds": 5, "methods": ADDITIVE | {"scse"}},
    "table02": {**WT103, "tiers": {"": "22m"}, "seeds": 3, "methods": {
        "scse", "scse_anchor_embedding", "scse_anchor_init", "scse_anchor_frozen_random"}},
    "table03": {**WT103, "tiers": TIERS3, "seeds": 3, "methods": ADDITIVE | {"scse"},
                "diagnostics_loops": 48},
    "table05": {**WT103, "tiers": {"": "22m"}, "seeds": 5,
                "methods": {"looped", "capacity_matched", "tuned_adapter", "scse", "step_film",
                            "unshared_4x320", "unshared_6x288"}},
    "table06": {**WT103, "tiers": {"50m": "50m"}, "seeds": 5, "methods": {"looped", "scse"}},
    "table07": {**WT103, "tiers": {"95.6m": "95.6m"}, "seeds": 5,
                "methods": {"looped", "tuned_adapter", "scse"}},
    "table08": {**WT103, "steps": 10000, "tiers": {"95.6m": "95.6m"}, "seeds": 5,
                "methods": {"step_conditioned", "scse"}},
    "table09": {**WT103, "tiers": {"": "22m"}, "seeds": 5, "methods": ADDITIVE | {"scse"},
                "adaptive": (48, [8, 16, 24])},
    "table10": {**WT103, "tiers": {"50m": "50m", "95.6m": "95.6m"}, "seeds": 5,
                "methods": ADDITIVE | {"scse"}, "adaptive": (48, [8, 16, 24])},
    "table11": {**WT103, "tiers": {"50m": "50m", "95.6m": "95.6m"}, "seeds": 1,
                "methods": ADDITIVE | {"scse"}},
    "table12": {**WT103, "tiers": {"ctx512": "22m", "ctx1024": "22m"}, "seeds": 5,
                "methods": {"looped", "tuned_adapter", "scse", "transformer8"},
                "context": {"ctx512": 512, "ctx1024": 1024}},
    "table13": {**WT103, "dataset": "openwebtext", "tiers": {"": "22m"}, "seeds": 3,
                "methods": ADDITIVE | {"scse", "capacity_matched", "unshared_4x320",
                                       "unshared_6x288", "transformer8"}},
    "table14": {**WT103, "dataset": "c4", "tiers": {"": "22m"}, "seeds": 5,
                "methods": ADDITIVE | {"scse", "capacity_matched", "unshared_4x320",
                                       "unshared_6x288", "transformer8"}},
    "table15": {**WT103, "tiers": TIERS3, "seeds": 3,
                "methods": ADDITIVE | {"scse", "transformer8"},
                "transfer": {("openwebtext", "validation"), ("c4", "validation")}},
    "table16": {**WT103, "tiers": TIERS3, "seeds": 5,
                "methods": ADDITIVE | {"scse", "transformer8"}, "lambada": True},
    "table17": {"dataset": "c4", "steps": 5000, "tokens_per_step": 4096, "depths": C4_DEPTHS,
                "tiers": {"": "136.5m"}, "seeds": 3, "lr": 2.5e-4,
                "methods": {"tuned_adapter", "step_conditioned", "scse"}},
    "table18": {"dataset": "c4", "steps": 50000, "tokens_per_step": 4096, "depths": C4_DEPTHS,
                "tiers": {"": "136.5m"}, "seeds": 3, "lr": 2.5e-4,
                "methods": {"tuned_adapter", "step_conditioned", "scse"}},
    "table19": {"dataset": "wikitext-2", "steps": 1200, "tokens_per_step": 4096,
                "depths": DEPTHS, "tiers": {"": "22m"}, "seeds": 3,
                "methods": {"scse", "norm_reset", "capacity_matched",
                            "looped", "tuned_adapter"}},  # Figure 4's model, the reference
    "table20": {**WT103, "tiers": {"": "22m"}, "seeds": 3, "diagnostics_loops": 48,
                "methods": {"tuned_adapter", "step_conditioned", "scse", "sc_cond",
                            "sc_cond_nomask", "sc_cond_subtractive", "forcing_subtraction"}},
    "table21": {**WT103, "tiers": {"": "22m"}, "seeds": 5, "methods": {"scse", "scse_leak"}},
    "table22": {**WT103, "tiers": {"": "22m"}, "seeds": 3, "methods": ADDITIVE | {"scse"},
                "diagnostics_loops": 48},
    "figure3": {**WT103, "tiers": {"95.6m": "95.6m"}, "seeds": 5, "methods": ADDITIVE | {"scse"}},
    "figure4": {"dataset": "wikitext-2", "steps": 1200, "tokens_per_step": 4096,
                "depths": DEPTHS, "tiers": {"": "22m"}, "seeds": 1,
                "methods": {"looped", "tuned_adapter", "scse"}, "steer_inputs": 6},
    "figure5": {**WT103, "tiers": TIERS3, "seeds": 3, "methods": ADDITIVE | {"scse"},
                "diagnostics_loops": 48},
    "convergence": {**WT103, "depths": [1, 2, 3, 4, 5, 6, 7, 8, 12, 16, 24, 32],
                    "tiers": {"": "22m"}, "seeds": 3,
                    "methods": {"looped", "tuned_adapter", "scse"}, "diagnostics_loops": 32},
}  # fmt: skip
# Parameter counts the paper states for its models (millions); its "95.6M" and "136.5M"
# shared-block LMs are the tuned-adapter layout (tests/test_param_counts.py).
PARAMS = {("22m", "scse"): 22.0, ("95.6m", "tuned_adapter"): 95.6,
          ("136.5m", "tuned_adapter"): 136.5,
          ("136.5m", "step_conditioned"): 139.2, ("4x320", "unshared"): 22.7,
          ("6x288", "unshared"): 22.5}  # fmt: skip


def _size(cfg) -> str:
    m = cfg.model
    dims = (m.d_model, m.n_heads, m.d_ff)
    return next(k for k, v in SIZES.items() if v == dims)


def _n_params(cfg) -> float:
    from looplm.model import model_from_config

    with torch.device("meta"):
        return model_from_config(cfg.model).num_parameters() / 1e6


def test_every_entry_has_a_config_and_the_full_sections_follow_the_paper() -> None:
    entries = paper.catalogue()
    assert [e.id for e in entries] == list(paper.ENTRY_IDS)
    assert set(PROTOCOL) == {e.id for e in entries if e.is_experiment}
    checked_params = set()
    for e in entries:
        if not e.is_experiment:
            continue
        want = PROTOCOL[e.id]
        exp = e.experiment(full=True)
        where = f"{e.id} --full"
        assert {p.method for p in exp.runs} == want["methods"], where
        assert {p.variant for p in exp.runs} == set(want["tiers"]), where
        for p in exp.runs:
            c, t, m = p.cfg, p.cfg.train, p.cfg.model
            here = f"{where}: {p.label}"
            assert c.data.dataset == want["dataset"], here
            assert t.steps == want["steps"], here
            context = want.get("context", {}).get(p.variant, 128)
            assert m.context == context, here
            assert t.batch_size * t.grad_accum * m.context == want["tokens_per_step"], here
            assert t.lr == pytest.approx(want.get("lr", 3e-4)), here
            assert (t.warmup, t.weight_decay, t.clip) == (500, 0.1, 1.0), here
            assert (t.beta1, t.beta2) == (0.9, 0.95), here
            assert m.dropout == 0.1 and t.autocast == "auto" and t.device == "auto", here
            if m.is_looped:  # train-time loop depth sampled uniformly from 1..8
                assert (t.depth_min, t.depth_max) == (1, 8), here
                assert _size(c) == want["tiers"][p.variant], here
            else:  # unshared: trained at its own depth; Transformer-8 at the 22M width
                assert t.depth_min == t.depth_max == m.n_layers, here
                expect = {"unshared_4x320": "4x320", "unshared_6x288": "6x288"}
                assert _size(c) == expect.get(p.method, "22m"), here
            key = (_size(c), m.recurrence if m.recurrence != "unshared" else "unshared")
            if key in PARAMS and key not in checked_params:
                assert _n_params(c) == pytest.approx(PARAMS[key], abs=0.06), here
                checked_params.add(key)
        seeds = sorted({p.seed for p in exp.runs})
        assert seeds == list(range(want["seeds"])), where
        assert exp.evaluate["depths"] == want["depths"], where
        ev = exp.evaluate
        assert ev.get("max_tokens") is None, f"{where}: the full protocol scores whole splits"
        if "diagnostics_loops" in want:
            assert ev["diagnostics"]["loops"] == want["diagnostics_loops"], where
        if "steer_inputs" in want:
            assert ev["diagnostics"]["steer_inputs"] == want["steer_inputs"], where
        if "adaptive" in want:
            a = ev["adaptive"]
            assert (a["ceiling"], a["budgets"], a["rules"]) == (*want["adaptive"], ["maxtoken"])
            assert a["calib_split"] == "validation" and a.get("calib_max_tokens") is None
        if "transfer" in want:
            assert {(x["dataset"], x["split"]) for x in ev["transfer"]} == want["transfer"]
        if want.get("lambada"):
            assert ev["lambada"]["max_examples"] is None
    assert checked_params == set(PARAMS)
    # the anchor ablation's anchors are the paper's four
    anchors = {
        p.method: (p.cfg.model.recurrence_args or {}).get("anchor", "learned")
        for p in paper.find_entry("table02").experiment(full=True).runs
    }
    assert anchors == {
        "scse": "learned",
        "scse_anchor_embedding": "embedding",
        "scse_anchor_init": "init",
        "scse_anchor_frozen_random": "frozen_random",
    }


def test_every_grid_dry_runs_on_a_clean_clone(tmp_path, monkeypatch, capsys) -> None:
    monkeypatch.chdir(tmp_path)  # no run folders here: nothing exists yet
    monkeypatch.delenv("LOOPLM_DATA_DIR", raising=False)
    for path in sorted(CONFIGS.glob("*.yaml")):
        entry = yaml.safe_load(path.read_text()).get("paper") or {}
        if entry.get("experiment") is False:
            with pytest.raises(LoopLMError, match="no experiment"):
                paper.find_entry(path.stem).experiment()
            continue
        for full in (False, True):
            out = run_experiment(path, dry_run=True, full=full)
            assert out["runs"] > 0 and out["trained"] == 0, path.name
    err = capsys.readouterr().err
    assert "checkpoint exists" not in err


def test_entries_that_reuse_a_grid_train_nothing_new() -> None:
    for e in paper.catalogue():
        reuses = e.meta.get("reuses")
        if not reuses:
            continue
        for full in (False, True):
            # the same configurations in the same folders (a table may add seeds of them: the
            # paper's expanded five-seed comparisons)
            shared = {(str(p.run_dir.parent), p.model_hash)
                      for grid in ([reuses] if isinstance(reuses, str) else reuses)
                      for p in load_experiment(CONFIGS / grid, full=full).runs}  # fmt: skip
            mine = {(str(p.run_dir.parent), p.model_hash) for p in e.experiment(full=full).runs}
            assert mine <= shared, f"{e.id} (full={full}) trains runs {reuses} does not hold"


def test_cpu_grid_trains_every_method_at_seed_0_first() -> None:
    exp = load_experiment(CONFIGS / "wikitext_22m.yaml")
    seeds = [p.seed for p in exp.runs]
    assert seeds == sorted(seeds) and seeds[0] == 0
    n_methods = len({p.method for p in exp.runs})
    assert {p.method for p in exp.runs[:n_methods]} == {p.method for p in exp.runs}
    assert [p.method for p in exp.runs[:3]] == ["scse", "looped", "scse_delta3"]


def test_costs_follow_eqs_20_21() -> None:
    # The paper: 22M at T = 8 is 77.9M body+head FLOPs per token; 39.3M body FLOPs at T = 8 means
    # 4.9M per body application, so the mean sampled depth 4.5 gives 22.1M body + 38.6M head.
    exp = paper.find_entry("table05").experiment(full=True)
    plan = next(p for p in exp.runs if p.method == "scse")
    ev = {"depths": [8], "max_tokens": 1_000_000}
    f = paper.run_flops(plan, ev)
    assert f["eval"] == pytest.approx(1e6 * 77.9e6, rel=2e-3)
    per_token_train = 3 * (39.3e6 / 8 * 4.5 + (77.9e6 - 39.3e6))
    assert f["train"] == pytest.approx(20.48e6 * per_token_train, rel=2e-3)


def test_catalogue_lists_every_entry_with_needs_costs_and_status(tmp_path) -> None:
    rows = paper.catalogue_rows(data_dir=str(tmp_path))  # an empty data folder: all missing
    assert [r["id"] for r in rows] == list(paper.ENTRY_IDS)
    for r in rows:
        if r["id"] == "table04":
            assert r["status_cpu"] == "nothing to run"
            continue
        assert r["full_h200_hours"] > 0 and r["full_cpu_hours"] > r["cpu_hours"] > 0, r["id"]
        assert not any(r["needs_full"].values())
        assert r["status_full"]["state"] == "not run"
    text = paper.format_catalogue(rows)
    assert all(f"| {i} |" in text for i in paper.ENTRY_IDS)
    by_id = {r["id"]: r for r in rows}
    assert "openwebtext" in by_id["table13"]["needs_full"]
    assert by_id["table11"]["gpu_only"] and by_id["table02"]["reuses"] == "wikitext_22m.yaml"


def test_bad_paper_configs_fail_with_one_line(tmp_path) -> None:
    with pytest.raises(LoopLMError, match="unknown paper entry 'table23'"):
        paper.find_entry("table23")
    assert paper.find_entry("table2").id == "table02"
    p = tmp_path / "table02.yaml"
    p.write_text(yaml.safe_dump({"paper": {"id": "table02", "reported": [
        {"method": "scse", "metric": "bleu", "value": 1}]}}))  # fmt: skip
    with pytest.raises(LoopLMError, match=r"metric='bleu'; allowed: ppl"):
        paper.load_entry(p)
    p.write_text(yaml.safe_dump({"paper": {"id": "table03"}}))
    with pytest.raises(LoopLMError, match="must be the file's stem"):
        paper.load_entry(p)
    q = tmp_path / "child.yaml"
    q.write_text(yaml.safe_dump({"extends": "nowhere.yaml", "methods": ["scse"]}))
    with pytest.raises(LoopLMError, match="extends='nowhere.yaml'"):
        load_experiment(q)
    q.write_text(yaml.safe_dump({"extends": "child.yaml"}))
    with pytest.raises(LoopLMError, match="loops back"):
        load_experiment(q)
    r = tmp_path / "order.yaml"
    r.write_text(yaml.safe_dump({"base": {}, "methods": ["scse"], "run_order": "random"}))
    with pytest.raises(LoopLMError, match="run_order='random'; allowed: method, seed"):
        load_experiment(r)


# --------------------------------------------------------------------------- diagnostics kind
def _tiny_grid(tmp_path: Path, **evaluate) -> Path:
    """make_experiment's tiny text grid with a lean evaluation section."""
    raw = yaml.safe_load(Path(make_experiment(tmp_path)).read_text())
    raw["evaluate"] = {"split": "test", "max_tokens": 256, "depths": [1, 4], "batch_size": 16,
                       **evaluate}  # fmt: skip
    raw["report"]["allow_incomplete"] = True
    path = tmp_path / "grid.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def test_diagnostics_kind_writes_one_row_per_looped_run(tmp_path) -> None:
    _tiny_grid(tmp_path)  # grid.yaml, which the entry extends
    child = tmp_path / "table22.yaml"
    diag = {"split": "test", "loops": 6, "batches": 1, "batch_size": 2, "steer_inputs": 2}
    child.write_text(yaml.safe_dump({
        "extends": "grid.yaml",
        "methods": ["scse", "looped", {"name": "t2", "recurrence": "unshared",
                                        "overrides": ["model.n_layers=2", "train.depth_min=2",
                                                      "train.depth_max=2"]}],
        "seeds": [0],
        "evaluate": {"diagnostics": diag},
        "paper": {"id": "table22", "reported": [
            {"method": "scse", "metric": "R", "step": 5, "value": 0.0},
            {"method": "looped", "metric": "gain", "step": 0, "value": 3.98},
            {"method": "looped", "metric": "dose_fraction_min", "value": 0.25},
            {"method": "looped", "metric": "dose_fraction_max", "value": 0.51},
            {"method": "scse", "depth": 4, "metric": "ppl", "value": 1.0},
            {"method": "scse", "reference": "looped", "depth": 4, "metric": "delta_ppl",
             "value": -1.0}]},
    }))  # fmt: skip
    out = run_experiment(child, progress=False, report=False)
    assert out["trained"] == 3
    store = ResultsStore(load_experiment(child).store)
    diag_rows = [r for r in store.query() if r.eval_tag.startswith("diagnostics")]
    assert {r.method for r in diag_rows} == {"scse", "looped"}  # no anchor in the unshared model
    by = {r.method: r for r in diag_rows}
    assert all(r.depth == 6 and r.eval_tag == "diagnostics,steer=2,cap=2ex" for r in diag_rows)
    # SCSE's forcing bias is zero by construction (G(0) = 0): R_t = 0 at every step; the
    # additive-injection baseline has a nonzero anchor response
    assert by["scse"].extra["R_per_step"] == [0.0] * 6
    assert all(r > 0 for r in by["looped"].extra["R_per_step"])
    assert len(by["looped"].extra["gain_per_step"]) == 6
    assert len(by["scse"].extra["kl_per_loop"]) == 6
    assert by["looped"].extra["steering"]["n_inputs"] == 2
    assert by["scse"].n_tokens == 2 * 16 and by["scse"].extra["step"] == 4
    # resumable: a second sweep writes nothing
    again = run_experiment(child, progress=False, report=False)
    assert again["rows_written"] == 0 and again["skipped_training"] == 3

    # the side-by-side report reads exactly these rows
    entry = paper.load_entry(child)
    text = paper.entry_report(entry, figures_dir=tmp_path / "fig")
    for name in ("r_t", "anchor_steps", "convergence"):  # Figure 5 and the step curves, linked
        png = tmp_path / "fig" / "table22" / f"{name}.png"
        assert png.stat().st_size > 0 and f"]({png})" in text
    # written beside a report file, the links are relative to that file's folder
    linked = paper.entry_report(entry, figures_dir=tmp_path / "fig", link_base=tmp_path)
    assert "](fig/table22/r_t.png)" in linked
    fixed = {r.method: r.ppl for r in store.query(depth=4, eval_tag="cap=256tok")}
    assert "| scse t=5 | R | 0 | 0 | 1 |" in text
    gain0 = by["looped"].extra["gain_per_step"][0]
    assert f"| looped t=0 | gain | 3.98 | {paper._fmt(gain0)} | 1 |" in text
    # the dose-response span: the smallest and largest displacement / push over inputs and gains
    dose = by["looped"].extra["steering"]["dose"]
    spans = [dose[g]["displacement_over_push"] for g in ("gain_0.5", "gain_1", "gain_2")]
    lo, hi = min(d["min"] for d in spans), max(d["max"] for d in spans)
    assert 0 < lo < hi
    assert f"| looped | dose_fraction_min | 0.25 | {paper._fmt(lo)} | 1 |" in text
    assert f"| looped | dose_fraction_max | 0.51 | {paper._fmt(hi)} | 1 |" in text
    assert f"| scse T=4 | ppl | 1 | {paper._fmt(fixed['scse'])} | 1 |" in text
    delta = paper._fmt(fixed["scse"] - fixed["looped"])
    assert f"| scse − looped T=4 | delta_ppl | -1 | {delta} | 1 |" in text
    # the same cells diagnosed without steering rollouts are another measurement: new rows, not
    # a skip; and a grid that asks for steering does not find a steering-free row and skip it
    raw = yaml.safe_load(child.read_text())
    raw["evaluate"]["diagnostics"] = {**diag, "steer_inputs": 0}
    child.write_text(yaml.safe_dump(raw))
    assert run_experiment(child, progress=False, report=False)["rows_written"] == 2
    tags = sorted(r.eval_tag for r in store.query(method="looped") if "diag" in r.eval_tag)
    assert tags == ["diagnostics,cap=2ex", "diagnostics,steer=2,cap=2ex"]
    # the report reads the row that holds the steering summary, and counts each checkpoint once
    text = paper.entry_report(paper.load_entry(child), figures_dir=tmp_path / "fig")
    assert f"| looped | dose_fraction_min | 0.25 | {paper._fmt(lo)} | 1 |" in text
    diag = [r for r in store.query() if r.eval_tag.startswith("diagnostics")]
    kept = one_per_checkpoint(diag)
    assert len(diag) == 4 and sorted(r.method for r in kept) == ["looped", "scse"]
    assert all(r.eval_tag == "diagnostics,steer=2,cap=2ex" for r in kept)


def test_diagnostics_settings_are_checked(tmp_path) -> None:
    for bad, match in (
        ({"dtype": "float16"}, "dtype='float16'; allowed: float64, float32"),
        ({"loops": 0}, "evaluate.diagnostics.loops=0 must be a positive integer"),
        ({"steer_inputs": -1}, "steer_inputs=-1 must be an integer >= 0"),
        ({"colour": 1}, "unknown key evaluate.diagnostics.colour"),
    ):
        with pytest.raises(LoopLMError, match=match):
            load_experiment(_tiny_grid(tmp_path, diagnostics=bad))


def test_grid_status_goes_from_not_run_to_done(tmp_path) -> None:
    grid = _tiny_grid(tmp_path)
    exp = load_experiment(grid)
    assert paper.grid_status(exp)["state"] == "not run"
    raw = yaml.safe_load(grid.read_text())
    raw["seeds"] = [0]
    one = tmp_path / "one.yaml"
    one.write_text(yaml.safe_dump(raw))
    run_experiment(one, progress=False, report=False)
    s = paper.grid_status(exp)
    assert s["state"] == "partial" and s["trained"] == 2 and s["rows"] == 4
    run_experiment(grid, progress=False, report=False)
    assert paper.grid_status(exp) == {"state": "done", "trained": 4, "runs": 4, "rows": 8,
                                      "rows_wanted": 8}  # fmt: skip


# --------------------------------------------------------------------------- killed grid
def test_killed_grid_resumes_without_retraining_finished_cells(tmp_path) -> None:
    from looplm.model.checkpoint import checkpoint_exists, read_meta

    grid = _tiny_grid(tmp_path)
    raw = yaml.safe_load(grid.read_text())
    raw["seeds"] = [0]
    long = ["train.steps=100000", "train.ckpt_every=2"]
    raw["methods"] = ["scse", {"name": "looped", "recurrence": "looped", "overrides": long}]
    path = tmp_path / "kill.yaml"
    path.write_text(yaml.safe_dump(raw))
    exp = load_experiment(path)
    first, second = exp.runs
    env = {**os.environ, "LOOPLM_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    proc = subprocess.Popen(
        [sys.executable, "-m", "looplm", "sweep", str(path), "--no-report"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + 300
    killed_at = 0
    while time.monotonic() < deadline and proc.poll() is None:
        if checkpoint_exists(second.ckpt):
            killed_at = int(read_meta(second.ckpt)["state"]["step"])
            if killed_at >= 2:
                break
        time.sleep(0.05)
    proc.send_signal(signal.SIGKILL)  # no chance to write anything more
    _, err = proc.communicate(timeout=60)
    assert killed_at >= 2, err[-2000:]
    killed_at = int(read_meta(second.ckpt)["state"]["step"])  # the last checkpoint written
    assert read_meta(first.ckpt)["state"]["step"] == 4
    stamp = (first.ckpt / "state.json").stat().st_mtime_ns
    # the rerun stops the long cell after one more step (max_wall_s does not change the run's
    # identity): the finished cell is skipped, the killed one resumes from its checkpoint
    raw["methods"][1]["overrides"] = [*long, "train.max_wall_s=1e-9"]
    path.write_text(yaml.safe_dump(raw))
    out = run_experiment(path, progress=False, report=False)
    assert out["skipped_training"] == 1 and out["trained"] == 0
    assert (first.ckpt / "state.json").stat().st_mtime_ns == stamp
    assert int(read_meta(second.ckpt)["state"]["step"]) == killed_at + 1  # resumed, one step


def test_cpu_rate_comes_from_logged_steps_of_one_process(tmp_path) -> None:
    from looplm.settings.config import load_config

    cfg = load_config("tiny_bool", ["train.device=cpu", "train.steps=40"])
    run = tmp_path / "root" / "m" / "seed0"
    run.mkdir(parents=True)
    (run / "config.yaml").write_text(yaml.safe_dump(cfg.to_dict()))
    log = run / "metrics.jsonl"
    assert paper.measured_cpu_rate([tmp_path / "root"]) is None  # nothing logged yet

    def write(lines):
        log.write_text("".join(json.dumps({"step": s, "elapsed_s": t}) + "\n" for s, t in lines))
        return paper.measured_cpu_rate([tmp_path / "root"])

    fast = write([(10, 5.0), (20, 15.0)])
    assert fast > 0
    assert write([(10, 5.0), (20, 25.0)]) == pytest.approx(fast / 2)  # twice the time per step
    # a resumed process restarts its clock: the pair across the restart is left out
    assert write([(10, 5.0), (20, 15.0), (30, 2.0), (40, 12.0)]) == pytest.approx(fast)


def test_kl_halting_depth_at_depth8_quality_reads_every_threshold_of_a_seed() -> None:
    """The fewest KL-halting loops whose PPL is at most uniform depth 8's, per seed: every
    threshold's row of that seed is considered (one row a seed was a bug)."""
    from types import SimpleNamespace as R

    from looplm.experiments.paper.report import _adaptive_metric

    rows = {
        0: [R(adaptive_mode="kl:thr=0.1", ppl=101.0, extra={"mean_depth": 2.0}),
            R(adaptive_mode="kl:thr=0.01", ppl=99.0, extra={"mean_depth": 3.0}),
            R(adaptive_mode="kl:thr=0.001", ppl=98.0, extra={"mean_depth": 5.0}),
            R(adaptive_mode="router:p=0.5", ppl=90.0, extra={"mean_depth": 1.0})],
        1: [R(adaptive_mode="kl:thr=0.1", ppl=120.0, extra={"mean_depth": 2.0})],
    }  # fmt: skip

    class Measured:
        def fixed(self, method, scale, depth):
            assert depth == 8
            return {0: 100.0, 1: 110.0}

        def matching(self, method, scale, seed):
            return rows[seed]

    row = {"method": "scse", "metric": "kl_halting_loops_at_depth8_quality"}
    # seed 0: thresholds 0.01 and 0.001 reach 100 → 3.0 loops; seed 1: none does → no value
    assert _adaptive_metric(row, Measured(), "scse") == [3.0]
    # and the report says so instead of printing seed 0's value as if it were every seed's
    got = paper.measure(row, Measured(), ["scse"])
    assert got["mean"] == 3.0 and got["n"] == 1
    assert got["note"] == "1 of 2 seeds reach depth-8 quality at any threshold"


def test_transfer_entries_take_split_counts_for_small_samples() -> None:
    """A transfer entry's `counts` (documents of a contiguous OpenWebText / C4 split) reach the
    sweep and its eval tag, so a small local sample can be split; bad counts are one error."""
    from looplm.transfer.kind import Transfer

    ev = {
        "depths": [8],
        "transfer": [{"dataset": "c4", "split": "validation", "counts": "800,100,100"}],
    }
    sweep = Transfer.configure(ev).sweeps[0]
    assert sweep.counts == "800,100,100" and sweep.label == "docs=800/100/100"
    plain = Transfer.configure({"depths": [8], "transfer": [{"dataset": "c4"}]}).sweeps[0]
    assert plain.counts is None and plain.label == ""
    with pytest.raises(LoopLMError, match="split counts"):
        Transfer.configure({"depths": [8], "transfer": [{"dataset": "c4", "counts": "1,2"}]})


def test_report_draws_the_ratio_by_scale_tier(tmp_path, monkeypatch) -> None:
    """Figure 5 by scale: a grid with a scale-tier variant gets r_t_by_scale.png (R_t per tier and
    method over seeds); the per-checkpoint figures keep each tier and method's lowest seed."""
    import looplm.diagnostics.plots as plots

    _tiny_grid(tmp_path)
    child = tmp_path / "figure5.yaml"
    diag = {"split": "test", "loops": 4, "batches": 1, "batch_size": 2, "steer_inputs": 0}
    child.write_text(yaml.safe_dump({
        "extends": "grid.yaml",
        "methods": ["scse", "looped"],
        "seeds": [0, 1],
        # "d192" is the CPU analogue's name of the 50M tier (tiny here: width 48)
        "variants": [{"name": "", "overrides": []},
                     {"name": "d192", "overrides": ["model.d_model=48", "model.d_ff=96"]}],
        "evaluate": {"diagnostics": diag},
        "paper": {"id": "figure5", "reported": [
            {"method": "scse", "scale": "50m", "metric": "R", "step": 3, "value": 0.0}],
            "claims": [
                {"text": "SCSE's R_t is zero", "test": "construction", "method": "scse",
                 "metric": "R", "steps": [0, 3], "scale": "50m", "equals": 0},
                {"text": "the looped model's R_t is zero", "test": "construction",
                 "method": "looped", "metric": "R", "steps": [3], "equals": 0}]},
    }))  # fmt: skip
    run_experiment(child, progress=False, report=False)
    drawn: dict[str, list] = {}
    real_scale, real_bars = plots.plot_rt_by_scale, plots.plot_rt_bars
    monkeypatch.setattr(
        plots, "plot_rt_by_scale", lambda g, p: (drawn.setdefault("scale", g), real_scale(g, p))
    )
    monkeypatch.setattr(plots, "plot_rt_bars",
                        lambda r, p: (drawn.setdefault("bars", r), real_bars(r, p)))  # fmt: skip
    text = paper.entry_report(paper.load_entry(child), figures_dir=tmp_path / "fig")
    png = tmp_path / "fig" / "figure5" / "r_t_by_scale.png"
    assert png.stat().st_size > 0 and f"]({png})" in text
    groups = {(g["tier"], g["method"]): g for g in drawn["scale"]}
    assert list(groups) == [("22m", "looped"), ("22m", "scse"), ("50m: d192", "looped"),
                            ("50m: d192", "scse")]  # fmt: skip
    assert groups[("50m: d192", "scse")]["R_last"] == [0.0, 0.0]  # both seeds, exactly zero
    assert all(v > 0 for v in groups[("50m: d192", "looped")]["R_last"])
    assert [r["label"] for r in drawn["bars"]] == [
        "22m looped s0", "22m scse s0", "50m: d192 looped s0", "50m: d192 scse s0"]  # fmt: skip
    assert "| scse 50m t=3 | R | 0 | 0 ± 0 s.d. | 2 | bytes d48 " in text
    # verdicts computed from the same rows: SCSE's zero is by construction, looped's R_t is not 0
    assert "| SCSE's R_t is zero | **holds by construction** |" in text
    assert "| the looped model's R_t is zero | **not reproduced** |" in text
