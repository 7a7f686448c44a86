"""The command line as a shell pipeline sees it."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def test_closed_stdout_pipe_ends_quietly() -> None:
    """``looplm methods | head -0``: the reader is gone before looplm writes; no traceback."""
    r, w = os.pipe()
    os.close(r)  # no reader at all: the first write fails with EPIPE
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "looplm", "methods"],
            cwd=REPO,
            stdout=w,
            stderr=subprocess.PIPE,
            text=True,
            timeout=120,
        )
    finally:
        os.close(w)
    assert "Traceback" not in proc.stderr, proc.stderr
    assert "BrokenPipeError" not in proc.stderr, proc.stderr
    assert proc.returncode == 141
