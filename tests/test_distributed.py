"""Distributed training on the CPU (gloo): DDP and FSDP2 match one process, checkpoints move
between world sizes, and accumulation adds no gradient all-reduce.

Every comparison uses dropout 0 and the same global batch: 2 ranks × b rows (× accumulation) are
the rows of one process's 2b-row batch (looplm.data.sources), and the loss is the token mean over
the whole global batch, so parameters agree to float rounding (summation order only).
"""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.multiprocessing as mp

from looplm.model.checkpoint import load_checkpoint
from looplm.settings.config import load_config

REPO = Path(__file__).resolve().parents[1]
ATOL = 2e-6  # float32 summation-order differences after a few AdamW steps (observed ~1e-7)


def _cfg(out: Path, *extra: str):
    return load_config(
        "tiny_bool",
        [
            "train.steps=6",
            "train.warmup=2",
            "train.log_every=1",
            "train.depth_max=3",
            "train.lr=0.003",
            "eval.n_examples=16",
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            "model.dropout=0.0",
            f"out_dir={out}",
            *extra,
        ],
    )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _max_diff(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> float:
    assert a.keys() == b.keys()
    return max(float((a[k].float() - b[k].float()).abs().max()) for k in a)


def _weights(ckpt: Path) -> dict[str, torch.Tensor]:
    model, _, _ = load_checkpoint(ckpt)
    return {k: v.clone() for k, v in model.state_dict().items()}


def _adam_moments(ckpt: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(ckpt / "optimizer.safetensors"))


def _worker(rank: int, world: int, port: int, tmp: str) -> None:
    os.environ.update(
        MASTER_ADDR="127.0.0.1",
        MASTER_PORT=str(port),
        WORLD_SIZE=str(world),
        RANK=str(rank),
        LOCAL_RANK=str(rank),
        LOOPLM_NO_PROGRESS="1",
    )
    torch.set_num_threads(1)
    from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

    from looplm.training.distributed import cleanup
    from looplm.training.loop import save, setup, train_step

    tmp_p = Path(tmp)
    # (a) FSDP2 from scratch, 3 steps (saved: the full state gathered from 2 shards)
    ts = setup(_cfg(tmp_p / "fsdp", "train.parallel=fsdp", "train.batch_size=4"))
    info = ts.dist
    for _ in range(3):
        train_step(ts)
    save(ts)
    # (b) FSDP2 resuming a world-size-1 checkpoint (optimizer state cut into shards), 3 more steps
    ts = setup(
        _cfg(tmp_p / "w1to2", "train.parallel=fsdp", "train.batch_size=4"), resume=True, dist=info
    )
    for _ in range(3):
        train_step(ts)
    save(ts)
    # (c) DDP: steps alternate 2 rows × 2 accumulation and 4 rows × 1 (the same global batch);
    # a comm hook counts gradient all-reduces per step.
    ts = setup(_cfg(tmp_p / "ddp", "train.grad_accum=2", "train.batch_size=2"), dist=info)
    n = [0]

    def hook(state, bucket):
        n[0] += 1
        return allreduce_hook(state, bucket)

    ts.wrapped.register_comm_hook(torch.distributed.group.WORLD, hook)
    calls = []
    for accum, b in ((2, 2), (1, 4), (2, 2)):
        ts.cfg.train.grad_accum, ts.cfg.train.batch_size = accum, b
        before = n[0]
        train_step(ts)
        calls.append(n[0] - before)
    save(ts)
    if rank == 0:
        (tmp_p / "calls.json").write_text(json.dumps(calls))
    cleanup(info)


def test_fsdp_ddp_match_one_process_and_resume_across_world_sizes(tmp_path: Path) -> None:
    from looplm.training.loop import save, setup, train_step

    # Reference: one process, 8 rows per step; S3 = its step-3 checkpoint, R6 = its step 6.
    ts = setup(_cfg(tmp_path / "single", "train.batch_size=8"))
    for _ in range(3):
        train_step(ts)
    save(ts)
    shutil.copytree(tmp_path / "single" / "ckpt", tmp_path / "s3")
    (tmp_path / "w1to2").mkdir()
    shutil.copytree(tmp_path / "single" / "ckpt", tmp_path / "w1to2" / "ckpt")
    for _ in range(3):
        train_step(ts)
    save(ts)
    r6 = _weights(tmp_path / "single" / "ckpt")
    s3 = _weights(tmp_path / "s3")

    mp.spawn(_worker, args=(2, _free_port(), str(tmp_path)), nprocs=2, join=True)

    # FSDP (2 ranks × 4 rows) after 3 steps == one process × 8 rows; AdamW moments too.
    assert _max_diff(_weights(tmp_path / "fsdp" / "ckpt"), s3) < ATOL
    assert (
        _max_diff(_adam_moments(tmp_path / "fsdp" / "ckpt"), _adam_moments(tmp_path / "s3")) < ATOL
    )
    # world size 1 -> 2 (FSDP) resume continues the reference run
    assert _max_diff(_weights(tmp_path / "w1to2" / "ckpt"), r6) < ATOL
    # DDP (2 ranks × 2 rows × 2 accumulation steps) == one process × 8 rows
    assert _max_diff(_weights(tmp_path / "ddp" / "ckpt"), s3) < ATOL
    # accumulation reduces gradients once per step, not once per micro-batch
    calls = json.loads((tmp_path / "calls.json").read_text())
    assert calls[0] == calls[1] == calls[2] > 0, calls

    # world size 2 -> 1: resume the FSDP checkpoint in one process and finish the 6-step run
    ts = setup(_cfg(tmp_path / "fsdp", "train.batch_size=8"), resume=True)
    assert ts.step == 3
    for _ in range(3):
        train_step(ts)
    got = {k: v.detach().clone() for k, v in ts.raw_model.state_dict().items()}
    assert _max_diff(got, r6) < ATOL
    # and the comparison is sensitive: the step-3 weights are far from the step-6 ones
    assert _max_diff(s3, r6) > 1e-3


def test_torchrun_cli_ddp_matches_one_process(tmp_path: Path) -> None:
    from looplm.training.loop import fit

    # norm_reset's gain (period 4) is unused at T < 4: DDP must cope with unused parameters.
    common = [
        "model.recurrence=norm_reset",
        "train.depth_max=3",
        "train.steps=6",
        "train.log_every=3",
        "model.d_model=32",
        "model.n_heads=2",
        "model.d_ff=64",
        "eval.n_examples=16",
    ]
    env = {**os.environ, "LOOPLM_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(_free_port()),
        "-m",
        "looplm",
        "train",
        "configs/tiny_bool.yaml",
        *common,
        "train.batch_size=16",
        f"out_dir={tmp_path / 'ddp'}",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=240)
    assert proc.returncode == 0, proc.stderr[-3000:]
    reports = [line for line in proc.stdout.splitlines() if line.startswith("{")]
    assert len(reports) == 1, proc.stdout  # rank 0 reports, rank 1 stays quiet
    assert json.loads(reports[0])["step"] == 6
    lines = (tmp_path / "ddp" / "metrics.jsonl").read_text().splitlines()
    assert [json.loads(x)["step"] for x in lines] == [3, 6, 6]  # written once (by rank 0)

    torch.manual_seed(0)
    fit(
        load_config("tiny_bool", [*common, "train.batch_size=32", f"out_dir={tmp_path / 'one'}"]),
        progress=False,
    )
    assert (
        _max_diff(_weights(tmp_path / "ddp" / "ckpt"), _weights(tmp_path / "one" / "ckpt")) < ATOL
    )


@pytest.mark.parametrize("mode", ["ddp", "fsdp"])
def test_parallel_mode_is_validated(mode: str, tmp_path: Path) -> None:
    from looplm.errors import LoopLMError

    assert _cfg(tmp_path, f"train.parallel={mode}").train.parallel == mode
    with pytest.raises(LoopLMError, match="train.parallel='zero'; allowed: ddp, fsdp"):
        _cfg(tmp_path, "train.parallel=zero")
