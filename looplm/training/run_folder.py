"""A run folder's rules: what may be written over, paths stored absolute, resume checks, and the
log line a run prints where no progress bar is drawn."""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from looplm.errors import LoopLMError
from looplm.model.checkpoint import checkpoint_exists, read_meta
from looplm.settings.config import RunConfig


def check_resume_config(saved: RunConfig, cfg: RunConfig, ckpt: Path | str, step: int) -> None:
    """Raise naming the first model setting that differs between a checkpoint and ``cfg``, or
    when ``cfg`` asks for no steps beyond the checkpoint's ``step``."""
    old, new = dataclasses.asdict(saved.model), dataclasses.asdict(cfg.model)
    for key in new:
        if old.get(key) != new[key]:
            raise LoopLMError(
                f"cannot resume: model.{key}={new[key]!r} differs from the checkpoint's "
                f"{old.get(key)!r} ({ckpt}); resume with the checkpoint's value, or train into "
                "a new out_dir"
            )
    if step >= cfg.train.steps:
        raise LoopLMError(
            f"cannot resume: {ckpt} is at step {step} and train.steps={cfg.train.steps} asks for "
            f"no more; pass train.steps=N with N > {step} to train on"
        )


def check_out_dir(cfg: RunConfig, resume: bool = False, overwrite: bool = False) -> None:
    """Refuse to start a fresh run over a folder that holds a checkpoint unless asked: ``resume``
    continues it, ``overwrite`` replaces it (not both)."""
    if resume and overwrite:
        raise LoopLMError("--resume continues <out_dir>/ckpt and --overwrite replaces it; pick one")
    ckpt = Path(training_folder(cfg).out_dir) / "ckpt"
    if resume or overwrite or not checkpoint_exists(ckpt):
        return
    step = read_meta(ckpt)["state"].get("step", "?")
    raise LoopLMError(
        f"{cfg.out_dir} already holds a checkpoint (step {step}); pass --resume to continue it "
        "or --overwrite to replace it"
    )


#: Held by the training that writes a run folder (beside the sweep's own cell lock).
TRAIN_LOCK = ".train.lock"


def training_folder(cfg: RunConfig) -> RunConfig:
    """``cfg`` once its ``out_dir`` is usable: not empty (that would write into the current
    folder), not a file and not under one."""
    from looplm.settings.limits import check_output_folder

    check_output_folder("out_dir=", cfg.out_dir)
    out = Path(cfg.out_dir).absolute()
    for folder in (out, *out.parents):
        if (folder / "state.json").is_file() and (folder / "model.safetensors").is_file():
            where = "is" if folder == out else f"lies inside {folder}, which is"
            raise LoopLMError(
                f"out_dir={cfg.out_dir} {where} a checkpoint folder; a run folder holds its "
                "checkpoint in <out_dir>/ckpt: choose an out_dir outside it"
            )
    return cfg


@contextlib.contextmanager
def training_lock(out_dir: str | os.PathLike) -> Iterator[None]:
    """Hold ``<out_dir>/.train.lock`` for a whole training, so a second ``looplm train`` into the
    same folder fails at once instead of silently replacing the first one's checkpoint and
    metrics. The lock is the sweep cells' (:func:`looplm.io.file_lock`): the operating system
    releases it when the holder exits, kill -9 included, so a dead run never blocks a resume.
    The lock file names its holder (pid, host, start time) for the error message. Under torchrun
    rank 0 holds it for every rank of the job (the other ranks take no lock)."""
    if os.environ.get("RANK", "0") != "0":  # rank 0 holds it for every rank of a torchrun job
        yield
        return
    path = Path(out_dir) / TRAIN_LOCK
    # the folders this lock creates: out_dir and any missing parent (runs/ for runs/NAME)
    created = [q for q in (Path(out_dir), *Path(out_dir).parents) if not q.exists()]
    try:
        with _held(path, out_dir):
            yield
    except BaseException:
        # refused before writing anything (bad data, a setting found wrong late): leave no folder
        # that holds only the lock, nor the empty parents made for it
        folder = Path(out_dir)
        if created and folder.is_dir() and [p.name for p in folder.iterdir()] in ([TRAIN_LOCK], []):
            shutil.rmtree(out_dir, ignore_errors=True)
            for parent in created[1:]:
                try:
                    parent.rmdir()  # only while empty
                except OSError:
                    break
        raise


@contextlib.contextmanager
def _held(path: Path, out_dir: str | os.PathLike) -> Iterator[None]:
    from looplm.io import file_lock

    with file_lock(path, wait=False) as held:
        if not held:
            try:
                holder = path.read_text(encoding="utf-8").strip() or "another process"
            except OSError:
                holder = "another process"
            raise LoopLMError(
                f"{out_dir} is in use by another training ({holder}); fail-fast rather than "
                "overwrite it: wait for it to end (or stop it), then continue it with --resume, "
                "or train into another out_dir"
            )
        # written in place, not replaced: the lock lives on this file's inode
        with open(path, "w", encoding="utf-8") as f:
            stamp = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime())
            f.write(f"pid {os.getpid()} on {socket.gethostname()}, started {stamp}\n")
        yield


def with_absolute_paths(cfg: RunConfig) -> RunConfig:
    """``cfg`` with its data paths absolute (a ``text:`` corpus, ``data_dir``, ``cache_dir``, the
    ``init`` checkpoint and a LoRA adapter), so the config stored in the run folder and checkpoint
    reads the same files from any folder."""
    from looplm.data.cache import absolute_dataset

    def absolute(p: str | None) -> str | None:
        return str(Path(p).expanduser().resolve()) if p else p

    data = dataclasses.replace(
        cfg.data,
        dataset=absolute_dataset(cfg.data.dataset),
        data_dir=absolute(cfg.data.data_dir),
        cache_dir=absolute(cfg.data.cache_dir),
    )
    lora = dataclasses.replace(cfg.lora, adapter=absolute(cfg.lora.adapter) or "")
    return dataclasses.replace(cfg, data=data, init=absolute(cfg.init) or "", lora=lora)


def progress_line(m: dict[str, Any], total: int) -> str:
    """One log-friendly line for a logged step (``step 50/300  loss 2.4120  T=4 …``): what a run
    prints where no progress bar is drawn (its output goes to a log file or a pipe)."""
    parts = [f"step {m['step']}/{total}"]
    if "loss" in m:
        parts.append(f"loss {m['loss']:.4f}")
    if "loops" in m:
        parts.append(f"T={m['loops']}")
    if "val_loss" in m:
        parts.append(f"val_loss {m['val_loss']:.4f} (T={m.get('val_loops')})")
    if "val_accuracy" in m:
        parts.append(f"val_acc {m['val_accuracy']:.3f}")
    if "tok_per_s" in m:
        parts.append(f"{m['tok_per_s']:,.0f} tok/s")
    if "elapsed_s" in m:
        parts.append(f"{m['elapsed_s']:.0f} s")
    return "  ".join(parts)
