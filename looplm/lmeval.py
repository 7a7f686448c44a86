"""An adapter so lm-evaluation-harness can evaluate a looplm checkpoint.

    pip install 'looplm[lmeval]'

    import lm_eval
    import looplm.lmeval  # registers the model name "looplm" with lm-eval
    lm_eval.simple_evaluate(model="looplm", model_args="pretrained=runs/x/ckpt,loops=8",
                            tasks=["lambada_openai"])

The class follows lm-eval 0.4's ``LM`` interface (``loglikelihood``, ``loglikelihood_rolling``,
``generate_until`` over ``Instance.args``); it has not been run inside lm-eval here (the package
is an optional extra and was not installed). The
scoring itself lives in plain functions (:func:`loglikelihood`, :func:`loglikelihood_rolling`,
:func:`generate_until`) that take ``(context, continuation)`` pairs, so they work and are tested
without lm-eval. Contexts longer than the model's context window are cut from the left;
rolling log-likelihoods score every token exactly once in disjoint windows (the first token is
predicted from end-of-text).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F

from looplm.generate import generate


@torch.no_grad()
def _score(model, ids: list[int], n_cont: int, loops: int) -> tuple[float, bool]:
    """Σ log p of the last ``n_cont`` tokens of ``ids`` and whether greedy decoding gives them."""
    x = torch.tensor([ids[:-1]], dtype=torch.long)
    tgt = torch.tensor(ids[1:], dtype=torch.long)[-n_cont:]
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
        gen = generate(model, torch.tensor([ids]), max_new, loops=loops)[0, len(ids) :]
        text = tokenizer.decode(gen.tolist())
        cut = min([text.index(u) for u in until if u in text], default=len(text))
        out.append(text[:cut])
    return out


def _register() -> None:
    try:
        from lm_eval.api.model import LM
        from lm_eval.api.registry import register_model
    except ImportError:  # lm-eval is an optional extra
        return

    @register_model("looplm")
    class LoopLMEval(LM):
        """lm-eval model: ``pretrained=<checkpoint folder>,loops=<T>``."""

        def __init__(self, pretrained: str, loops: int = 8, **kwargs: Any) -> None:
            super().__init__()
            from looplm.checkpoint import load_checkpoint
            from looplm.data import get_tokenizer

            self.model, cfg, _ = load_checkpoint(pretrained)
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
