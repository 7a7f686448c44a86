"""Limits checked before any work, lost work, signals and the last faults: each bad input or
fault ends in one line naming the value (or path) and what is allowed, before anything long runs
and without losing what was finished."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from looplm.cli import main

REPO = Path(__file__).resolve().parents[1]
TINY = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "train.batch_size=4",
    "eval.n_examples=32",
]


def one_line_error(err: str) -> str:
    """The one ``error:`` line of a command's stderr (progress lines may precede it)."""
    lines = [x for x in err.strip().splitlines() if x.strip()]
    errors = [x for x in lines if x.startswith("error: ")]
    assert len(errors) == 1 and lines[-1] == errors[0], err
    assert "Traceback" not in err
    return errors[0]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> Path:
    """A one-step tiny_bool checkpoint."""
    out = tmp_path_factory.mktemp("limits") / "run"
    assert main(["train", "tiny_bool", "train.steps=1", f"out_dir={out}", *TINY]) == 0
    return out / "ckpt"


class _TookTooLong(Exception):
    pass


def _bounded(fn, limit_s: int):
    """``fn()``, or _TookTooLong after ``limit_s`` seconds (a command that computes instead of
    refusing must not hang the suite)."""

    def expire(signum, frame):
        raise _TookTooLong(f"still running after {limit_s} s")

    old = signal.signal(signal.SIGALRM, expire)
    signal.alarm(limit_s)
    try:
        return fn()
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)


def _fails_fast(argv: list[str], capsys, limit_s: int = 20) -> str:
    """The one error line of ``looplm ARGV``, which must be refused (status 2) within seconds."""
    capsys.readouterr()
    assert _bounded(lambda: main(argv), limit_s) == 2
    return one_line_error(capsys.readouterr().err)


# ----------------------------------------------------------------------------- loop limits
@pytest.mark.parametrize("depths", ["1-100000", "1-2000", "4,8,100000"])
def test_eval_refuses_depths_beyond_the_ceiling_before_any_work(ckpt, capsys, depths):
    line = _fails_fast(["eval", str(ckpt), "--depths", depths], capsys)
    deepest = depths.split(",")[-1].split("-")[-1]
    assert f"--depths {deepest}" in line and "1 … 256" in line and "--max-loops" in line


def test_generate_refuses_loops_beyond_the_ceiling(ckpt, capsys):
    line = _fails_fast(["generate", str(ckpt), "--prompt", "a", "--loops", "100000"], capsys)
    assert "--loops 100000" in line and "1 … 256" in line and "--max-loops 100000" in line


def test_the_ceiling_is_overridden_on_purpose(ckpt, capsys, monkeypatch):
    monkeypatch.setenv("LOOPLM_MAX_LOOPS", "2")  # a low ceiling keeps the allowed runs cheap
    line = _fails_fast(["eval", str(ckpt), "--depths", "1-3"], capsys)
    assert "1 … 2" in line and "LOOPLM_MAX_LOOPS=3" in line
    assert main(["eval", str(ckpt), "--depths", "1-3", "--max-loops", "3"]) == 0
    assert [r["depth"] for r in json.loads(capsys.readouterr().out)["results"]] == [1, 2, 3]
    line = _fails_fast(["generate", str(ckpt), "--prompt", "a", "--loops", "3"], capsys)
    assert "--loops 3" in line
    assert main(["generate", str(ckpt), "--prompt", "a", "--loops", "3", "--max-loops", "3",
                 "--max-new", "2"]) == 0  # fmt: skip
    monkeypatch.setenv("LOOPLM_MAX_LOOPS", "many")
    assert "LOOPLM_MAX_LOOPS='many'" in _fails_fast(["eval", str(ckpt), "--depths", "1"], capsys)


def test_sweep_grid_depths_have_the_same_ceiling():
    from looplm.errors import LoopLMError
    from looplm.settings import depth_list

    with pytest.raises(LoopLMError, match="1 … 256") as info:
        depth_list([4, 8, 1000], "evaluate.depths")
    assert "--max-loops" not in str(info.value)  # a grid has no such flag: the variable only
    assert "LOOPLM_MAX_LOOPS=1000" in str(info.value)


def test_a_backwards_depth_range_keeps_its_own_message(ckpt, capsys):
    assert "runs backwards" in _fails_fast(["eval", str(ckpt), "--depths", "5-1"], capsys)


