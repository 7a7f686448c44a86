"""Training: plain functions that read top to bottom.

    cfg = load_config("configs/tiny_bool.yaml", ["train.steps=200"])
    fit(cfg)                      # or fit(cfg, resume=True) to continue from <out_dir>/ckpt

Per optimizer step: draw the loop depth T uniformly from [depth_min, depth_max] (the same T on every
rank, since it comes from the run seed and the step), accumulate ``grad_accum`` micro-batches, clip
the global gradient norm, step AdamW with a cosine schedule after linear warmup. A non-finite loss or
gradient skips the update (or stops the run) without touching weights or optimizer state. SIGTERM and
SIGINT write a checkpoint before exiting. Metrics go to ``<out_dir>/metrics.jsonl``.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import os
import random
import signal
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looplm.checkpoint import load_checkpoint, load_optimizer_state, read_meta, save_checkpoint
from looplm.config import RunConfig, dump_config
from looplm.data.sources import DataSource, make_source, step_seed
from looplm.distributed import DistInfo, init_distributed
from looplm.errors import LoopLMError
from looplm.io import atomic_write_text
from looplm.model import model_from_config


# ----------------------------------------------------------------------------- schedule
def get_lr(step: int, cfg: RunConfig) -> float:
    """Linear warmup to ``lr`` over ``warmup`` steps, then cosine decay to ``min_lr_ratio·lr``."""
    tc = cfg.train
    if tc.warmup and step < tc.warmup:
        return tc.lr * (step + 1) / tc.warmup
    span = max(1, tc.steps - tc.warmup)
    progress = min(1.0, (step - tc.warmup) / span)
    min_lr = tc.lr * tc.min_lr_ratio
    return min_lr + 0.5 * (1.0 + math.cos(math.pi * progress)) * (tc.lr - min_lr)


def sample_depth(step: int, cfg: RunConfig) -> int:
    """The loop depth of optimizer step ``step``: uniform on [depth_min, depth_max], seeded."""
    tc = cfg.train
    return random.Random(step_seed(tc.seed, step, 0) ^ 0x5EED).randint(tc.depth_min, tc.depth_max)


# ----------------------------------------------------------------------------- setup
def resolve_device(name: str) -> torch.device:
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LoopLMError("train.device=cuda but no CUDA GPU is available; use cpu or auto")
    return torch.device(name)


def autocast_context(cfg: RunConfig, device: torch.device):
    """bf16 autocast on GPU (``auto``/``bf16``); a no-op otherwise."""
    mode = cfg.train.autocast
    if device.type == "cuda" and mode in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and mode == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(model: torch.nn.Module, cfg: RunConfig, device: torch.device):
    """AdamW; ≥2-D weights decay, norms/scalar gains do not; frozen parameters are left out."""
    tc = cfg.train
    no_decay = model.no_decay_parameters()
    if hasattr(model, "recurrence"):
        no_decay |= {id(p) for p in model.recurrence.no_decay_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]
    extra = {"fused": True} if device.type == "cuda" else {}
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), **extra)


def _rng_state() -> dict[str, Any]:
    st = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
        "python": list(random.getstate()[1]),
        "numpy": base64.b64encode(np.random.get_state()[1].tobytes()).decode(),
    }
    if torch.cuda.is_available():
        st["cuda"] = [
            base64.b64encode(s.numpy().tobytes()).decode() for s in torch.cuda.get_rng_state_all()
        ]
    return st


def _set_rng_state(st: dict[str, Any]) -> None:
    raw = np.frombuffer(base64.b64decode(st["torch"]), dtype=np.uint8).copy()
    torch.set_rng_state(torch.from_numpy(raw))
    if "cuda" in st and torch.cuda.is_available():
        states = [
            torch.from_numpy(np.frombuffer(base64.b64decode(s), dtype=np.uint8).copy())
            for s in st["cuda"]
        ]
        torch.cuda.set_rng_state_all(states[: torch.cuda.device_count()])


def seed_everything(seed: int) -> None:
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


@dataclass
class TrainState:
    """Everything :func:`fit` carries between steps."""

    cfg: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    source: DataSource
    device: torch.device
    dist: DistInfo
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    raw_model: torch.nn.Module | None = None


def setup(cfg: RunConfig, resume: bool = False, dist: DistInfo | None = None) -> TrainState:
    """Build model, optimizer and data; restore them from ``<out_dir>/ckpt`` when resuming."""
    device = resolve_device(cfg.train.device)
    dist = dist or init_distributed(device.type)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
    out = Path(cfg.out_dir)
    ckpt = out / "ckpt"
    seed_everything(cfg.train.seed + dist.rank)
    if device.type == "cuda":
        torch.backends.cuda.matmul.allow_tf32 = True
        torch.backends.cudnn.allow_tf32 = True
    step = 0
    if resume:
        if not (ckpt / "state.json").exists():
            raise LoopLMError(f"cannot resume: no checkpoint at {ckpt}")
        model, saved_cfg, meta = load_checkpoint(ckpt, map_location=device)
        if saved_cfg.model != cfg.model:
            raise LoopLMError(
                f"cannot resume: the model config differs from the checkpoint's ({ckpt})"
            )
        model.train()
        step = int(meta["state"]["step"])
    else:
        model = model_from_config(cfg.model).to(device)
    optimizer = make_optimizer(model, cfg, device)
    if resume:
        load_optimizer_state(ckpt, optimizer)
        rng = read_meta(ckpt)["state"].get("rng")
        if rng and not dist.enabled:
            _set_rng_state(rng)
    source = make_source(cfg.data, cfg.model, cfg.train.seed)
    raw = model
    if dist.enabled:
        from looplm.distributed import wrap_model  # DDP/FSDP live in distributed.py

        model = wrap_model(model, cfg, dist, device)
    if cfg.train.compile:
        model = torch.compile(model)
    return TrainState(cfg, model, optimizer, source, device, dist, step, [], raw)


# ----------------------------------------------------------------------------- one step
def train_step(ts: TrainState) -> dict[str, Any]:
    """One optimizer step (with gradient accumulation). Returns its metrics."""
    cfg, tc = ts.cfg, ts.cfg.train
    model, opt = ts.model, ts.optimizer
    model.train()
    lr = get_lr(ts.step, cfg)
    for g in opt.param_groups:
        g["lr"] = lr
    loops = sample_depth(ts.step, cfg)
    core = ts.raw_model or model
    loss_fn = (
        core.loss if model is core else model
    )  # wrapped models forward to loss (see distributed)
    total = 0.0
    n_tokens = 0
    opt.zero_grad(set_to_none=True)
    for micro in range(tc.grad_accum):
        x, y = ts.source.train_batch(ts.step, micro, tc.batch_size, ts.dist.rank)
        x, y = x.to(ts.device, non_blocking=True), y.to(ts.device, non_blocking=True)
        sync = contextlib.nullcontext()
        if ts.dist.enabled and micro < tc.grad_accum - 1 and hasattr(model, "no_sync"):
            sync = model.no_sync()  # all-reduce only on the last micro-batch
        with sync, autocast_context(cfg, ts.device):
            kwargs = dict(
                loops=loops,
                objective=tc.objective,
                truncate_k=tc.truncate_k,
                checkpoint_loops=tc.checkpoint_loops,
            )
            loss = loss_fn(x, y, **kwargs) if model is core else model(x, y, **kwargs)
            (loss / tc.grad_accum).backward()
        total += float(loss.detach())
        n_tokens += int((y != -100).sum())
    loss_val = total / tc.grad_accum
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in model.parameters() if p.grad is not None], tc.clip
    )
    finite = math.isfinite(loss_val) and bool(torch.isfinite(grad_norm))
    if finite:
        opt.step()
    else:
        opt.zero_grad(set_to_none=True)  # weights and moments untouched
        if tc.nonfinite == "stop":
            raise LoopLMError(f"non-finite loss/gradient at step {ts.step} (train.nonfinite=stop)")
    ts.step += 1
    return {
        "step": ts.step,
        "loss": loss_val,
        "lr": lr,
        "loops": loops,
        "grad_norm": float(grad_norm),
        "tokens": n_tokens * ts.dist.world_size,
        "skipped": not finite,
    }


@torch.no_grad()
def evaluate_loss(ts: TrainState, loops: int | None = None) -> dict[str, float]:
    """Token-weighted validation NLL (and accuracy for tasks) at depth ``loops``."""
    cfg = ts.cfg
    model = ts.raw_model or ts.model
    loops = loops or cfg.train.depth_max
    model.eval()
    nll, n, correct = 0.0, 0, 0
    for i, (x, y) in enumerate(
        ts.source.eval_batches(cfg.eval.batch_size, cfg.eval.max_tokens, cfg.eval.n_examples)
    ):
        if ts.source.is_task is False and i >= cfg.train.eval_batches:
            break
        x, y = x.to(ts.device), y.to(ts.device)
        with autocast_context(cfg, ts.device):
            (h,) = model.hidden_states(x, loops)
            valid = y != -100
            logits = model.readout(h[valid]).float()
        tgt = y[valid]
        nll += float(torch.nn.functional.cross_entropy(logits, tgt, reduction="sum"))
        n += int(tgt.numel())
        correct += int((logits.argmax(-1) == tgt).sum())
    model.train()
    out = {"val_loss": nll / max(n, 1), "val_loops": loops, "val_tokens": n}
    if ts.source.is_task:
        out["val_accuracy"] = correct / max(n, 1)
    return out


# ----------------------------------------------------------------------------- the loop
class _StopFlag:
    def __init__(self) -> None:
        self.signal: int | None = None

    def __call__(self, signum, frame) -> None:
        self.signal = signum


def save(ts: TrainState) -> Path:
    """Write ``<out_dir>/ckpt`` (rank 0)."""
    path = Path(ts.cfg.out_dir) / "ckpt"
    if ts.dist.is_main:
        save_checkpoint(
            path,
            ts.raw_model or ts.model,
            ts.cfg,
            optimizer=ts.optimizer,
            state={"step": ts.step, "rng": _rng_state()},
        )
    return path


def _open_metrics(out: Path, resume_step: int):
    """metrics.jsonl, with lines beyond the resumed step dropped (so a resumed log has no repeats)."""
    path = out / "metrics.jsonl"
    if path.exists():
        keep = []
        for line in path.read_text().splitlines():
            try:
                rec = json.loads(line)
            except json.JSONDecodeError:
                continue
            if rec.get("step", 0) <= resume_step:
                keep.append(line)
        atomic_write_text(path, "".join(k + "\n" for k in keep))
    return path.open("a")


def fit(
    cfg: RunConfig, resume: bool = False, progress: bool | None = None, quiet: bool = False
) -> dict[str, Any]:
    """Train according to ``cfg``; returns the last metrics (and final validation numbers)."""
    ts = setup(cfg, resume=resume)
    out = Path(cfg.out_dir)
    if ts.dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        atomic_write_text(out / "config.yaml", dump_config(cfg))
    metrics_f = _open_metrics(out, ts.step) if ts.dist.is_main else None
    tb = None
    if cfg.train.tensorboard and ts.dist.is_main:
        try:
            from torch.utils.tensorboard import SummaryWriter

            tb = SummaryWriter(str(out / "tb"))
        except ImportError:
            raise LoopLMError(
                "train.tensorboard=true needs `pip install looplm[tensorboard]`"
            ) from None
    stop = _StopFlag()
    old = {s: signal.signal(s, stop) for s in (signal.SIGTERM, signal.SIGINT)}
    show = (
        progress
        if progress is not None
        else (sys.stderr.isatty() and os.environ.get("LOOPLM_NO_PROGRESS") != "1")
    )
    from tqdm.auto import tqdm

    bar = tqdm(
        total=cfg.train.steps,
        initial=ts.step,
        disable=not show or not ts.dist.is_main,
        desc=f"train {cfg.model.recurrence}",
        dynamic_ncols=True,
    )
    last: dict[str, Any] = {}
    t0 = time.perf_counter()
    tokens_since, t_since = 0, t0
    try:
        while ts.step < cfg.train.steps:
            m = train_step(ts)
            tokens_since += m["tokens"]
            bar.update(1)
            bar.set_postfix(loss=f"{m['loss']:.3f}", T=m["loops"])
            if ts.step % cfg.train.log_every == 0 or ts.step == cfg.train.steps:
                now = time.perf_counter()
                m["tok_per_s"] = tokens_since / max(now - t_since, 1e-9)
                m["elapsed_s"] = now - t0
                tokens_since, t_since = 0, now
                if cfg.train.eval_every and ts.step % cfg.train.eval_every == 0:
                    m.update(evaluate_loss(ts))
                if metrics_f:
                    metrics_f.write(json.dumps(m) + "\n")
                    metrics_f.flush()
                if tb:
                    for k, v in m.items():
                        if isinstance(v, (int, float)) and not isinstance(v, bool):
                            tb.add_scalar(k, v, ts.step)
            last = m
            if cfg.train.ckpt_every and ts.step % cfg.train.ckpt_every == 0:
                save(ts)
            if stop.signal is not None:
                save(ts)
                if not quiet:
                    print(
                        f"signal {stop.signal}: checkpoint written at step {ts.step}",
                        file=sys.stderr,
                    )
                raise SystemExit(128 + stop.signal)
        final = evaluate_loss(ts)
        last.update(final)
        if metrics_f:
            metrics_f.write(json.dumps({"step": ts.step, **final}) + "\n")
        save(ts)
    finally:
        bar.close()
        if metrics_f:
            metrics_f.close()
        if tb:
            tb.close()
        for s, h in old.items():
            signal.signal(s, h)
    return last
