"""An adapter so lm-evaluation-harness can evaluate a looplm checkpoint.

    pip install 'looplm[lmeval]'

From lm-eval's own command line (every lm-eval argument passes through; ``looplm`` is registered
as a model name first):

    looplm lm-eval --model looplm --model_args pretrained=runs/x/ckpt,loops=8 \
        --tasks lambada_openai --output_path out/

``--tasks lambada_local`` without ``--include_path`` runs the offline LAMBADA task below on
``$LOOPLM_DATA_DIR/lambada/lambada_test.jsonl`` (:func:`cli`). From Python:

    import lm_eval
    import looplm.decoding.lmeval  # registers the model name "looplm" with lm-eval
    lm_eval.simple_evaluate(model="looplm", model_args="pretrained=runs/x/ckpt,loops=8",
                            tasks=["lambada_openai"])

The class follows lm-eval 0.4's ``LM`` interface (``loglikelihood``, ``loglikelihood_rolling``,
``generate_until`` over ``Instance.args``); ``model_args`` take ``pretrained`` (a checkpoint
folder), ``loops`` and ``device``. The scoring itself lives in plain functions
(:func:`loglikelihood`, :func:`loglikelihood_rolling`, :func:`generate_until`) that take
``(context, continuation)`` pairs, so they work and are tested without lm-eval. Contexts longer
than the model's context window are cut from the left; rolling log-likelihoods score every token
exactly once in disjoint windows (the first token is predicted from end-of-text).

**Offline LAMBADA.** :func:`write_lambada_task` writes an lm-eval task YAML (``lambada_local``:
``lambada_openai``'s prompt, target and metrics, reading a local ``lambada_test.jsonl`` through
the ``json`` dataset builder) and :func:`evaluate_lambada_local` runs ``lm_eval.simple_evaluate``
on it with ``HF_DATASETS_OFFLINE=1`` / ``HF_HUB_OFFLINE=1`` and only that task folder indexed, so
nothing is downloaded. Tested: the per-example log-likelihoods lm-eval records equal looplm's own
LAMBADA NLL (:mod:`looplm.lambada.completion`) on the same passages. One known difference:
lm-eval's ``lambada_openai`` takes the target after the last *space*, looplm after the last
whitespace; the two differ on 7 of the 5,153 passages (a newline before the last word, e.g. #426).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

from looplm.decoding.decoder import generate


@torch.no_grad()
def _score(model, ids: list[int], n_cont: int, loops: int) -> tuple[float, bool]:
    """Σ log p of the last ``n_cont`` tokens of ``ids`` and whether greedy decoding gives them."""
    dev = model.tok_emb.weight.device
    x = torch.tensor([ids[:-1]], dtype=torch.long, device=dev)
    tgt = torch.tensor(ids[1:], dtype=torch.long, device=dev)[-n_cont:]
    logp = F.log_softmax(model(x, loops=loops)[0, -n_cont:].float(), dim=-1)  # (n_cont, V)
    total = float(logp.gather(1, tgt[:, None]).sum())
    return total, bool((logp.argmax(-1) == tgt).all())


def loglikelihood(
    model, tokenizer, pairs: list[tuple[str, str]], loops: int = 8
) -> list[tuple[float, bool]]:
    """(log p(continuation | context), is_greedy) per pair; the context is cut from the left."""
    out = []
    ctx_len = model.config.context
    for context, continuation in pairs:
        ctx = tokenizer.encode(context) or [tokenizer.eot_id]
        cont = tokenizer.encode(continuation)
        ids = (ctx + cont)[-(ctx_len + 1) :]
        n = min(len(cont), len(ids) - 1)
        out.append(_score(model, ids, n, loops))
    return out


def loglikelihood_rolling(model, tokenizer, texts: list[str], loops: int = 8) -> list[float]:
    """Σ log p of every token of each text, in disjoint context-sized windows."""
    L = model.config.context
    out = []
    for text in texts:
        ids = [tokenizer.eot_id] + tokenizer.encode(text)
        total = 0.0
        for start in range(0, len(ids) - 1, L):
            window = ids[start : start + L + 1]
            total += _score(model, window, len(window) - 1, loops)[0]
        out.append(total)
    return out


def generate_until(
    model, tokenizer, requests: list[tuple[str, dict[str, Any]]], loops: int = 8
) -> list[str]:
    """Greedy continuation of each context, cut at the first stop string (``until``)."""
    out = []
    for context, kwargs in requests:
        until = kwargs.get("until") or []
        until = [until] if isinstance(until, str) else list(until)
        max_new = int(kwargs.get("max_gen_toks", 32))
        ids = tokenizer.encode(context) or [tokenizer.eot_id]
        max_new = max(1, min(max_new, model.config.context - 1))
        ids = ids[-(model.config.context - max_new) :]
        x = torch.tensor([ids], device=model.tok_emb.weight.device)
        gen = generate(model, x, max_new, loops=loops)[0, len(ids) :]
        text = tokenizer.decode(gen.tolist())
        cut = min([text.index(u) for u in until if u in text], default=len(text))
        out.append(text[:cut])
    return out


LAMBADA_TASK = "lambada_local"


def lambada_task(data: str | os.PathLike, name: str = LAMBADA_TASK) -> dict[str, Any]:
    """lm-eval task config: ``lambada_openai`` (lm-eval 0.4's YAML: prompt = the text up to its
    last space-separated word, target = " " + that word, perplexity and accuracy) over a local
    ``lambada_test.jsonl`` (the file or its folder) read by the ``json`` dataset builder."""
    path = Path(data)
    if path.is_dir():
        path = path / "lambada_test.jsonl"
    if not path.is_file():
        from looplm.errors import LoopLMError

        raise LoopLMError(f"no LAMBADA file at {path} (expected lambada_test.jsonl)")
    return {
        "task": name,
        "dataset_path": "json",
        "dataset_kwargs": {"data_files": {"test": str(path.resolve())}},
        "output_type": "loglikelihood",
        "test_split": "test",
        "doc_to_text": "{{text.split(' ')[:-1]|join(' ')}}",
        "doc_to_target": "{{' '+text.split(' ')[-1]}}",
        "metric_list": [
            {"metric": "perplexity", "aggregation": "perplexity", "higher_is_better": False},
            {"metric": "acc", "aggregation": "mean", "higher_is_better": True},
        ],
        "metadata": {"version": 1.0},
    }


def write_lambada_task(
    folder: str | os.PathLike, data: str | os.PathLike, name: str = LAMBADA_TASK
) -> Path:
    """Write :func:`lambada_task` as ``folder/<name>.yaml`` (an lm-eval ``include_path``)."""
    import yaml

    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    out = folder / f"{name}.yaml"
    out.write_text(yaml.safe_dump(lambada_task(data, name), sort_keys=False))
    return out


def evaluate_lambada_local(
    pretrained: str | os.PathLike,
    data: str | os.PathLike,
    *,
    loops: int = 8,
    limit: int | None = None,
    task_dir: str | os.PathLike | None = None,
    device: str = "cpu",
) -> dict[str, Any]:
    """``lm_eval.simple_evaluate`` of the checkpoint ``pretrained`` on the local LAMBADA task,
    offline; returns lm-eval's result dict (``results``, and ``samples`` with each request's
    log-likelihood). ``limit`` takes the first n passages."""
    import tempfile

    os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import lm_eval
    from lm_eval.tasks import TaskManager

    with tempfile.TemporaryDirectory() as tmp:
        folder = Path(task_dir) if task_dir is not None else Path(tmp)
        write_lambada_task(folder, data)
        tm = TaskManager(include_path=str(folder), include_defaults=False)
        return lm_eval.simple_evaluate(
            model="looplm",
            model_args={"pretrained": str(pretrained), "loops": int(loops), "device": device},
            tasks=[LAMBADA_TASK],
            task_manager=tm,
            limit=limit,
            log_samples=True,
            bootstrap_iters=0,
        )


def cli(argv: list[str]) -> int:
    """``looplm lm-eval ARGS``: lm-eval's own command line (``lm-eval ARGS``) with the ``looplm``
    model registered. When the tasks include ``lambada_local`` and no ``--include_path`` is given,
    that task is written to a temporary folder (reading ``$LOOPLM_DATA_DIR/lambada``) and the
    run is offline."""
    import sys
    import tempfile

    from looplm.errors import LoopLMError

    try:
        from lm_eval._cli import HarnessCLI
    except ImportError:
        raise LoopLMError(
            "looplm lm-eval needs lm-evaluation-harness: pip install 'looplm[lmeval]'"
        ) from None
    _register()
    argv = list(argv)
    tasks = _option(argv, "--tasks")
    with tempfile.TemporaryDirectory() as tmp:
        if tasks and LAMBADA_TASK in tasks.split(",") and _option(argv, "--include_path") is None:
            data = os.environ.get("LOOPLM_DATA_DIR")
            if not data:
                raise LoopLMError(
                    f"--tasks {LAMBADA_TASK} reads $LOOPLM_DATA_DIR/lambada/lambada_test.jsonl: "
                    "set LOOPLM_DATA_DIR to the data folder (or pass --include_path with the task)"
                )
            write_lambada_task(tmp, Path(data) / "lambada")
            argv += ["--include_path", tmp]
            os.environ.setdefault("HF_DATASETS_OFFLINE", "1")
            os.environ.setdefault("HF_HUB_OFFLINE", "1")
        saved = sys.argv
        sys.argv = ["lm-eval", *argv]
        try:
            harness = HarnessCLI()
            harness.execute(harness.parse_args())
        except ValueError as exc:
            if str(exc).startswith("Tasks not found"):  # the harness's own traceback otherwise
                missing = str(exc).split(":", 1)[1].strip()
                raise LoopLMError(
                    f"--tasks {tasks}: unknown task(s) {missing}; list the known ones with "
                    "`looplm lm-eval ls tasks` (or pass --include_path with your task's YAML)"
                ) from None
            raise
        finally:
            sys.argv = saved
    return 0


def _option(argv: list[str], name: str) -> str | None:
    """The value of ``--name VALUE`` or ``--name=VALUE`` in ``argv`` (the last one), or None."""
    value = None
    for i, arg in enumerate(argv):
        if arg == name and i + 1 < len(argv):
            value = argv[i + 1]
        elif arg.startswith(name + "="):
            value = arg.split("=", 1)[1]
    return value


_registered = False


def _register() -> None:
    global _registered
    if _registered:
        return
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:  # lm-eval is an optional extra
        return
    _registered = True

    @register_model("looplm")
    class LoopLMEval(LM):
        """lm-eval model: ``pretrained=<checkpoint folder>,loops=<T>``."""

        def __init__(
            self, pretrained: str, loops: int = 8, device: str | None = None, **kwargs: Any
        ) -> None:
            super().__init__()
            from looplm.data import get_tokenizer
            from looplm.model.checkpoint import load_checkpoint

            # lm-eval also passes batch_size / max_batch_size: requests are scored one at a time.
            # Its command line defaults to --device cuda: without CUDA the model runs on the CPU,
            # as lm-eval's own transformers model does.
            if not device or (str(device).startswith("cuda") and not torch.cuda.is_available()):
                device = "cuda" if torch.cuda.is_available() else "cpu"
            self.model, cfg, _ = load_checkpoint(pretrained, map_location=device)
            self.tokenizer = get_tokenizer(cfg.model.tokenizer)
            self.loops = int(loops)

        def loglikelihood(self, requests):
            return loglikelihood(self.model, self.tokenizer, [r.args for r in requests], self.loops)

        def loglikelihood_rolling(self, requests):
            texts = [r.args[0] for r in requests]
            return loglikelihood_rolling(self.model, self.tokenizer, texts, self.loops)

        def generate_until(self, requests):
            return generate_until(
                self.model, self.tokenizer, [r.args for r in requests], self.loops
            )


_register()
