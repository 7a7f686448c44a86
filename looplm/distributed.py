"""Process-group handling: the only module that imports ``torch.distributed``.

Single-process runs get a trivial :class:`DistInfo`; under ``torchrun`` (``WORLD_SIZE`` > 1) the
process group is initialised here and the model is wrapped from outside the model code.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch


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


def print0(*args: object, info: DistInfo | None = None, **kw: object) -> None:
    """print on rank 0 only."""
    if info is None or info.is_main:
        print(*args, **kw)  # noqa: T201
