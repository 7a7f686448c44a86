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


@pytest.fixture(scope="session", autouse=True)
def _own_cache_dir(tmp_path_factory: pytest.TempPathFactory):
    """Token caches and their locks go to a folder of this session, never the user's real
    ``~/.cache/looplm`` (unless LOOPLM_CACHE_DIR names one on purpose)."""
    if os.environ.get("LOOPLM_CACHE_DIR"):
        yield
        return
    os.environ["LOOPLM_CACHE_DIR"] = str(tmp_path_factory.mktemp("looplm_cache"))
    try:
        yield
    finally:
        os.environ.pop("LOOPLM_CACHE_DIR", None)


_RUNS = REPO / "runs"
_RUNS_BEFORE = _RUNS.exists()


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """A test that trains into the checkout's runs/ (a relative out_dir, a default config's
    runs/NAME) is a failure: the suite must leave the checkout as it found it."""
    if not _RUNS_BEFORE and _RUNS.exists():
        left = sorted(str(p.relative_to(REPO)) for p in _RUNS.rglob("*"))[:5]
        print(f"\nerror: the tests wrote into the checkout: {', '.join(left)}")
        session.exitstatus = 1


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
            f"real data not found at {path}: README.md 'Real data' says how to get the corpora "
            "(then set LOOPLM_DATA_DIR to their folder)"
        )
    return path


# The models the Hugging Face export tests export: recurrence, then settings.
HF_VARIANTS: dict[str, tuple[str, ...]] = {
    "scse": ("scse",),
    "step_conditioned": ("step_conditioned",),
    "hyper_scse": ("hyper_scse",),
    "unshared": ("unshared", "model.n_layers=2"),
    "scse_rope_prelude_core2_coda": (
        "scse",
        "model.positions=rope",
        "model.prelude_layers=1",
        "model.core_layers=2",
        "model.coda_layers=1",
    ),
}


def tiny_checkpoint(folder: Path, recurrence: str = "scse", *overrides: str):
    """A tiny_wt2 model of ``recurrence`` (dropout 0, moved away from its init so that the head
    and the loop matter) saved to ``folder``: (checkpoint path, the model in eval mode)."""
    from looplm.model import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    cfg = load_config(
        "tiny_wt2", [f"model.recurrence={recurrence}", "model.dropout=0.0", *overrides]
    )
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return save_checkpoint(folder, model, cfg), model


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


def pytest_terminal_summary(terminalreporter) -> None:  # noqa: ANN001 (pytest's reporter)
    """The executable-docs test's count of skipped blocks per reason, when it ran."""
    import sys

    mod = sys.modules.get("test_docs_exec")
    for line in mod.skip_summary() if mod else []:
        terminalreporter.write_line(line)
