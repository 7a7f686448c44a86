"""Process-group handling: the only module that imports ``torch.distributed``.

Single-process runs get a trivial :class:`DistInfo`; under ``torchrun`` (``WORLD_SIZE`` > 1) the
process group is initialised here (NCCL on GPU, gloo on CPU) and the model is wrapped from outside
the model code by :func:`wrap_model`:

* ``train.parallel=ddp``: ``DistributedDataParallel`` around a :class:`LossModule` (whose forward
  is the model's ``loss``), so the gradient all-reduce hooks fire on the loss computation;
* ``train.parallel=fsdp``: FSDP2 ``fully_shard``. A looped model's single shared block is applied
  T times per forward, so sharding it as its own unit would all-gather it T times (and again in
  backward); the whole looped model is therefore one FSDP unit: parameters are gathered once per
  forward/backward, gradients are reduce-scattered and AdamW state lives sharded (ZeRO-3-style
  memory for optimizer state and gradients). Unshared models shard each layer, then the root.

Gradient accumulation: :func:`grad_sync` turns the gradient all-reduce / reduce-scatter off for all
but the last micro-batch (DDP ``no_sync``, FSDP2 ``set_requires_gradient_sync``), so a step costs
one gradient collective whatever ``grad_accum`` is. Checkpoints: :func:`full_state_dicts` gathers
full (unsharded) model and optimizer state on every rank, so rank 0 writes a checkpoint in the
ordinary single-process format, which resumes on any world size; :func:`sharded_optimizer_loader`
cuts such full optimizer state back into this run's shards when resuming under FSDP.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import torch
from torch import nn


@dataclass
class DistInfo:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    @property
    def enabled(self) -> bool:
        return self.world_size > 1


def init_distributed(device_type: str = "cpu") -> DistInfo:
    """Initialise torch.distributed when launched by torchrun; otherwise a single process."""
    world = int(os.environ.get("WORLD_SIZE", "1"))
    if world <= 1:
        return DistInfo()
    import torch.distributed as dist

    if not dist.is_initialized():
        dist.init_process_group(backend="nccl" if device_type == "cuda" else "gloo")
    info = DistInfo(dist.get_rank(), dist.get_world_size(), int(os.environ.get("LOCAL_RANK", 0)))
    if device_type == "cuda":
        torch.cuda.set_device(info.local_rank)
    return info


def cleanup(info: DistInfo) -> None:
    """Destroy the process group (end of a distributed run)."""
    if not info.enabled:
        return
    import torch.distributed as dist

    if dist.is_initialized():
        dist.destroy_process_group()


# ----------------------------------------------------------------------------- wrapping
class LossModule(nn.Module):
    """``forward(x, y, **kw)`` = ``inner.loss(x, y, **kw)``: what DDP/FSDP (and compile) wrap.

    ``fn`` runs another computation on the inner model through the wrapper's forward (so FSDP
    gathers the parameters), e.g. evaluation statistics: ``wrapper(x, y, fn=stats, loops=T)``
    returns ``stats(inner, x, y, loops=T)``.
    """

    def __init__(self, inner: nn.Module) -> None:
        super().__init__()
        self.inner = inner

    def forward(
        self,
        input_ids: torch.Tensor,
        targets: torch.Tensor,
        fn: Callable[..., Any] | None = None,
        **kw: Any,
    ) -> Any:
        if fn is not None:
            return fn(self.inner, input_ids, targets, **kw)
        return self.inner.loss(input_ids, targets, **kw)


def _fully_shard():
    try:
        from torch.distributed.fsdp import fully_shard
    except ImportError:  # torch < 2.6
        from torch.distributed._composable.fsdp import fully_shard
    return fully_shard


def _broadcast_from_rank0(module: nn.Module) -> None:
    import torch.distributed as dist

    with torch.no_grad():
        for t in list(module.parameters()) + list(module.buffers()):
            dist.broadcast(t.data, src=0)


def wrap_model(model: nn.Module, cfg: Any, dist: DistInfo, device: torch.device) -> nn.Module:
    """The distributed training module for ``model`` (``cfg.train.parallel``: ddp | fsdp).

    The returned module's forward computes the loss: ``wrapped(x, y, loops=T, objective=...,
    truncate_k=..., checkpoint_loops=..., reduction=...)``. ``model`` itself stays usable; under
    FSDP its parameters become sharded DTensors, so build the optimizer after wrapping.
    """
    mode = cfg.train.parallel
    wrapper = LossModule(model)
    if mode == "ddp":
        from torch.nn.parallel import DistributedDataParallel as DDP

        # A recurrence whose parameters can sit out a step (norm_reset's gain when T < its period)
        # makes DDP search for unused parameters; that search costs a graph traversal per step, so
        # it is on only where needed. Unshared models always train all their layers.
        rec = getattr(model, "recurrence", None)
        return DDP(
            wrapper,
            device_ids=[device.index] if device.type == "cuda" else None,
            find_unused_parameters=rec is not None and not rec.uses_all_parameters,
        )
    if mode == "fsdp":
        from torch.distributed.device_mesh import init_device_mesh

        _broadcast_from_rank0(model)  # identical full weights on every rank before sharding
        mesh = init_device_mesh(device.type, (dist.world_size,))
        fully_shard = _fully_shard()
        if not getattr(model, "is_looped", True):
            for layer in model.layers:
                fully_shard(layer, mesh=mesh)
        fully_shard(wrapper, mesh=mesh)
        return wrapper
    raise ValueError(f"train.parallel={mode!r}; allowed: ddp, fsdp")


def unwrap(module: nn.Module) -> nn.Module:
    """The module under ``torch.compile``'s OptimizedModule, if any."""
    return getattr(module, "_orig_mod", module)


