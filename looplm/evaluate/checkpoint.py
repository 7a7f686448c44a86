"""One checkpoint evaluated at several loop depths, as ``looplm eval`` runs it: the fixed-depth
sweep of its own data (or another corpus: held-out transfer) or LAMBADA completion, the loss per
byte next to the loss per token, and with a store one row per depth (keyed by evaluation identity,
see :mod:`looplm.evaluate.records`; re-running replaces the rows, never duplicates them).
"""

from __future__ import annotations

from typing import Any

from looplm.errors import LoopLMError
from looplm.evaluate.settings import EvalSettings


def evaluate_one(checkpoint: str, settings: EvalSettings, *, progress: bool | None = None) -> tuple:
    """The evaluation ``settings`` ask for: ``(result, cfg, tag)`` — the JSON the command prints
    (one row per depth, with ``nll_per_byte`` for corpora), the run's config and the eval tag.
    ``progress``: a bar (default: on a terminal, unless ``LOOPLM_NO_PROGRESS=1``)."""
    from looplm.evaluate.records import eval_tag
    from looplm.progress import progress_enabled

    progress = progress_enabled(progress)

    s = settings
    if s.lambada:  # the LAMBADA analysis, found through the kinds' registry
        from looplm.evaluate.kinds import get_kind

        result = get_kind("lambada").evaluate_checkpoint(checkpoint, s, progress=progress)
        return result, result.pop("config"), eval_tag(s.tag, max_examples=s.max_examples)
    from looplm.evaluate import evaluate_checkpoint
    from looplm.model.checkpoint import read_meta
    from looplm.settings.config import config_from_dict

    if s.dataset is None and "pretrained" in read_meta(checkpoint)["state"]:
        raise LoopLMError(
            f"{checkpoint} is an imported checkpoint: it has no data of its own to evaluate; pass "
            "--dataset text:PATH (a text file) or a corpus name (e.g. --dataset wikitext-2)"
        )
    result = evaluate_checkpoint(
        checkpoint, s.depths, dataset=s.dataset, split=s.split, data_dir=s.data_dir,
        max_tokens=s.max_tokens, batch_size=s.batch_size, device=s.device, progress=progress,
        compile=s.compile,
    )  # fmt: skip
    cfg = config_from_dict(read_meta(checkpoint)["config"])
    add_per_byte(result, cfg, s)
    return finite(result), cfg, eval_tag(s.tag, max_tokens=result.get("max_tokens"))


def finite(result: dict) -> dict:
    """``result`` with NaN / infinite numbers as None (JSON has no NaN), and one warning line."""
    import sys

    from looplm.io import finite_json

    out, bad = finite_json(result)
    if bad:
        print(
            f"warning: {len(bad)} value(s) are not finite (first: {bad[0]}; the weights or the "
            "logits hold NaN or infinity): written as null",
            file=sys.stderr,
        )
    return out


def store_rows(checkpoint: str, settings: EvalSettings, result: dict, cfg: Any, tag: str) -> dict:
    """Write one store row per depth through the kind that owns them: LAMBADA, another corpus
    (transfer) or the run's own (fixed); returns what the printed JSON says about them."""
    from looplm.evaluate.kinds import get_kind
    from looplm.results.store import ResultsStore

    if any(r.get("nll") is None for r in result["results"] if "nll" in r):
        raise LoopLMError(
            f"--store {settings.store}: not storing rows whose loss is not finite; the printed "
            "JSON has them as null"
        )

    kind = "lambada" if settings.lambada else "fixed"
    if not settings.lambada and result["dataset"] != cfg.data.dataset:
        kind = "transfer"
    records = get_kind(kind).depth_records(
        result["results"],
        cfg,
        dataset=result["dataset"],
        split=result["split"],
        tag=tag,
        protocol=settings.protocol,
        extra={"checkpoint": str(checkpoint), "step": result.get("step")},
    )
    with ResultsStore(settings.store) as store:
        store.put_many(records)
    return {
        "path": str(settings.store),
        "rows": len(records),
        "eval_tag": tag,
        "model_hash": records[0].model_hash,
        "protocol": records[0].protocol,
    }


def add_per_byte(result: dict, cfg: Any, settings: EvalSettings) -> None:
    """Loss per byte of text next to the loss per token of every depth (``nll_per_byte``), so
    models with different tokenizers compare; corpora only (a task has no text bytes)."""
    from looplm.data.cache import get_split_tokens, predicted_bytes
    from looplm.data.synthetic import TASKS

    data = cfg.data
    dataset = settings.dataset or data.dataset
    if dataset in TASKS or any("accuracy" in r for r in result["results"]):
        return
    tokens = get_split_tokens(
        dataset,
        settings.split or data.eval_split,
        cfg.model.tokenizer,
        settings.data_dir or data.data_dir,
        data.cache_dir,
    )
    n_bytes = predicted_bytes(tokens, cfg.model.tokenizer, result.get("max_tokens"))
    for row in result["results"]:
        row["n_bytes"] = n_bytes
        row["nll_per_byte"] = row["sum_nll"] / max(n_bytes, 1)
