"""Whether to draw progress bars (one switch for every loop that shows one)."""

from __future__ import annotations

import os
import sys


def progress_enabled(requested: bool | None = None) -> bool:
    """Whether to draw progress bars: ``requested`` when given, else on a terminal unless
    ``LOOPLM_NO_PROGRESS=1``."""
    if requested is not None:
        return bool(requested)
    return sys.stderr.isatty() and os.environ.get("LOOPLM_NO_PROGRESS") != "1"
