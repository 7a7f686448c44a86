"""Reused folders, paths that travel and storage faults (full disk, read-only store, kills,
concurrent sweeps): nothing written before a fault is lost and every error is one line.

Faults are injected (an ``OSError`` with the errno a full disk or a read-only file system gives,
a SQLite error, ``kill -9``), so the suite runs anywhere, as any user."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.experiments.cells import LOCK_NAME
from looplm.model.checkpoint import checkpoint_exists, load_checkpoint, read_meta

REPO = Path(__file__).resolve().parents[1]

# A tiny model on a small text file: a run takes a second or two.
SMALL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "model.context=32",
    "train.batch_size=4",
    "train.warmup=1",
    "train.eval_batches=2",
    "eval.batch_size=8",
]
WORDS = (
    "the river ran past the old mill and the miller watched the water turn his wheel while "
    "children played on the bank and the dog slept in the sun"
).split()


def write_text(path: Path, n_docs: int = 40) -> Path:
    """An English-like text of ``n_docs`` paragraphs separated by blank lines."""
    g = torch.Generator().manual_seed(0)
    docs = []
    for _ in range(n_docs):
        idx = torch.randint(0, len(WORDS), (60,), generator=g).tolist()
        docs.append(" ".join(WORDS[i] for i in idx).capitalize() + ".")
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def one_line_error(err: str) -> str:
    """The one ``error:`` line of a command's stderr (progress lines may precede it)."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err
    return errors[0]


def train_cli(tmp: Path, out: str, steps: int, *extra: str) -> int:
    text = tmp / "story.txt"
    if not text.exists():
        write_text(text)
    return main(
        [
            "train",
            "own_text",
            f"data.dataset=text:{text}",
            f"data.cache_dir={tmp / 'cache'}",
            f"train.steps={steps}",
            f"out_dir={out}",
            *SMALL,
            *extra,
        ]
    )


# ----------------------------------------------------------------------------- reused folders
def test_train_refuses_an_existing_checkpoint_without_resume_or_overwrite(tmp_path, capsys):
    out = str(tmp_path / "run")
    assert train_cli(tmp_path, out, 2) == 0
    before = (tmp_path / "run" / "ckpt" / "model.safetensors").read_bytes()
    capsys.readouterr()
    assert train_cli(tmp_path, out, 3) == 2
    line = one_line_error(capsys.readouterr().err)
    assert "step 2" in line and "--resume" in line and "--overwrite" in line
    assert (tmp_path / "run" / "ckpt" / "model.safetensors").read_bytes() == before
    # both ways out work
    assert train_cli(tmp_path, out, 3, "--resume") == 0
    assert read_meta(tmp_path / "run" / "ckpt")["state"]["step"] == 3
    assert train_cli(tmp_path, out, 1, "--overwrite") == 0
    assert read_meta(tmp_path / "run" / "ckpt")["state"]["step"] == 1


def test_export_overwrite_removes_only_the_previous_exports_files(tmp_path, capsys):
    assert train_cli(tmp_path, str(tmp_path / "run"), 1) == 0
    ckpt, hf = str(tmp_path / "run" / "ckpt"), tmp_path / "hf"
    assert main(["export", ckpt, str(hf)]) == 0
    (hf / "notes.txt").write_text("mine")
    (hf / "extra").mkdir()
    assert main(["export", ckpt, str(hf), "--overwrite", "--loops", "3"]) == 0
    assert (hf / "notes.txt").read_text() == "mine" and (hf / "extra").is_dir()
    assert json.loads((hf / "config.json").read_text())["loops"] == 3
    # a folder that is not an export is never written into
    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "gpt2"}')
    capsys.readouterr()
    assert main(["export", ckpt, str(other), "--overwrite"]) == 2
    assert "not a looplm export" in one_line_error(capsys.readouterr().err)
    assert sorted(p.name for p in other.iterdir()) == ["config.json"]


# ----------------------------------------------------------------------------- paths
def test_text_corpus_path_is_stored_absolute_and_eval_works_elsewhere(
    tmp_path, monkeypatch, capsys
):
    work = tmp_path / "work"
    work.mkdir()
    write_text(work / "story.txt")
    monkeypatch.chdir(work)
    args = ["data.dataset=text:story.txt", f"data.cache_dir={tmp_path / 'cache'}"]
    assert main(["train", "own_text", *args, "train.steps=1", "out_dir=run", *SMALL]) == 0
    saved = read_meta(work / "run" / "ckpt")["config"]["data"]["dataset"]
    assert saved == f"text:{work / 'story.txt'}"
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    monkeypatch.chdir(elsewhere)
    capsys.readouterr()
    assert main(["eval", str(work / "run" / "ckpt"), "--depths", "1,2"]) == 0
    assert [r["depth"] for r in json.loads(capsys.readouterr().out)["results"]] == [1, 2]


