"""Small shared helpers below every layer: device resolution, loop-depth parsing, progress bars.

Evaluation, diagnostics, the experiment runner and the CLI all resolve ``auto``/``cpu``/``cuda``
and parse depth lists the same way; keeping these here means none of them imports training code
or a CLI module to do it.
"""

from __future__ import annotations

import os
import sys
from typing import TYPE_CHECKING, Any

from looplm.errors import LoopLMError

if TYPE_CHECKING:  # torch is imported when a device is resolved, not when the CLI starts
    import torch

DEVICES = ("auto", "cpu", "cuda")


def resolve_device(name: str | torch.device) -> torch.device:
    """``auto`` → CUDA when available, else CPU; ``cuda`` without a GPU is a one-line error."""
    import torch

    if isinstance(name, torch.device):
        return name
    if name == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if name == "cuda" and not torch.cuda.is_available():
        raise LoopLMError("train.device=cuda but no CUDA GPU is available; use cpu or auto")
    return torch.device(name)


def parse_depths(text: str, max_loops: int | None = None, offer_flag: bool = True) -> list[int]:
    """'4,8,12' → [4, 8, 12]; ranges too: '1-4,8' → [1, 2, 3, 4, 8]. Depths must lie in
    1 … the loop ceiling (:func:`looplm.limits.loop_limit`; ``max_loops`` raises it;
    ``offer_flag``: the error may suggest ``--max-loops``)."""
    from looplm.limits import check_loops

    depths: list[int] = []
    try:
        for part in (p.strip() for p in text.split(",")):
            if not part:
                raise LoopLMError(
                    f"--depths {text!r}: empty item between commas; give integers or ranges "
                    "like 1,2,4 or 1-48"
                )
            if "-" in part[1:]:
                lo, hi = part.split("-", 1) if not part.startswith("-") else ("", "")
                a, b = int(lo), int(hi)
                if b < a:
                    raise LoopLMError(f"--depths {text!r}: range {part!r} runs backwards")
                check_loops("--depths", b, max_loops, offer_flag)  # before the range is spelled out
                depths.extend(range(a, b + 1))
            else:
                depths.append(int(part))
    except LoopLMError:  # a ValueError too: keep its own message
        raise
    except ValueError:
        raise LoopLMError(
            f"--depths {text!r}: expected comma-separated integers or ranges like 1-48"
        ) from None
    bad = [d for d in depths if d < 1]
    if not depths or bad:
        raise LoopLMError(f"--depths {text!r}: loop depths must be integers >= 1")
    check_loops("--depths", depths, max_loops, offer_flag)
    return depths


def depth_list(value: Any, where: str) -> list[int]:
    """Depths from a config value: a list, an integer or a string like ``1-48,96``."""
    if isinstance(value, int) and not isinstance(value, bool):
        value = str(value)
    elif isinstance(value, (list, tuple)):
        value = ",".join(str(v) for v in value)
    if isinstance(value, str):
        return parse_depths(value, offer_flag=False)
    raise LoopLMError(f"{where}={value!r}: give a list of depths or a string like 1-48")


def progress_enabled(requested: bool | None = None) -> bool:
    """Whether to draw progress bars: ``requested`` when given, else on a terminal unless
    ``LOOPLM_NO_PROGRESS=1``."""
    if requested is not None:
        return bool(requested)
    return sys.stderr.isatty() and os.environ.get("LOOPLM_NO_PROGRESS") != "1"
