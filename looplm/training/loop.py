"""Training: plain functions that read top to bottom.

    cfg = load_config("configs/tiny_bool.yaml", ["train.steps=200"])
    fit(cfg)                      # or fit(cfg, resume=True) to continue from <out_dir>/ckpt

Per optimizer step: draw the loop depth T by the recipe (looplm.training.recipes; U{depth_min … depth_max}
by default; the same T on every rank, from the run seed and the step), accumulate ``grad_accum`` micro-batches, clip
the global gradient norm, step AdamW with a cosine schedule after linear warmup. A non-finite loss or
gradient skips the update (or stops the run) without touching weights or optimizer state; in a
single process with fused AdamW the skip is decided on the device, so a step reads nothing on the
host until a logged step reads its metrics (:func:`sync_free_step`). SIGTERM,
SIGINT, ``train.max_wall_s`` or a callback (``fit(cfg, callbacks=[...])``) stop the run with a
checkpoint written, and ``fit`` returns. Metrics go to ``<out_dir>/metrics.jsonl``.

The loss of a step is the token mean over the whole global batch (all ranks, all micro-batches):
each micro-batch contributes its summed NLL divided by the global supervised-token count (known to
every rank without communication, since batches are pure functions of the step), so 2 ranks × b
rows, 1 process × 2b rows and b rows × 2 accumulation steps give the same gradient.

Distributed runs (``torchrun``; DDP or FSDP2 by ``train.parallel``) are wrapped in
:mod:`looplm.training.distributed`; this module only calls its helpers. ``train.compile`` compiles the
whole training loss (forward, loss and, through AOT autograd, backward) as one graph per loop depth
T (:class:`looplm.training.compiled_step.CompiledLoss`); distributed runs compile each Transformer block in place instead.
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import random
import resource
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch

from looplm.data.sources import DataSource, make_source
from looplm.device import resolve_device, reuse_freed_host_memory
from looplm.errors import LoopLMError
from looplm.io import atomic_write_text
from looplm.model.accounting import model_flops
from looplm.model.build import model_from_config
from looplm.model.checkpoint import (
    checkpoint_exists,
    load_optimizer_state,
    read_meta,
    save_checkpoint,
)
from looplm.model.lm import check_token_ids
from looplm.progress import progress_enabled
from looplm.settings.config import RunConfig, dump_config
from looplm.settings.limits import cap_steps, check_step_memory
from looplm.signals import Interrupted, StopFlag
from looplm.targets import IGNORE_INDEX
from looplm.training import run_folder
from looplm.training.compiled_step import CompiledLoss, compile_training
from looplm.training.distributed import (
    DistInfo,
    all_reduce_sum,
    any_rank,
    barrier,
    cleanup,
    full_tensor,
    grad_sync,
    init_distributed,
    sharded_optimizer_loader,
    state_views,
)
from looplm.training.finetune import checkpoint_payload, init_model, run_model, window_model
from looplm.training.recipes import eval_loops, step_plan
from looplm.training.run_folder import check_resume_config, progress_line, with_absolute_paths


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


def sample_depth(
    step: int, cfg: RunConfig
) -> int:  # the seeded T of a step (looplm.training.recipes)
    return step_plan(step, cfg).loops


# ----------------------------------------------------------------------------- setup
def autocast_context(cfg: RunConfig, device: torch.device):
    """bf16 autocast on GPU (``auto``/``bf16``); a no-op otherwise."""
    mode = cfg.train.autocast
    if device.type == "cuda" and mode in ("auto", "bf16"):
        return torch.autocast("cuda", dtype=torch.bfloat16)
    if device.type == "cpu" and mode == "bf16":
        return torch.autocast("cpu", dtype=torch.bfloat16)
    return contextlib.nullcontext()


def make_optimizer(
    model: torch.nn.Module, cfg: RunConfig, device: torch.device, fused: bool | None = None
):
    """AdamW; ≥2-D weights decay, norms/scalar gains do not; frozen parameters are left out.
    ``fused`` (default: on GPU and CPU) selects the fused kernel: one pass over each parameter's
    memory instead of the foreach implementation's dozen. On a CPU (22m, one thread) the fused
    step took 30 ms where foreach took 330–400 ms, a fifth of a whole training step."""
    tc = cfg.train
    no_decay = model.no_decay_parameters()
    if hasattr(model, "recurrence"):
        no_decay |= {id(p) for p in model.recurrence.no_decay_parameters()}
    params = [p for p in model.parameters() if p.requires_grad]
    groups = [
        {"params": [p for p in params if id(p) not in no_decay], "weight_decay": tc.weight_decay},
        {"params": [p for p in params if id(p) in no_decay], "weight_decay": 0.0},
    ]
    fused = device.type in ("cuda", "cpu") if fused is None else fused
    extra = {"fused": True} if fused else {}
    return torch.optim.AdamW(groups, lr=tc.lr, betas=(tc.beta1, tc.beta2), **extra)


def _rng_state() -> dict[str, Any]:
    # Only torch's generators drive randomness in a step (dropout); batches and depths are seeded
    # per step, so Python's and NumPy's generators need not be saved.
    st = {
        "torch": base64.b64encode(torch.get_rng_state().numpy().tobytes()).decode(),
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


def train_flops(model_cfg, loops: int, seq_len: int, n_input: int, n_supervised: int) -> float:
    """Training FLOPs of one step by the paper's proxy (Eqs. 20–21), ×3 for forward + backward.

    Body: ``N_body(T)·(8d² + 6·d·d_ff + 4·L·d)`` per input token; head: ``2·d·|V|`` per
    supervised token (the loss reads out supervised positions only); both from
    :func:`looplm.model.accounting.model_flops`.
    """
    f = model_flops(model_cfg, loops, seq_len)
    return 3.0 * (f["body"] * n_input + f["head"] * n_supervised)


def peak_memory_mb(device: torch.device) -> tuple[str, float]:
    """("peak_mem_mb", max allocated on the GPU) or ("peak_rss_mb", peak resident set on CPU)."""
    if device.type == "cuda":
        return "peak_mem_mb", torch.cuda.max_memory_allocated(device) / 2**20
    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss  # KiB on Linux, bytes on macOS
    return "peak_rss_mb", rss / (2**20 if sys.platform == "darwin" else 2**10)


@dataclass
class TrainState:
    """Everything :func:`fit` carries between steps.

    ``model`` is what a training step calls: the bare model in a single process, or the DDP/FSDP
    wrapper (whose forward is the loss) in a distributed run; ``raw_model`` is always the bare
    model; ``wrapped`` the distributed wrapper or None.
    """

    cfg: RunConfig
    model: torch.nn.Module
    optimizer: torch.optim.Optimizer
    source: DataSource
    device: torch.device
    dist: DistInfo
    step: int = 0
    history: list[dict[str, Any]] = field(default_factory=list)
    raw_model: torch.nn.Module | None = None
    wrapped: torch.nn.Module | None = None
    compiled: CompiledLoss | None = None  # train.compile in a single process

    @property
    def fsdp(self) -> bool:
        return self.wrapped is not None and self.cfg.train.parallel == "fsdp"


def setup(cfg: RunConfig, resume: bool = False, dist: DistInfo | None = None) -> TrainState:
    """Build model, optimizer and data; restore them from ``<out_dir>/ckpt`` when resuming.

    Under torchrun the model is wrapped (``train.parallel``) before the optimizer is built, since
    FSDP replaces parameters by shards. A checkpoint from any world size resumes here.
    """
    device = resolve_device(cfg.train.device)
    dist = dist or init_distributed(device.type)
    if device.type == "cuda" and dist.enabled:
        device = torch.device("cuda", dist.local_rank)
    out = Path(cfg.out_dir)
    ckpt = out / "ckpt"
    seed_everything(cfg.train.seed)  # the same initial weights on every rank
    if device.type == "cpu" and cfg.train.cpu_allocator == "reuse":
        reuse_freed_host_memory()  # no page faults for each step's large temporaries
    if device.type == "cuda":
        torch.set_float32_matmul_precision("high")  # TF32 for any fp32 matmul left outside autocast
        torch.backends.cudnn.allow_tf32 = True
    step = 0
    if resume:
        if not checkpoint_exists(ckpt):
            raise LoopLMError(f"cannot resume: no checkpoint at {ckpt}")
        model, saved_cfg, meta = run_model(cfg, ckpt, device)  # LoRA's base from init
        step = int(meta["state"]["step"])
        check_resume_config(saved_cfg, cfg, ckpt, step)
        model.train()
    elif cfg.init:
        model = init_model(cfg, device)  # the checkpoint's weights (+ LoRA adapters)
    else:
        model = model_from_config(cfg.model).to(device)
    if dist.enabled:
        seed_everything(cfg.train.seed + dist.rank)  # per-rank dropout streams
    compiled = compile_training(model, cfg, dist.enabled) if cfg.train.compile else None
    wrapped = None
    if dist.enabled:
        from looplm.training.distributed import wrap_model  # DDP/FSDP live in distributed.py

        wrapped = wrap_model(model, cfg, dist, device)
    fsdp = wrapped is not None and cfg.train.parallel == "fsdp"
    # Fused AdamW; FSDP's sharded (DTensor) parameters take the foreach implementation.
    optimizer = make_optimizer(model, cfg, device, fused=None if not fsdp else False)
    if resume:
        load_optimizer_state(ckpt, sharded_optimizer_loader(optimizer) if fsdp else optimizer)
        rng = read_meta(ckpt)["state"].get("rng")
        if rng and not dist.enabled:
            _set_rng_state(rng)
    source = make_source(cfg.data, window_model(cfg), cfg.train.seed)
    check_step_memory(cfg, source.make_global_batch(0, 2)[0].shape[1], device)
    return TrainState(
        cfg, wrapped or model, optimizer, source, device, dist, step, [], model, wrapped, compiled
    )


# ----------------------------------------------------------------------------- one step
# long: one optimizer step: accumulation, clipping and the non-finite rule must stay in order
def train_step(ts: TrainState) -> dict[str, Any]:
    """One optimizer step (with gradient accumulation). Returns its metrics; where
    :func:`sync_free_step`, ``loss``, ``grad_norm`` and ``skipped`` are device tensors
    (:func:`host_metrics` reads them)."""
    cfg, tc = ts.cfg, ts.cfg.train
    model, opt = ts.model, ts.optimizer
    core = ts.raw_model or model
    model.train()
    lr = get_lr(ts.step, cfg)
    for g in opt.param_groups:
        g["lr"] = lr
    plan = step_plan(ts.step, cfg, core.is_looped)  # the recipe's T (unshared: all layers)
    loops = plan.loops
    world, rank = ts.dist.world_size, ts.dist.rank
    # The step's loss is the token mean over the global batch: every rank knows its token count.
    _, y_all = ts.source.global_batch(ts.step, tc.batch_size * world * tc.grad_accum)
    n_global = int((y_all != IGNORE_INDEX).sum())
    scale = world / max(n_global, 1)  # DDP/FSDP average gradients over ranks: undo the 1/world
    kwargs = dict(
        loops=loops,
        objective=tc.objective,
        truncate_k=plan.truncate_k,
        checkpoint_loops=tc.checkpoint_loops,
        reduction="sum",
    )
    local_sum = torch.zeros((), dtype=torch.float32, device=ts.device)
    n_input = 0
    seq_len = 0
    opt.zero_grad(set_to_none=True)
    for micro in range(tc.grad_accum):
        x, y = ts.source.train_batch(
            ts.step, micro, tc.batch_size, rank, world_size=world, grad_accum=tc.grad_accum
        )
        check_token_ids(x, cfg.model.vocab_size)  # on the host: no sync inside the step
        x, y = x.to(ts.device, non_blocking=True), y.to(ts.device, non_blocking=True)
        last = micro == tc.grad_accum - 1
        loss_fn = ts.compiled or (core.loss if model is core else model)
        # all-reduce / reduce-scatter only on the last micro-batch
        with grad_sync(model, last), autocast_context(cfg, ts.device):
            if plan.loss_fn is not None:  # the recipe's objective (through a DDP/FSDP wrapper)
                kw = {"fn": plan.loss_fn, "loops": loops, "cfg": cfg}
                nll = plan.loss_fn(core, x, y, loops, cfg) if model is core else model(x, y, **kw)
            else:  # the compiled whole-step loss (train.compile), or the model's own
                nll = loss_fn(x, y, **kwargs)
            (nll * scale).backward()
        local_sum += nll.detach().float()
        n_input += x.numel()
        seq_len = max(seq_len, x.shape[1])
    grad_norm = torch.nn.utils.clip_grad_norm_(
        [p for p in core.parameters() if p.grad is not None], tc.clip
    )
    if sync_free_step(ts):
        # Decided on the device: fused AdamW leaves weights, moments and step count untouched
        # where ``found_inf`` is 1 (the GradScaler protocol), so nothing here waits for the device.
        loss = local_sum.double() / max(n_global, 1)  # float64: the same value as the host's
        bad = ~(torch.isfinite(loss) & torch.isfinite(grad_norm))
        opt.found_inf = bad.float()  # type: ignore[attr-defined]
        try:
            opt.step()
        finally:
            del opt.found_inf  # type: ignore[attr-defined]
        loss_val: float | torch.Tensor = loss
        norm: float | torch.Tensor = grad_norm
        skipped: bool | torch.Tensor = bad
    else:
        norm = float(full_tensor(grad_norm))
        (total,) = all_reduce_sum([float(local_sum)], ts.dist, ts.device)
        loss_val = total / max(n_global, 1)
        skipped = not (math.isfinite(loss_val) and math.isfinite(norm))
        if not skipped:
            opt.step()
        else:
            opt.zero_grad(set_to_none=True)  # weights and moments untouched
            if tc.nonfinite == "stop":
                raise LoopLMError(
                    f"non-finite loss/gradient at step {ts.step} (train.nonfinite=stop)"
                )
    ts.step += 1
    n_input *= world
    return {
        "step": ts.step,
        "loss": loss_val,
        "lr": lr,
        "loops": loops,
        "grad_norm": norm,
        "tokens": n_input,
        "supervised_tokens": n_global,
        "train_flops": train_flops(cfg.model, loops, seq_len, n_input, n_global),
        "skipped": skipped,
    }


def sync_free_step(ts: TrainState) -> bool:
    """Whether :func:`train_step` runs without reading the host: a single process, fused AdamW and
    ``train.nonfinite=skip``. Then its ``loss``, ``grad_norm`` and ``skipped`` are 0-dim device
    tensors (read them with :func:`host_metrics`). Otherwise the step reads them on the host: the
    foreach AdamW (FSDP's DTensors) ignores ``found_inf``, a distributed loss is summed over ranks
    on the host, and ``stop`` must raise before the next step trains on."""
    fused = all(g.get("fused") for g in ts.optimizer.param_groups)
    return fused and not ts.dist.enabled and ts.cfg.train.nonfinite == "skip"


def host_metrics(m: dict[str, Any]) -> dict[str, Any]:
    """``m`` with its tensor values (a sync-free step's loss, grad norm, skipped flag) read as
    Python floats and bools, in one host read; the keys and their order are kept."""
    keys = [k for k, v in m.items() if isinstance(v, torch.Tensor)]
    if not keys:
        return dict(m)
    values = torch.stack([m[k].detach().double().reshape(()) for k in keys]).tolist()
    out = dict(m)
    for k, v in zip(keys, values):
        out[k] = bool(v) if m[k].dtype == torch.bool else v
    return out


def _eval_stats(model: torch.nn.Module, x: torch.Tensor, y: torch.Tensor, loops: int):
    """tensor([Σ NLL, tokens, argmax hits]) of one batch at depth ``loops`` (chunked readout)."""
    (h,) = model.hidden_states(x, loops)
    s = model.score(h, y)
    return torch.stack([s.nll.double(), s.n_tokens.double(), s.correct.double()])


@torch.no_grad()
def evaluate_loss(ts: TrainState, loops: int | None = None, stop=None) -> dict[str, float]:
    """Token-weighted validation NLL (and accuracy for tasks) at depth ``loops``.

    Distributed: the batches are split over ranks and the sums all-reduced (under FSDP every rank
    makes the same number of forward calls, padding with a discarded batch). ``stop()``: give up.
    """
    cfg = ts.cfg
    model = ts.raw_model or ts.model
    loops = loops or (eval_loops(cfg) if model.is_looped else cfg.model.n_layers)
    limit = None if ts.source.is_task else cfg.train.eval_batches
    batches = []
    for i, b in enumerate(
        ts.source.eval_batches(cfg.eval.batch_size, cfg.eval.max_tokens, cfg.eval.n_examples)
    ):
        if limit is not None and i >= limit:
            break
        if stop is not None and ts.dist.world_size == 1 and stop():  # ranks call alike
            return {}  # asked to stop: the run's checkpoint comes next
        batches.append(b)
    world, rank = ts.dist.world_size, ts.dist.rank
    mine = batches[rank::world]
    n_calls = -(-len(batches) // world) if ts.fsdp else len(mine)
    model.eval()
    if ts.wrapped is not None:
        ts.wrapped.eval()
    acc = torch.zeros(3, dtype=torch.float64, device=ts.device)
    for i in range(n_calls):
        keep = i < len(mine)
        x, y = mine[i] if keep else batches[0]
        x, y = x.to(ts.device), y.to(ts.device)
        with autocast_context(cfg, ts.device):
            if ts.fsdp:  # through the FSDP root, which gathers the parameters
                stats = ts.wrapped(x, y, fn=_eval_stats, loops=loops)
            else:
                stats = _eval_stats(model, x, y, loops)
        if keep:
            acc += stats
    nll, n, correct = all_reduce_sum(acc.tolist(), ts.dist, ts.device)
    model.train()
    if ts.wrapped is not None:
        ts.wrapped.train()
    out = {"val_loss": nll / max(n, 1), "val_loops": loops, "val_tokens": int(n)}
    if ts.source.is_task:
        out["val_accuracy"] = correct / max(n, 1)
    return out


# ----------------------------------------------------------------------------- the loop
def save(ts: TrainState) -> Path:
    """Write ``<out_dir>/ckpt`` (rank 0; under FSDP every rank helps gather the full state)."""
    path = Path(ts.cfg.out_dir) / "ckpt"
    model, opt = ts.raw_model or ts.model, ts.optimizer
    if ts.fsdp:
        model, opt = state_views(model, opt)  # collective: full tensors on every rank
    if ts.dist.is_main:
        state = {"step": ts.step, "rng": _rng_state(), "world_size": ts.dist.world_size}
        weights, extra = checkpoint_payload(model, ts.cfg)  # LoRA: merged, adapter beside
        save_checkpoint(path, weights, ts.cfg, optimizer=opt, state=state, extra_files=extra)
    barrier(ts.dist)
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


#: ``callback(ts, metrics)`` after every optimizer step (on every rank); True asks fit to stop.
#: Outside logged steps a sync-free step's ``loss``/``grad_norm``/``skipped`` are device tensors
#: (:func:`sync_free_step`); reading one waits for the device.
StepCallback = Callable[[TrainState, dict[str, Any]], "bool | None"]


class _RunLog:
    """Where a run's numbers go: the progress bar, metrics.jsonl and TensorBoard (rank 0)."""

    def __init__(self, ts: TrainState, cfg: RunConfig, progress: bool | None, quiet: bool) -> None:
        from tqdm.auto import tqdm

        out = Path(cfg.out_dir)
        main = ts.dist.is_main
        if main:
            out.mkdir(parents=True, exist_ok=True)
            atomic_write_text(out / "config.yaml", dump_config(cfg))
        self.metrics_f = _open_metrics(out, ts.step) if main else None
        self.tb = None
        if cfg.train.tensorboard and main:
            try:
                from torch.utils.tensorboard import SummaryWriter
            except ImportError:
                raise LoopLMError(
                    "train.tensorboard=true needs `pip install looplm[tensorboard]`"
                ) from None
            self.tb = SummaryWriter(str(out / "tb"))
        bar = progress_enabled(progress) and main
        self.bar = tqdm(
            total=cfg.train.steps,
            initial=ts.step,
            disable=not bar,
            desc=f"train {cfg.model.recurrence}",
            dynamic_ncols=True,
        )
        self.lines = main and not bar and not quiet and progress is not False
        self.total = cfg.train.steps

    def step(self) -> None:
        self.bar.update(1)

    def write(self, m: dict[str, Any], step: int) -> None:
        """A logged step's metrics, read on the host (:func:`host_metrics`)."""
        if "loss" in m:  # the bar shows the last logged loss: reading each step's would sync
            self.bar.set_postfix(loss=f"{m['loss']:.3f}", T=m["loops"])
        if self.lines:
            print(progress_line(m, self.total), file=sys.stderr, flush=True)
        if self.metrics_f:
            self.metrics_f.write(json.dumps(m) + "\n")
            self.metrics_f.flush()
        if self.tb:
            for k, v in m.items():
                if isinstance(v, (int, float)) and not isinstance(v, bool):
                    self.tb.add_scalar(k, v, step)

    def close(self) -> None:
        self.bar.close()
        if self.metrics_f:
            self.metrics_f.close()
        if self.tb:
            self.tb.close()


class _Meter:
    """Throughput between logged steps: tokens/s, MFU (GPU), peak memory, elapsed time."""

    def __init__(self, ts: TrainState, cfg: RunConfig) -> None:
        cuda = ts.device.type == "cuda"
        self.peak = cfg.train.peak_tflops * 1e12 * ts.dist.world_size if cuda else 0.0
        self.device = ts.device
        self.t0 = self.t_since = time.perf_counter()
        self.tokens, self.flops = 0, 0.0

    def add(self, m: dict[str, Any]) -> None:
        self.tokens += m["tokens"]
        self.flops += m["train_flops"]

    def fill(self, m: dict[str, Any]) -> None:
        """Put the rates since the last logged step into ``m`` and start a new interval."""
        now = time.perf_counter()
        dt = max(now - self.t_since, 1e-9)
        m["tok_per_s"] = self.tokens / dt
        if self.peak > 0:
            m["mfu"] = self.flops / dt / self.peak
        key, mb = peak_memory_mb(self.device)
        m[key] = mb
        m["elapsed_s"] = now - self.t0
        self.tokens, self.flops, self.t_since = 0, 0.0, now

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


def fit(
    cfg: RunConfig,
    resume: bool = False,
    progress: bool | None = None,
    quiet: bool = False,
    callbacks: Sequence[StepCallback] = (),
) -> dict[str, Any]:
    """Train according to ``cfg``; returns the last metrics (and final validation numbers).

    Logged every ``log_every`` steps (rank 0): loss, lr, T, grad norm, tokens/s, MFU (GPU only:
    the Eq. 20–21 proxy ×3 against ``train.peak_tflops`` per GPU) and peak memory (GPU: max
    allocated; CPU: peak resident set).

    Stopping early: on SIGTERM/SIGINT, once ``train.max_wall_s`` seconds have passed, or when a
    ``callbacks`` entry (``callback(ts, metrics)``, called after every step) returns True, fit
    writes a checkpoint and returns the last step's metrics with ``stopped`` set to ``"signal"``
    (and ``signal``: its number), ``"max_wall_s"`` or ``"callback"``; there is no final
    validation then, and ``fit(cfg, resume=True)`` continues exactly (``LOOPLM_MAX_STEPS``)."""
    cfg = with_absolute_paths(run_folder.training_folder(cfg))
    with run_folder.training_lock(cfg.out_dir):
        ts = setup(cfg, resume=resume)
        cap_steps(ts, cfg, quiet=quiet or not ts.dist.is_main)
        try:
            return _fit(ts, cfg, progress, quiet, list(callbacks))
        finally:
            cleanup(ts.dist)


def _stop_reason(
    ts: TrainState, flag: StopFlag, meter: _Meter, callbacks: list[StepCallback], m: dict
) -> str | None:
    """Why to stop after this step (the same answer on every rank), or None."""
    limit = ts.cfg.train.max_wall_s
    asked = [bool(cb(ts, m)) for cb in callbacks]  # every callback sees every step
    local = flag.signal is not None or (limit > 0 and meter.elapsed() > limit) or any(asked)
    if not any_rank(local, ts.dist, ts.device):
        return None
    if any_rank(flag.signal is not None, ts.dist, ts.device):
        return "signal"
    return "callback" if any(asked) else "max_wall_s"


def _fit(
    ts: TrainState,
    cfg: RunConfig,
    progress: bool | None,
    quiet: bool,
    callbacks: list[StepCallback],
) -> dict[str, Any]:
    log = _RunLog(ts, cfg, progress, quiet)
    flag = StopFlag()
    old = {s: signal.signal(s, flag) for s in (signal.SIGTERM, signal.SIGINT)}
    meter = _Meter(ts, cfg)
    try:
        tc = cfg.train
        last: dict[str, Any] = {}
        while ts.step < tc.steps:
            m = train_step(ts)  # loss etc. may be device tensors: read only when logged
            meter.add(m)
            log.step()
            if ts.step % tc.log_every == 0 or ts.step == tc.steps:
                m = host_metrics(m)
                meter.fill(m)
                if tc.eval_every and ts.step % tc.eval_every == 0:
                    m.update(evaluate_loss(ts, stop=flag.stopped))
                log.write(m, ts.step)
            last = m
            if tc.ckpt_every and ts.step % tc.ckpt_every == 0:
                save(ts)
            reason = _stop_reason(ts, flag, meter, callbacks, m)
            if reason is not None:
                save(ts)
                last = host_metrics(last)
                last["stopped"] = reason
                if reason == "signal":
                    last["signal"] = flag.signal or signal.SIGTERM
                if not quiet and ts.dist.is_main:
                    why = f"signal {last['signal']}" if reason == "signal" else reason
                    print(f"{why}: checkpoint written at step {ts.step}", file=sys.stderr)
                return last
        save(ts)  # before the final validation, which may read a large held-out split
        flag.at_once()  # a signal from here on stops at once: the trained steps are saved
        final = evaluate_loss(ts)
        last = host_metrics(last)
        last.update(final)
        log.write({"step": ts.step, **final}, ts.step)
        return last
    except Interrupted as exc:  # a second signal, or one during the final validation
        if not quiet and ts.dist.is_main:
            print(f"signal {exc.signum}: stopped at once (last checkpoint kept)", file=sys.stderr)
        return {"step": ts.step, "stopped": "signal", "signal": exc.signum}
    finally:
        log.close()
        for s, h in old.items():
            signal.signal(s, h)