def test_data_dir_env_is_honoured_by_the_wikitext_config(tmp_path, monkeypatch):
    from looplm.data.cache import default_data_dir
    from looplm.settings.config import load_config

    folder = tmp_path / "mydata" / "wikitext-2"
    folder.mkdir(parents=True)
    body = "".join(f" = Article {i} = \n \n {' '.join(WORDS)} . \n \n" for i in range(30))
    for split in ("train", "valid"):
        (folder / f"wiki.{split}.tokens").write_text(" \n" + body, encoding="utf-8")
    monkeypatch.setenv("LOOPLM_DATA_DIR", str(tmp_path / "mydata"))
    monkeypatch.chdir(tmp_path)  # no ../shared/data from here
    assert default_data_dir() == tmp_path / "mydata"
    assert load_config("tiny_wt2").data.data_dir is None  # the config does not pin a folder
    over = ["train.steps=1", "train.eval_every=0", "eval.max_tokens=64", "out_dir=wt", *SMALL]
    assert main(["train", "tiny_wt2", f"data.cache_dir={tmp_path / 'cache'}", *over]) == 0
    assert checkpoint_exists(tmp_path / "wt" / "ckpt")


# ----------------------------------------------------------------------------- storage faults
def _enospc(*args, **kwargs):
    raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))