def test_out_of_range_messages_name_the_range(ckpt, capsys):
    line = _fails_fast(["diagnose", str(ckpt), "--batches", "0"], capsys)
    assert "--batches 0" in line and ">= 1" in line
    line = _fails_fast(["diagnose", str(ckpt), "--check-steps", "-1"], capsys)
    assert "--check-steps -1" in line and ">= 0" in line


# ----------------------------------------------------------------------------- output paths
def test_eval_out_that_is_a_folder_is_refused_before_the_evaluation(ckpt, tmp_path, capsys):
    folder = tmp_path / "results"
    folder.mkdir()
    line = _fails_fast(["eval", str(ckpt), "--depths", "1,2", "--out", str(folder)], capsys)
    assert str(folder) in line and "is a folder" in line
    under_file = tmp_path / "afile"
    under_file.write_text("x")
    line = _fails_fast(
        ["eval", str(ckpt), "--depths", "1", "--out", str(under_file / "r.json")], capsys
    )
    assert str(under_file) in line and "must be a folder" in line
    prompts = tmp_path / "prompts.txt"
    prompts.write_text("a\nb\n")
    argv = ["generate", str(ckpt), "--prompts", str(prompts), "--out", str(folder)]
    assert "is a folder" in _fails_fast(argv, capsys)