@contextlib.contextmanager
def grad_sync(module: nn.Module, enabled: bool) -> Iterator[None]:
    """Within the block, reduce gradients across ranks only if ``enabled`` (accumulation)."""
    m = unwrap(module)
    if enabled:
        yield
    elif hasattr(m, "no_sync"):  # DDP
        with m.no_sync():
            yield
    elif hasattr(m, "set_requires_gradient_sync"):  # FSDP2
        m.set_requires_gradient_sync(False)
        try:
            yield
        finally:
            m.set_requires_gradient_sync(True)
    else:
        yield


# ----------------------------------------------------------------------------- collectives
def all_reduce_sum(values: list[float], info: DistInfo, device: torch.device) -> list[float]:
    """Element-wise sum of ``values`` over ranks (returned unchanged in a single process)."""
    if not info.enabled:
        return list(values)
    import torch.distributed as dist

    t = torch.tensor(values, dtype=torch.float64, device=device)
    dist.all_reduce(t, op=dist.ReduceOp.SUM)
    return t.tolist()


def any_rank(flag: bool, info: DistInfo, device: torch.device) -> bool:
    """True when ``flag`` is true on any rank (every rank gets the same answer)."""
    if not info.enabled:
        return flag
    return all_reduce_sum([1.0 if flag else 0.0], info, device)[0] > 0


def barrier(info: DistInfo) -> None:
    if info.enabled:
        import torch.distributed as dist

        dist.barrier()


def full_tensor(t: torch.Tensor) -> torch.Tensor:
    """A DTensor's full value (a collective: every rank must call it); other tensors unchanged."""
    if hasattr(t, "full_tensor") and hasattr(t, "placements"):
        return t.full_tensor()
    return t


def full_state_dicts(
    model: nn.Module, optimizer: torch.optim.Optimizer | None
) -> tuple[dict[str, torch.Tensor], dict[str, Any] | None]:
    """Full model and optimizer state dicts (DTensor shards gathered), on CPU.

    Under FSDP every rank must call this (it all-gathers); the result is the same everywhere and
    has the single-process layout, so the checkpoint it makes loads at any world size.
    """
    msd = {k: full_tensor(v).detach().cpu() for k, v in model.state_dict().items()}
    osd = None
    if optimizer is not None:
        raw = optimizer.state_dict()
        # Sorted: the state's insertion order can differ between ranks (e.g. after loading),
        # and the gathers must run in the same order everywhere.
        state = {}
        for pid in sorted(raw["state"], key=int):
            st = raw["state"][pid]
            state[pid] = {
                k: full_tensor(st[k]).detach().cpu() if torch.is_tensor(st[k]) else st[k]
                for k in sorted(st)
            }
        osd = {"state": state, "param_groups": raw["param_groups"]}
    return msd, osd


class _StateView:
    """Something with ``state_dict()`` (what looplm.model.checkpoint.save_checkpoint reads)."""

    def __init__(self, sd: dict[str, Any]) -> None:
        self._sd = sd

    def state_dict(self) -> dict[str, Any]:
        return self._sd


def state_views(model: nn.Module, optimizer: torch.optim.Optimizer | None):
    """(model view, optimizer view) whose ``state_dict()`` is the full, gathered state."""
    msd, osd = full_state_dicts(model, optimizer)
    return _StateView(msd), (_StateView(osd) if osd is not None else None)


def _shard_like(full: torch.Tensor, param: torch.Tensor) -> torch.Tensor:
    from torch.distributed.tensor import distribute_tensor

    full = full.to(device=param.device_mesh.device_type)
    try:  # every rank holds the same full value: cut the local shard without communication
        return distribute_tensor(full, param.device_mesh, param.placements, src_data_rank=None)
    except TypeError:  # older torch: scatter from rank 0 (a collective, same order everywhere)
        return distribute_tensor(full, param.device_mesh, param.placements)


class _ShardingLoader:
    def __init__(self, optimizer: torch.optim.Optimizer) -> None:
        self.optimizer = optimizer

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        params = [p for g in self.optimizer.param_groups for p in g["params"]]
        state = {}
        for pid, st in sd["state"].items():
            p = params[int(pid)]
            is_dt = hasattr(p, "placements")
            state[pid] = {
                k: _shard_like(v, p)
                if is_dt and torch.is_tensor(v) and tuple(v.shape) == tuple(p.shape)
                else v
                for k, v in st.items()
            }
        self.optimizer.load_state_dict({"state": state, "param_groups": sd["param_groups"]})


def sharded_optimizer_loader(optimizer: torch.optim.Optimizer):
    """An object whose ``load_state_dict(full_sd)`` loads full optimizer state into ``optimizer``,
    cutting each moment to the local shard of its (DTensor) parameter; plain parameters are
    loaded unchanged."""
    return _ShardingLoader(optimizer)
