"""Each benchmark writes its own section of ``benchmarks/RESULTS.md`` (between markers).

Re-running a benchmark replaces its section and leaves the others alone; the file is written
atomically.
"""

from __future__ import annotations

import platform
import re
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "RESULTS.md"
sys.path.insert(0, str(HERE.parent))

from looplm.io import atomic_write_text  # noqa: E402

HEADER = "# Benchmark results\n\nEach section is written by the benchmark named in its heading.\n"


def machine_line() -> str:
    """A one-line description of where the benchmark ran."""
    import torch

    dev = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "CPU"
    return (
        f"{time.strftime('%Y-%m-%d')} · {dev} · {platform.processor() or platform.machine()} · "
        f"torch {torch.__version__} · Python {platform.python_version()} · "
        f"{torch.get_num_threads()} threads"
    )


def update_section(name: str, body: str, path: Path = RESULTS) -> None:
    """Replace (or append) the section called ``name`` in the results file."""
    text = path.read_text() if path.exists() else HEADER
    start, end = f"<!-- {name}:start -->", f"<!-- {name}:end -->"
    block = f"{start}\n{body.rstrip()}\n{end}"
    pattern = re.compile(re.escape(start) + r".*?" + re.escape(end), re.S)
    text = (
        pattern.sub(lambda _: block, text)
        if pattern.search(text)
        else text.rstrip() + "\n\n" + block + "\n"
    )
    atomic_write_text(path, text)
