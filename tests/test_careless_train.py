"""train / generate / eval under a careless user: signals during the final validation and a
second signal, absurd seeds and batch sizes, run folders inside checkpoints or behind symlink
loops, a stdout that cannot be written, a store that cannot be written, and a model whose loss
is NaN. Each is one line (or a clean stop that keeps the trained steps), never a traceback."""

from __future__ import annotations

import errno
import json
import os
import signal
import sqlite3
import time
from pathlib import Path

import pytest
import torch

from looplm.cli import main
from looplm.model import model_from_config
from looplm.model.checkpoint import read_meta, save_checkpoint
from looplm.settings.config import load_config
from looplm.training.loop import fit

SMALL = [
    "model.d_model=32",
    "model.n_heads=2",
    "model.d_ff=64",
    "train.depth_max=2",
    "train.depth_min=1",
    "train.log_every=1",
    "train.warmup=1",
    "eval.n_examples=16",
    "eval.batch_size=8",
    "train.batch_size=8",
]


def _cfg(out: Path, *extra: str):
    return load_config("tiny_bool", [*SMALL, f"out_dir={out}", *extra])


def _error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert "Traceback" not in err
    lines = [x for x in err.splitlines() if x.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def _checkpoint(tmp_path: Path, nan: bool = False) -> Path:
    cfg = _cfg(tmp_path / "run")
    model = model_from_config(cfg.model)
    if nan:
        with torch.no_grad():
            for p in model.parameters():
                p.fill_(float("nan"))
    return save_checkpoint(tmp_path / "run" / "ckpt", model, cfg)


# ----------------------------------------------------------------------------- signals
def test_a_signal_during_the_final_validation_stops_at_once_and_keeps_the_steps(
    tmp_path, monkeypatch
):
    from looplm.data.sources import TaskSource

    real = TaskSource.eval_batches

    def huge_held_out_split(self, batch_size, max_tokens=None, n_examples=0):
        batches = real(self, batch_size, max_tokens, 16)
        first = next(batches)
        os.kill(os.getpid(), signal.SIGTERM)  # the user stops the run here
        for _ in range(100_000):  # a held-out split that takes minutes to read
            yield first

    monkeypatch.setattr(TaskSource, "eval_batches", huge_held_out_split)
    t0 = time.monotonic()
    last = fit(_cfg(tmp_path / "run", "train.steps=3", "train.eval_every=0"), progress=False)
    assert time.monotonic() - t0 < 60
    assert last["stopped"] == "signal" and last["signal"] == signal.SIGTERM
    assert read_meta(tmp_path / "run" / "ckpt")["state"]["step"] == 3  # the trained steps


def test_a_second_signal_stops_now(tmp_path):
    steps = []

    def two_signals(ts, m):
        steps.append(ts.step)
        if ts.step == 2:
            os.kill(os.getpid(), signal.SIGTERM)  # asks for a stop after this step ...
            os.kill(os.getpid(), signal.SIGINT)  # ... and this one means now
        return False

    cfg = _cfg(tmp_path / "run", "train.steps=50", "train.ckpt_every=1")
    last = fit(cfg, progress=False, callbacks=[two_signals])
    assert last["stopped"] == "signal" and last["signal"] == signal.SIGINT
    assert steps == [1, 2]
    assert read_meta(tmp_path / "run" / "ckpt")["state"]["step"] == 2


# ----------------------------------------------------------------------------- bad values
def test_generate_with_a_seed_past_64_bits_is_one_line(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    assert main(["generate", str(ckpt), "--prompt", "a", "--seed", str(2**70)]) == 2
    assert "--seed" in _error(capsys)
    prompts = tmp_path / "p.jsonl"
    prompts.write_text(json.dumps({"prompt": "a", "seed": 2**70}) + "\n")
    assert main(["generate", str(ckpt), "--prompts", str(prompts)]) == 2
    assert "seed=" in _error(capsys)


def test_a_batch_that_cannot_fit_is_refused_before_the_first_step(tmp_path, capsys):
    out = tmp_path / "big"
    t0 = time.monotonic()
    code = main(["train", "tiny_bool", *SMALL[:-1], "train.batch_size=100000000", f"out_dir={out}"])
    assert code == 2 and time.monotonic() - t0 < 60
    err = _error(capsys)
    assert "train.batch_size=100000000" in err and "GiB" in err
    assert not out.exists()  # no folder holding only a lock file


def test_a_train_refused_for_missing_data_leaves_no_folder(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOOPLM_DATA_DIR", str(tmp_path / "no_data"))
    out = tmp_path / "wt"
    args = [f"out_dir={out}", f"data.cache_dir={tmp_path / 'cache'}", "train.steps=1"]
    assert main(["train", "tiny_wt2", *args]) == 2
    _error(capsys)
    assert not out.exists()


# ----------------------------------------------------------------------------- folders
def test_out_dir_inside_a_checkpoint_is_refused(tmp_path, capsys):
    ckpt = _checkpoint(tmp_path)
    for out in (ckpt / "inner", ckpt):
        assert main(["train", "tiny_bool", *SMALL, f"out_dir={out}"]) == 2
        assert "checkpoint folder" in _error(capsys)
    assert sorted(p.name for p in ckpt.iterdir()) == ["model.safetensors", "state.json"]


def test_out_dir_that_is_a_symlink_loop_is_named(tmp_path, capsys):
    loop = tmp_path / "loop"
    loop.symlink_to(loop)
    assert main(["train", "tiny_bool", *SMALL, f"out_dir={loop}"]) == 2
    assert "symbolic link that leads nowhere" in _error(capsys)


def test_a_full_stdout_is_named(tmp_path, monkeypatch, capsys):
    ckpt = _checkpoint(tmp_path)

    class Full:
        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

        def flush(self):
            pass

    monkeypatch.setenv("LOOPLM_NO_PROGRESS", "1")
    monkeypatch.setattr("sys.stdout", Full())
    assert main(["eval", str(ckpt), "--depths", "1"]) == 1
    err = _error(capsys)
    assert "standard output" in err and "space" in err


# ----------------------------------------------------------------------------- the store
def test_a_store_in_a_read_only_folder_names_the_folder_and_cause(tmp_path, monkeypatch):
    from looplm.errors import LoopLMError
    from looplm.results import store as store_mod

    folder = tmp_path / "ro"
    folder.mkdir()

    def unable(*args, **kwargs):
        raise sqlite3.OperationalError("unable to open database file")

    real_access = os.access
    monkeypatch.setattr(store_mod.sqlite3, "connect", unable)
    monkeypatch.setattr(
        store_mod.os, "access", lambda p, m: False if Path(p) == folder else real_access(p, m)
    )
    with pytest.raises(LoopLMError) as exc:
        store_mod.ResultsStore(folder / "results.sqlite")
    assert str(folder) in str(exc.value) and "read-only" in str(exc.value)
    monkeypatch.setattr(store_mod.os, "access", real_access)

    def io_error(*args, **kwargs):
        raise sqlite3.OperationalError("disk I/O error")

    monkeypatch.setattr(store_mod.sqlite3, "connect", io_error)
    monkeypatch.setattr("looplm.errors.disk_nearly_full", lambda path, below=0: True)
    with pytest.raises(LoopLMError) as exc:
        store_mod.ResultsStore(folder / "results.sqlite")
    assert str(folder) in str(exc.value) and "full" in str(exc.value)


# ----------------------------------------------------------------------------- NaN
def test_eval_of_a_nan_model_writes_valid_json(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("LOOPLM_NO_PROGRESS", "1")
    ckpt = _checkpoint(tmp_path, nan=True)
    out = tmp_path / "eval.json"
    assert main(["eval", str(ckpt), "--depths", "1", "--out", str(out)]) == 0
    captured = capsys.readouterr()

    def no_nan(name):
        raise AssertionError(f"{name} is not JSON")

    for text in (captured.out, out.read_text()):
        row = json.loads(text, parse_constant=no_nan)["results"][0]
        assert row["nll"] is None
    assert "not finite" in captured.err


def test_a_sweep_refused_for_missing_data_leaves_no_lock_only_folders(
    tmp_path, monkeypatch, capsys
):
    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("LOOPLM_DATA_DIR", str(tmp_path / "no_data"))
    assert main(["sweep", "wt2_tiny", "--no-report"]) == 2
    _error(capsys)
    assert not (tmp_path / "runs").exists(), sorted(tmp_path.rglob("*"))
