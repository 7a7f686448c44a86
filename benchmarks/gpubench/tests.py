"""Section ``tests``: ``pytest tests/test_gpu.py`` in a subprocess (bf16 + compile vs fp32 eager,
chunked loss, flat evaluation memory, a compiled training run); their measured errors are
reported."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from gpubench.common import Budget

REPO = Path(__file__).resolve().parents[2]
REPORT = Path(tempfile.gettempdir()) / "looplm-gpu-report.jsonl"


def run_tests(smoke: bool, report: Path) -> dict[str, Any]:
    env = {**os.environ, "LOOPLM_GPU_REPORT": str(report)}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    if report.exists():
        report.unlink()
    t0 = time.time()
    cmd = [
        sys.executable,
        "-m",
        "pytest",
        "tests/test_gpu.py",
        "-q",
        "-rs",
        "-p",
        "no:cacheprovider",
    ]
    proc = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True)
    tail = (proc.stdout + proc.stderr).strip().splitlines()
    print("\n".join(tail[-25:]))
    details = [json.loads(x) for x in report.read_text().splitlines()] if report.exists() else []
    return {
        "rc": proc.returncode,
        # pytest's counts line ("4 passed in 32 s"), not whatever it printed last (warnings)
        "summary": next(
            (x for x in reversed(tail) if re.search(r"\d+ (passed|failed|error)", x)),
            tail[-1] if tail else "",
        ),  # fmt: skip
        "seconds": time.time() - t0,
        "details": details,
    }


def run(args, out: dict[str, Any], budget: Budget) -> None:
    out["tests"] = run_tests(args.smoke, REPORT)


def summarize(out: dict[str, Any], args) -> list[str]:
    t = out.get("tests")
    if not t:
        return []
    L = [
        f"**GPU tests** (`tests/test_gpu.py`, {t['seconds']:.0f} s): `{t['summary']}` (rc {t['rc']})"
    ]
    for d in t["details"]:
        name = d.pop("test")
        L.append(
            f"- {name}: "
            + ", ".join(
                f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}" for k, v in d.items()
            )
        )
    return L + [""]