# ----------------------------------------------------------------------------- bad settings
def test_an_empty_out_dir_is_refused(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    line = _fails_fast(["train", "tiny_bool", "train.steps=1", "out_dir=", *TINY], capsys)
    assert "out_dir=" in line and "empty" in line
    assert list(tmp_path.iterdir()) == []  # nothing written into the current folder


def test_an_out_dir_that_is_a_file_is_named(tmp_path, capsys):
    afile = tmp_path / "run"
    afile.write_text("not a folder")
    line = _fails_fast(["train", "tiny_bool", "train.steps=1", f"out_dir={afile}", *TINY], capsys)
    assert f"out_dir={afile}" in line and "must be a folder" in line
    assert afile.read_text() == "not a folder"


def test_an_empty_config_file_is_refused(tmp_path, capsys):
    for i, text in enumerate(["", "# only a comment\n"]):
        cfg = tmp_path / f"empty{i}.yaml"
        cfg.write_text(text)
        out = tmp_path / f"run{i}"
        line = _fails_fast(["train", str(cfg), "train.steps=1", f"out_dir={out}"], capsys)
        assert str(cfg) in line and "empty" in line
        assert not out.exists()


def test_seq_len_on_a_task_checkpoint_is_refused(ckpt, tmp_path, capsys):
    argv = ["diagnose", str(ckpt), "--seq-len", "8", "--out", str(tmp_path / "d")]
    line = _fails_fast(argv, capsys)
    assert "--seq-len 8" in line and "text checkpoints only" in line


def _store_with(path: Path, methods: list[str]) -> Path:
    from looplm.results.store import EvalRecord, ResultsStore

    with ResultsStore(path) as st:
        st.put_many(
            [
                EvalRecord(
                    model_hash=m,
                    method=m,
                    protocol="p",
                    dataset="d",
                    split="test",
                    depth=1,
                    seed=s,
                    n_tokens=10,
                    sum_nll=20.0 + s,
                )  # fmt: skip
                for m in methods
                for s in (0, 1, 2)
            ]
        )
    return path


def test_report_refuses_an_unknown_reference(tmp_path, capsys):
    store = _store_with(tmp_path / "r.sqlite", ["scse", "looped"])
    argv = ["report", str(store), "--no-figures", "--out", str(tmp_path / "rep")]
    line = _fails_fast([*argv, "--reference", "nosuch"], capsys)
    assert "'nosuch'" in line and "looped, scse" in line
    assert not (tmp_path / "rep").exists()
    assert main([*argv, "--reference", "looped"]) == 0  # a method of the store still works


# ----------------------------------------------------------------------------- lost work
def _start_training(out: Path, *extra: str) -> subprocess.Popen:
    """``looplm train`` in another process, long enough to be caught holding its folder."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOOPLM_NO_PROGRESS": "1"}
    argv = ["train", "tiny_bool", "train.steps=100000", "train.log_every=1", f"out_dir={out}"]
    return subprocess.Popen(
        [sys.executable, "-m", "looplm", *argv, *TINY, *extra],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def _wait_for_steps(proc: subprocess.Popen, n: int, limit_s: float = 60) -> None:
    """Read ``proc``'s progress lines until it has logged step ``n``."""
    deadline = time.monotonic() + limit_s
    for line in proc.stderr:
        if line.startswith(f"step {n}/"):
            return
        assert time.monotonic() < deadline, "the training did not start in time"
    raise AssertionError("the training ended early")


def test_a_second_training_into_a_busy_folder_fails_at_once(tmp_path, capsys):
    out = tmp_path / "run"
    first = _start_training(out)
    try:
        _wait_for_steps(first, 2)
        line = _fails_fast(["train", "tiny_bool", "train.steps=1", f"out_dir={out}", *TINY], capsys)
        assert str(out) in line and f"pid {first.pid}" in line and "--resume" in line
        line = _fails_fast(
            ["train", "tiny_bool", "train.steps=1", f"out_dir={out}", "--overwrite", *TINY], capsys
        )
        assert f"pid {first.pid}" in line
    finally:
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
    assert first.returncode == 128 + signal.SIGTERM
    # the first run's checkpoint is its own, and a resume may take the folder over at once
    from looplm.model.checkpoint import read_meta

    step = read_meta(out / "ckpt")["state"]["step"]
    assert step >= 2
    argv = ["train", "tiny_bool", f"train.steps={step + 1}", f"out_dir={out}", "--resume", *TINY]
    assert main(argv) == 0


# ----------------------------------------------------------------------------- signals
_DEMO = textwrap.dedent(
    """
    import sys
    import looplm.experiments.demo as demo
    from looplm.cli import main

    real = demo.load_config
    demo.DEPTHS = [1, 2]
    demo.BUDGETS = {"default": (2, 16), "quick": (2, 16)}

    def load_config(name, overrides):  # the second method trains until it is stopped
        small = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "train.batch_size=4"]
        cfg = real(name, [*overrides, *small])
        if cfg.model.recurrence == "scse":
            cfg.train.steps = 100000
        return cfg

    demo.load_config = load_config
    sys.exit(main(["demo", "--out", sys.argv[1], "--methods", "looped,scse,tuned_adapter"]))
    """
)


def test_sigterm_stops_the_whole_demo_and_keeps_what_was_finished(tmp_path):
    signum = signal.SIGTERM
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOOPLM_NO_PROGRESS": "1"}
    out = tmp_path / "demo"
    proc = subprocess.Popen(
        [sys.executable, "-c", _DEMO, str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    seen: list[str] = []
    try:
        for line in proc.stdout:
            seen.append(line)
            if line.startswith("[demo] training scse"):
                break
        time.sleep(1.0)  # inside the second training
        proc.send_signal(signum)
        rest, err = proc.communicate(timeout=60)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 128 + signum, err
    assert "[demo] training tuned_adapter" not in rest  # the command stopped, not one training
    assert signal.Signals(signum).name in err and "Traceback" not in err
    kept = json.loads((out / "results.json").read_text())
    assert set(kept["methods"]) == {"looped"} and kept["interrupted"] is True
    assert (out / "scse" / "ckpt" / "model.safetensors").exists()  # resumable


# ----------------------------------------------------------------------------- tracebacks
def test_export_onto_a_full_disk_is_one_line(ckpt, tmp_path, monkeypatch, capsys):
    """safetensors' writer reports a full disk as its own exception type (what a real full
    file system gives, simulated in-process)."""
    import safetensors
    import safetensors.torch

    def disk_full(*args, **kwargs):
        raise safetensors.SafetensorError(
            "Error while serializing: I/O error: No space left on device (os error 28)"
        )

    monkeypatch.setattr(safetensors.torch, "serialize_file", disk_full)
    out = tmp_path / "hf"
    capsys.readouterr()
    assert main(["export", str(ckpt), str(out)]) == 1
    line = one_line_error(capsys.readouterr().err)
    assert str(out) in line and "no space left" in line
    assert not out.exists() and not (tmp_path / ".hf.tmp").exists()


def test_lm_eval_with_an_unknown_task_is_one_line(ckpt, monkeypatch, capsys):
    pytest.importorskip("lm_eval", reason="lm-eval is not installed (pip install 'looplm[lmeval]')")
    import lm_eval.tasks

    class OwnTasksOnly(lm_eval.tasks.TaskManager):  # skip indexing the harness's ~10k tasks
        def __init__(self, *args, **kwargs):
            super().__init__(*args, **{**kwargs, "include_defaults": False})

    monkeypatch.setattr(lm_eval.tasks, "TaskManager", OwnTasksOnly)
    argv = ["lm-eval", "--model", "looplm", "--model_args", f"pretrained={ckpt}"]
    line = _fails_fast([*argv, "--tasks", "nosuchtask"], capsys, limit_s=60)
    assert "nosuchtask" in line and "lm-eval ls tasks" in line


# ----------------------------------------------------------------------------- weak errors
def _story(path: Path) -> Path:
    words = "the river ran past the old mill and the miller watched the water".split()
    docs = [" ".join(words[(i + j) % len(words)] for j in range(40)) for i in range(12)]
    path.write_text("\n\n".join(docs) + "\n", encoding="utf-8")
    return path


def test_a_file_where_a_folder_belongs_is_named(ckpt, tmp_path, capsys):
    afile = tmp_path / "afile"
    afile.write_text("x")
    story = _story(tmp_path / "story.txt")
    cases = [
        ["data", "prepare", f"text:{story}", "--tokenizer", "bytes", "--out", str(afile)],
        ["diagnose", str(ckpt), "--out", str(afile), "--batches", "1", "--loops", "2"],
        ["demo", "--out", str(afile), "--methods", "scse"],
        [
            "train",
            "own_text",
            f"data.dataset=text:{story}",
            f"data.cache_dir={afile}",
            "train.steps=1",
            f"out_dir={tmp_path / 'run'}",
            *TINY,
        ],  # fmt: skip
        ["train", "tiny_bool", "train.steps=1", f"out_dir={afile / 'run'}", *TINY],
    ]
    for argv in cases:
        capsys.readouterr()
        code = _bounded(lambda argv=argv: main(argv), 60)
        line = one_line_error(capsys.readouterr().err)
        assert code in (1, 2) and str(afile) in line and "must be a folder" in line, argv
        assert "File exists" not in line and "Not a directory" not in line
    assert afile.read_text() == "x"


def test_a_full_disk_under_the_store_says_disk_full(tmp_path, monkeypatch):
    """SQLite reports a full disk during a journal write as a bare "disk I/O error"."""
    import shutil
    import sqlite3

    from looplm.errors import LoopLMError
    from looplm.results import store as store_mod

    path = _store_with(tmp_path / "r.sqlite", ["scse"])
    st = store_mod.ResultsStore(path)
    usage = shutil.disk_usage(tmp_path)
    monkeypatch.setattr(shutil, "disk_usage", lambda p: usage._replace(free=4096))

    def io_error(conn):
        raise sqlite3.OperationalError("disk I/O error")

    with pytest.raises(LoopLMError, match="disk full") as info:
        st._retry(io_error)
    assert str(path) in str(info.value)
    from looplm.results.export import load_records

    assert [r.method for r in load_records(path)] == ["scse"] * 3  # nothing lost


# ----------------------------------------------------------------------------- token caches
_KILLED_WRITER = textwrap.dedent(
    """
    import sys, time
    import looplm.data.cache as cache
    from looplm.cli import main

    real = cache._batches
    cache._BATCH_DOCS = 2

    def stalls(docs):  # a long tokenization, caught half-written
        for i, batch in enumerate(real(docs)):
            yield batch
            if i >= 2:
                print("writing", flush=True)
                time.sleep(600)

    cache._batches = stalls
    main(["data", "prepare", f"text:{sys.argv[1]}", "--tokenizer", "bytes", "--out", sys.argv[2]])
    """
)


def _temporaries(folder: Path) -> list[Path]:
    return sorted(folder.glob(".*.tmp"))


def test_a_killed_prepare_leaves_no_temporary_behind(tmp_path, capsys, caplog):
    story = _story(tmp_path / "story.txt")
    cache = tmp_path / "cache"
    env = {**os.environ, "PYTHONPATH": str(REPO), "LOOPLM_NO_PROGRESS": "1"}
    proc = subprocess.Popen(
        [sys.executable, "-c", _KILLED_WRITER, str(story), str(cache)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        assert _bounded(lambda: proc.stdout.readline(), 60) == "writing\n"
        (left,) = _temporaries(cache)  # the half-written token file
        # a live writer's temporary is not touched by another run in the same folder
        argv = ["data", "prepare", f"text:{story}", "--tokenizer", "bytes", "--out", str(cache)]
        assert main([*argv, "--split", "validation"]) == 0
        assert _temporaries(cache) == [left]
    finally:
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait()
    assert _temporaries(cache) == [left]  # what kill -9 leaves
    caplog.clear()
    assert main(argv) == 0
    assert _temporaries(cache) == []  # the next run removed it (the writer is gone) ...
    assert str(left) in caplog.text  # ... and said so
    capsys.readouterr()
    assert main(["data", "info", "--verify", str(cache)]) == 0
    assert "[ok]" in capsys.readouterr().out


def test_tokenizing_prints_progress_lines_where_no_bar_is_drawn(tmp_path, monkeypatch, capsys):
    import looplm.data.cache as cache_mod

    story = _story(tmp_path / "story.txt")
    monkeypatch.setattr(
        cache_mod, "_LINE_EVERY_S", 0.0, raising=False
    )  # a line per batch, for the test
    monkeypatch.setattr(cache_mod, "_BATCH_DOCS", 4)
    argv = ["data", "prepare", f"text:{story}", "--tokenizer", "bytes"]
    monkeypatch.delenv("LOOPLM_NO_PROGRESS", raising=False)
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    lines = [x for x in capsys.readouterr().err.splitlines() if x.startswith("tokenizing ")]
    assert len(lines) >= 2 and "documents" in lines[-1] and "tokens" in lines[-1]
    monkeypatch.setenv("LOOPLM_NO_PROGRESS", "1")
    assert main([*argv, "--out", str(tmp_path / "b")]) == 0
    assert "tokenizing " not in capsys.readouterr().err


def test_a_token_cache_with_flipped_bytes_is_not_trained_on(tmp_path, caplog):
    """Every open checks the token file's sha256: a flipped byte is named and rebuilt."""
    from looplm.data.cache import list_caches

    story = _story(tmp_path / "story.txt")
    cache = tmp_path / "cache"
    run = ["train", "own_text", f"data.dataset=text:{story}", f"data.cache_dir={cache}",
           "train.steps=1", *TINY]  # fmt: skip
    assert main([*run, f"out_dir={tmp_path / 'a'}"]) == 0
    (train_bin,) = cache.glob("*.train.bytes.bin")
    data = bytearray(train_bin.read_bytes())
    data[10] ^= 0x01
    train_bin.write_bytes(bytes(data))
    assert list_caches(cache, verify=True)[0]["status"].startswith("corrupt")
    caplog.clear()
    assert main([*run, f"out_dir={tmp_path / 'b'}"]) == 0
    assert "checksum mismatch" in caplog.text and str(train_bin) in caplog.text
    assert all(c["status"] == "ok" for c in list_caches(cache, verify=True))


def test_ctrl_c_stops_the_whole_demo(tmp_path, monkeypatch, capsys):
    """The same in-process: a real SIGINT, sent at the second training's third step."""
    import looplm.experiments.demo as demo
    import looplm.training.loop as train

    monkeypatch.setattr(demo, "DEPTHS", [1, 2])
    monkeypatch.setattr(demo, "BUDGETS", {"default": (2, 16), "quick": (2, 16)})
    real_load, real_fit = demo.load_config, train.fit
    small = ["model.d_model=32", "model.n_heads=2", "model.d_ff=64", "train.batch_size=4"]

    def load_config(name, overrides):
        cfg = real_load(name, [*overrides, *small])
        if cfg.model.recurrence == "scse":
            cfg.train.steps = 100000
        return cfg

    def ctrl_c_at_step_3(ts, m):
        if ts.step == 3:
            os.kill(os.getpid(), signal.SIGINT)

    def fit(cfg, **kw):
        return real_fit(cfg, callbacks=[ctrl_c_at_step_3], **kw)

    monkeypatch.setattr(demo, "load_config", load_config)
    monkeypatch.setattr(train, "fit", fit)
    out = tmp_path / "demo"
    argv = ["demo", "--out", str(out), "--methods", "looped,scse,tuned_adapter"]
    assert _bounded(lambda: main(argv), 120) == 130
    captured = capsys.readouterr()
    assert "training tuned_adapter" not in captured.out
    assert "SIGINT" in captured.err and str(out) in captured.err
    kept = json.loads((out / "results.json").read_text())
    assert set(kept["methods"]) == {"looped"} and kept["interrupted"] is True
