"""The Table 19 gap study's evaluation (benchmarks/table19_gap.py): the sliding windows score every
target once with the stated context, and its evaluation of a tiny checkpoint agrees with
``looplm eval``'s non-overlapping sweep."""

from __future__ import annotations

import importlib
import sys
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def gap():
    sys.path.insert(0, str(REPO / "benchmarks"))
    try:
        yield importlib.import_module("table19_gap")
    finally:
        sys.path.remove(str(REPO / "benchmarks"))


@pytest.mark.parametrize("n,context,stride", [(300, 128, 64), (129, 128, 64), (1000, 16, 5)])
def test_sliding_windows_score_every_target_once_with_the_stated_context(gap, n, context, stride):
    seen = np.zeros(n - 1, dtype=int)  # targets 1 … n-1 (index i predicts token i + 1)
    for k, (start, end, first) in enumerate(gap._windows(np.arange(n), context, stride)):
        assert end - start <= context
        lo = start + max(first, 0)
        seen[lo:end] += 1
        if k:  # past the first window every scored target sees at least context − stride tokens
            assert lo - start >= context - stride
    assert (seen == 1).all()


def test_the_non_overlapping_variant_is_looplm_evals_sweep(gap, tmp_path, monkeypatch):
    """On a tiny byte-level checkpoint of a text file, the study's windows128 row at T = 2 equals
    ``evaluate_checkpoint``'s NLL on the same split (its own windows, its own scorer)."""
    import torch

    from looplm.evaluate.sweep import evaluate_checkpoint
    from looplm.model.build import model_from_config
    from looplm.model.checkpoint import save_checkpoint
    from looplm.settings.config import load_config

    text = tmp_path / "t.txt"
    text.write_text(
        "".join(f"line {i} of a small corpus, with <unk> words.\n\n" for i in range(200))
    )
    cfg = load_config("tiny_wt2")
    cfg.model.d_model, cfg.model.n_heads, cfg.model.d_ff, cfg.model.context = 32, 2, 64, 32
    cfg.data.dataset = f"text:{text}"
    cfg.data.cache_dir = str(tmp_path / "cache")
    torch.manual_seed(0)
    model = model_from_config(cfg.model)
    save_checkpoint(tmp_path / "ckpt", model, cfg, state={"step": 0})
    monkeypatch.setattr(gap, "DEPTHS", [2, 3])
    rows = gap.evaluate(tmp_path / "ckpt", str(tmp_path))
    ref = evaluate_checkpoint(str(tmp_path / "ckpt"), [2], split="test", batch_size=4)
    got = next(r for r in rows if r["variant"] == "windows128" and r["depth"] == 2)
    want = ref["results"][0]
    assert got["n_tokens"] == want["n_tokens"]
    assert got["nll"] == pytest.approx(want["nll"], rel=1e-6)
    assert {r["variant"] for r in rows} >= {"windows128", "sliding64", "dropout_on"}