def test_full_disk_during_a_checkpoint_keeps_the_previous_one(tmp_path, monkeypatch, capsys):
    from looplm.io import atomic_open
    from looplm.model import checkpoint

    out = tmp_path / "run"
    assert train_cli(tmp_path, str(out), 2) == 0
    good = (out / "ckpt" / "model.safetensors").read_bytes()
    real = checkpoint.atomic_write_bytes

    def disk_fills_up(path, data):
        if Path(path).name != "optimizer.safetensors":
            return real(path, data)
        with atomic_open(path) as f:  # the disk fills up half way through the second file
            f.write(data[: len(data) // 2])
            _enospc()

    monkeypatch.setattr(checkpoint, "atomic_write_bytes", disk_fills_up)
    capsys.readouterr()
    assert train_cli(tmp_path, str(out), 4, "--resume") == 1
    line = one_line_error(capsys.readouterr().err)
    assert "no space left" in line and str(out / ".ckpt.tmp" / "optimizer.safetensors") in line
    assert not (out / ".ckpt.tmp").exists()
    assert (out / "ckpt" / "model.safetensors").read_bytes() == good
    load_checkpoint(out / "ckpt")  # still verifies
    assert read_meta(out / "ckpt")["state"]["step"] == 2


def test_full_disk_during_data_prepare_and_export_leaves_no_temporaries(
    tmp_path, monkeypatch, capsys
):
    text = write_text(tmp_path / "story.txt")
    assert train_cli(tmp_path, str(tmp_path / "run"), 1) == 0
    monkeypatch.setattr(os, "fsync", _enospc)
    capsys.readouterr()
    cache = tmp_path / "newcache"
    assert (
        main(["data", "prepare", f"text:{text}", "--tokenizer", "bytes", "--out", str(cache)]) == 1
    )
    line = one_line_error(capsys.readouterr().err)
    assert "no space left" in line and str(cache) in line
    assert not [p for p in cache.iterdir() if p.name.endswith(".tmp")]
    import safetensors.torch

    monkeypatch.setattr(safetensors.torch, "save_file", _enospc)
    assert main(["export", str(tmp_path / "run" / "ckpt"), str(tmp_path / "hf")]) == 1
    assert str(tmp_path / "hf") in one_line_error(capsys.readouterr().err)
    assert not (tmp_path / ".hf.tmp").exists() and not (tmp_path / "hf").exists()


def test_a_store_that_cannot_be_written_loses_no_evaluation(tmp_path, capsys):
    assert train_cli(tmp_path, str(tmp_path / "run"), 1) == 0
    blocker = tmp_path / "blocker"
    blocker.write_text("a file where the store's folder should be")
    out = tmp_path / "eval.json"
    capsys.readouterr()
    code = main(
        [
            "eval",
            str(tmp_path / "run" / "ckpt"),
            "--depths",
            "1,2",
            "--out",
            str(out),
            "--store",
            str(blocker / "results.sqlite"),
        ]
    )
    captured = capsys.readouterr()
    assert code == 1
    one_line_error(captured.err)
    printed = json.loads(captured.out)
    assert [r["depth"] for r in printed["results"]] == [1, 2]
    assert json.loads(out.read_text())["results"] == printed["results"]


def test_report_opens_the_store_read_only(tmp_path, monkeypatch):
    from looplm.results import store as store_mod
    from looplm.results.export import load_records
    from looplm.results.store import EvalRecord, ResultsStore

    path = tmp_path / "results.sqlite"
    with ResultsStore(path) as st:
        st.put(
            EvalRecord(
                model_hash="h",
                method="scse",
                protocol="p",
                dataset="d",
                split="test",
                depth=1,
                seed=0,
                n_tokens=10,
                sum_nll=20.0,
            )
        )
    real = sqlite3.connect

    def read_only_media(database, *args, **kwargs):
        # what a read-only file system or missing write permission gives a writer
        if "mode=ro" not in str(database) and "immutable=1" not in str(database):
            raise sqlite3.OperationalError("attempt to write a readonly database")
        return real(database, *args, **kwargs)

    monkeypatch.setattr(store_mod.sqlite3, "connect", read_only_media)
    assert [r.sum_nll for r in load_records(path)] == [20.0]


def test_store_errors_are_one_line_naming_the_store(tmp_path, capsys):
    bad = tmp_path / "x.sqlite"
    bad.write_bytes(b"not a database at all, just bytes" * 10)
    assert main(["report", str(bad), "--no-figures"]) == 2
    assert str(bad) in one_line_error(capsys.readouterr().err)


# ----------------------------------------------------------------------------- kills
_SAVER = textwrap.dedent(
    """
    import sys, torch
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config
    from looplm.model import model_from_config
    cfg = load_config("tiny_bool", ["model.d_model=32", "model.n_heads=2", "model.d_ff=64"])
    model = model_from_config(cfg.model)
    step = 0
    while True:
        step += 1
        with torch.no_grad():
            next(model.parameters()).add_(1.0)
        save_checkpoint(sys.argv[1], model, cfg, state={"step": step})
        print(step, flush=True)
    """
)
_WRITER = textwrap.dedent(
    """
    import sys
    from looplm.results.store import EvalRecord, ResultsStore
    st = ResultsStore(sys.argv[1])
    i = 0
    while True:
        st.put_many([EvalRecord(model_hash="h", method="m", protocol="p", dataset="d",
                     split="test", depth=d, seed=i, n_tokens=1, sum_nll=1.0) for d in range(1, 6)])
        i += 1
        print(i, flush=True)
    """
)


def _kill_after_writes(script: str, target: Path, n: int) -> int:
    """Run ``script`` writing ``target`` until it has reported ``n`` writes, then kill -9 it."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen(
        [sys.executable, "-c", script, str(target)], stdout=subprocess.PIPE, text=True, env=env
    )
    last = 0
    try:
        for line in proc.stdout:
            last = int(line)
            if last >= n:
                break
        time.sleep(0.01 * (n % 7))  # land the kill somewhere inside the next write
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    return last


@pytest.mark.parametrize("n", [3, 5])
def test_kill_during_checkpoint_writes_leaves_a_complete_checkpoint(tmp_path, n):
    ckpt = tmp_path / "ckpt"
    done = _kill_after_writes(_SAVER, ckpt, n)
    assert checkpoint_exists(ckpt)
    _, _, meta = load_checkpoint(ckpt)  # sizes and checksums verify
    assert meta["state"]["step"] >= done


def test_kill_during_store_writes_keeps_every_committed_row(tmp_path):
    from looplm.results.export import load_records

    path = tmp_path / "results.sqlite"
    done = _kill_after_writes(_WRITER, path, 8)
    rows = load_records(path)
    seeds = {r.seed for r in rows}
    assert len(rows) % 5 == 0  # a transaction is all or nothing
    assert set(range(done)) <= seeds


# ----------------------------------------------------------------------------- concurrent sweeps
def _two_cell_grid(tmp_path):
    """A two-run grid (scse, looped; tiny, 2 steps) for the locking tests."""
    from looplm.experiments import runner as experiments

    grid = tmp_path / "grid.yaml"
    grid.write_text(
        textwrap.dedent(
            f"""
            name: g
            out_root: {tmp_path / "runs"}
            base: {{model: {{preset: tiny}}, train: {{steps: 2}}}}
            methods: [scse, looped]
            seeds: [0]
            evaluate: {{depths: [1]}}
            """
        )
    )
    return experiments.load_experiment(grid)


def test_concurrent_sweeps_share_the_grid(tmp_path, monkeypatch):
    """A cell another process holds is passed over, then waited for: it is trained once."""
    from looplm.experiments import runner as experiments
    from looplm.io import file_lock

    exp = _two_cell_grid(tmp_path)
    trained: list[str] = []
    monkeypatch.setattr(
        experiments, "train_run", lambda plan, progress=None: trained.append(plan.label) or "x"
    )
    first = exp.runs[0]
    other_has_it = threading.Event()

    def other_process() -> None:
        with file_lock(first.run_dir / LOCK_NAME):
            other_has_it.set()
            time.sleep(0.5)
            trained.append(f"other:{first.label}")

    t = threading.Thread(target=other_process)
    t.start()
    other_has_it.wait()
    summary = {"timings": {}}
    assert experiments._train_all(exp, summary, show=False)
    t.join()
    # the free cell first, then the held one once the other process let go of it
    assert trained == [exp.runs[1].label, f"other:{first.label}", first.label]


def test_training_does_not_wait_for_a_finished_cell_another_process_evaluates(
    tmp_path, monkeypatch
):
    """A finished cell is passed over without its lock (another sweep may hold it for a long
    evaluation): the training pass neither waits for it nor trains it."""
    from looplm.experiments import runner as experiments
    from looplm.io import file_lock

    exp = _two_cell_grid(tmp_path)
    first = exp.runs[0]
    first.run_dir.mkdir(parents=True)
    monkeypatch.setattr(experiments, "_trained", lambda plan: plan is first)
    trained: list[str] = []
    monkeypatch.setattr(
        experiments, "train_run", lambda plan, progress=None: trained.append(plan.label) or "x"
    )
    summary: dict = {"timings": {}}
    with file_lock(first.run_dir / LOCK_NAME):  # held for the whole training pass
        t0 = time.perf_counter()
        assert experiments._train_all(exp, summary, show=False)
    assert trained == [exp.runs[1].label] and summary["skipped_training"] == 1
    assert time.perf_counter() - t0 < 60  # it did not block on the held lock


def test_concurrent_sweeps_split_the_evaluations(tmp_path, monkeypatch):
    """Evaluation takes the cell's lock too: a cell another process is evaluating is left to
    that process (no second evaluation, no idle wait)."""
    from looplm.experiments import runner as experiments
    from looplm.io import file_lock

    exp = _two_cell_grid(tmp_path)
    for plan in exp.runs:
        plan.run_dir.mkdir(parents=True)
    monkeypatch.setattr(experiments, "_evaluable", lambda i, n, plan: True)
    seen: list[str] = []
    monkeypatch.setattr(
        experiments,
        "evaluate_run",
        lambda plan, exp, store, progress=None, redo=(): (
            seen.append(plan.label) or {"written": 1, "skipped": 0}
        ),
    )
    first = exp.runs[0]
    other_has_it = threading.Event()

    def other_process() -> None:
        with file_lock(first.run_dir / LOCK_NAME):
            other_has_it.set()
            time.sleep(0.5)
            seen.append(f"other:{first.label}")

    t = threading.Thread(target=other_process)
    t.start()
    other_has_it.wait()
    summary = {"timings": {}, "rows_written": 0, "evals_skipped": 0}
    experiments._evaluate_all(exp, summary, show=False, redo=frozenset())
    assert seen == [exp.runs[1].label]  # returned while the other process still held its cell
    t.join()
    assert seen == [exp.runs[1].label, f"other:{first.label}"]


@pytest.mark.parametrize(
    "report, named",
    [
        ({"reference": "nosuch"}, "report.reference='nosuch'"),
        ({"seeds": "sometimes"}, "report.seeds='sometimes'"),
        ({"n_boot": 0}, "report.n_boot=0"),
    ],
)
def test_a_bad_report_section_is_refused_before_training(tmp_path, report, named):
    from looplm.errors import LoopLMError
    from looplm.experiments.runner import run_experiment

    grid = tmp_path / "grid.yaml"
    grid.write_text(
        json.dumps(
            {
                "name": "g",
                "out_root": str(tmp_path / "runs"),
                "base": {"model": {"preset": "tiny"}, "train": {"steps": 2}},
                "methods": ["scse"],
                "seeds": [0],
                "evaluate": {"depths": [1]},
                "report": report,
            }
        )
    )
    with pytest.raises(LoopLMError, match=named.replace("[", r"\[")):
        run_experiment(grid)
    assert not (tmp_path / "runs").exists()  # nothing was trained
