"""Shared test helpers: data location, default skipping of slow/gpu tests, fast settings."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[1]

# Tiny test models are dispatch-bound: one intra-op thread is fastest, and it does not fight other
# processes for cores (a busy 2-core machine made two-thread tests several times slower).
torch.set_num_threads(1)
os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")


def data_dir() -> Path:
    """The shared real-data folder by looplm's own lookup ($LOOPLM_DATA_DIR, then
    <repo>/../shared/data); that folder, possibly missing, when neither exists."""
    from looplm.data.cache import default_data_dir

    return default_data_dir() or REPO.parent / "shared" / "data"


def require_data(*parts: str) -> Path:
    """Path to a file or folder under the data folder; skip the test with a reason when absent."""
    path = data_dir().joinpath(*parts)
    if not path.exists():
        pytest.skip(
            f"real data not found at {path} (set LOOPLM_DATA_DIR to the shared data folder)"
        )
    return path


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption("--run-slow", action="store_true", help="run tests marked slow")


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    run_slow = config.getoption("--run-slow")
    has_gpu = torch.cuda.is_available()
    for item in items:
        if "slow" in item.keywords and not run_slow:
            item.add_marker(pytest.mark.skip(reason="slow test: pass --run-slow"))
        if "gpu" in item.keywords and not has_gpu:
            item.add_marker(pytest.mark.skip(reason="needs a CUDA GPU"))
