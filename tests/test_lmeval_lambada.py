"""lm-evaluation-harness for real: `lm_eval.simple_evaluate(model="looplm")` on a local LAMBADA
task (no network), its per-example log-likelihoods checked against looplm's own LAMBADA NLL."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip(
    "lm_eval", reason="lm-eval is not installed (pip install 'looplm[lmeval]' or '.[test]')"
)

from conftest import require_data  # noqa: E402

from looplm.data import get_tokenizer  # noqa: E402
from looplm.data.corpora import lambada_examples  # noqa: E402
from looplm.decoding.lmeval import LAMBADA_TASK, evaluate_lambada_local, lambada_task  # noqa: E402
from looplm.lambada.completion import lambada_items, lambada_sweep  # noqa: E402
from looplm.model import model_from_config  # noqa: E402
from looplm.model.checkpoint import save_checkpoint  # noqa: E402
from looplm.settings.config import load_config  # noqa: E402


def test_lm_eval_on_local_lambada_matches_looplm_nll(tmp_path) -> None:
    data = require_data("lambada", "lambada_test.jsonl")
    cfg = load_config("tiny_wt2", ["model.dropout=0.0"])
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    n, T = 6, 3
    out = evaluate_lambada_local(ck, data, loops=T, limit=n, task_dir=tmp_path / "tasks")
    samples = sorted(out["samples"][LAMBADA_TASK], key=lambda s: s["doc_id"])
    assert [s["doc_id"] for s in samples] == list(range(n))
    examples = lambada_examples(data)[:n]
    items = lambada_items(examples, get_tokenizer("bytes"), cfg.model.context)
    greedy_all = []
    for s, ex, item in zip(samples, examples, items):
        assert s["target"] == " " + ex.target  # lm-eval's split and looplm's agree
        ((ll, greedy),) = s["resps"][0]  # one request per passage
        (row,) = lambada_sweep(model, [item], [T])
        assert math.isclose(-ll, row["sum_nll"], rel_tol=1e-5, abs_tol=1e-4)
        assert greedy == (row["exact_word_correct"] == 1)
        greedy_all.append(greedy)
    res = out["results"][LAMBADA_TASK]
    assert res["acc,none"] == pytest.approx(sum(greedy_all) / n)
    assert res["perplexity,none"] > 1.0


def test_lambada_task_reads_the_local_file(tmp_path) -> None:
    from looplm.errors import LoopLMError

    data = require_data("lambada")
    cfg = lambada_task(data)
    assert cfg["dataset_path"] == "json"
    assert cfg["dataset_kwargs"]["data_files"]["test"].endswith("lambada_test.jsonl")
    with pytest.raises(LoopLMError, match="no LAMBADA file"):
        lambada_task(tmp_path)


def test_lm_eval_command_line_passes_through(tmp_path, monkeypatch) -> None:
    """`looplm lm-eval …` is lm-eval's own CLI: its arguments, its output files; the offline
    LAMBADA task is found from $LOOPLM_DATA_DIR and its log-likelihoods are looplm's NLL."""
    import json

    from conftest import data_dir

    from looplm.cli import main

    data = require_data("lambada", "lambada_test.jsonl")
    monkeypatch.setenv("LOOPLM_DATA_DIR", str(data_dir()))
    cfg = load_config("tiny_wt2", ["model.dropout=0.0"])
    torch.manual_seed(1)
    model = model_from_config(cfg.model).eval()
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    n, T = 3, 2
    argv = ["lm-eval", "--model", "looplm", "--model_args", f"pretrained={ck},loops={T}"]
    argv += ["--tasks", LAMBADA_TASK, "--limit", str(n), "--log_samples"]
    argv += ["--output_path", str(tmp_path / "out")]
    assert main(argv) == 0
    (samples_file,) = (tmp_path / "out").rglob(f"samples_{LAMBADA_TASK}_*.jsonl")
    samples = [json.loads(line) for line in samples_file.read_text().splitlines()]
    samples.sort(key=lambda s: s["doc_id"])
    assert len(samples) == n
    items = lambada_items(lambada_examples(data)[:n], get_tokenizer("bytes"), cfg.model.context)
    for s, item in zip(samples, items):
        (row,) = lambada_sweep(model, [item], [T])
        ll = float(s["resps"][0][0][0])
        assert math.isclose(-ll, row["sum_nll"], rel_tol=1e-5, abs_tol=1e-4)
    (results_file,) = (tmp_path / "out").rglob("results_*.json")
    assert LAMBADA_TASK in json.loads(results_file.read_text())["results"]


def test_lm_eval_command_line_needs_the_data_dir(tmp_path, monkeypatch) -> None:
    from looplm.cli import main

    monkeypatch.delenv("LOOPLM_DATA_DIR", raising=False)
    assert main(["lm-eval", "--model", "looplm", "--tasks", LAMBADA_TASK]) == 2
