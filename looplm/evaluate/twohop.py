"""Accuracy on the two-hop knowledge task (:mod:`looplm.data.twohop`), over the whole knowledge base.

The task is finite, so it is scored exhaustively rather than on samples: every one-hop fact
(``hops=1``), every trained two-hop composition (``two_hop``) and every held-out composition
(``heldout``), one prompt per row (``"A1="``, ``"A12="``), the answer read at the ``=`` position
as the argmax over the whole vocabulary.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from looplm.data.twohop import ENTITY_CHARS, KnowledgeBase, knowledge_base

SETS = ("one_hop", "two_hop", "heldout")


@dataclass
class Prompts:
    """One prompt per row: ``input_ids`` (N, L) byte ids; ``answer``, ``bridge``, ``subject``
    (N,) byte ids (``bridge`` = −1 for one-hop facts); ``triples`` the (e, r1, r2) or (e, r, −1)
    index triples."""

    input_ids: torch.Tensor
    answer: torch.Tensor
    bridge: torch.Tensor
    subject: torch.Tensor
    triples: list[tuple[int, int, int]]


def _ids(text: str) -> list[int]:
    return list(text.encode())


def prompts(kb: KnowledgeBase, which: str) -> Prompts:
    """Every prompt of ``which`` (``one_hop``, ``two_hop`` = trained compositions, ``heldout``)."""
    if which == "one_hop":
        triples = [(e, r, -1) for e in range(kb.n_entities) for r in range(kb.n_relations)]
        text = [kb.fact_prompt(e, r) for e, r, _ in triples]
        ans = [kb.hop(e, r) for e, r, _ in triples]
        bridge = [-1] * len(triples)
    else:
        triples = kb.compositions("train" if which == "two_hop" else "heldout")
        text = [kb.query_prompt(*t) for t in triples]
        ans = [kb.two_hop(*t) for t in triples]
        bridge = [ord(ENTITY_CHARS[kb.bridge(e, a)]) for e, a, _ in triples]
    return Prompts(
        torch.tensor([_ids(s) for s in text], dtype=torch.long),
        torch.tensor([ord(ENTITY_CHARS[a]) for a in ans], dtype=torch.long),
        torch.tensor(bridge, dtype=torch.long),
        torch.tensor([ord(ENTITY_CHARS[t[0]]) for t in triples], dtype=torch.long),
        triples,
    )


@torch.no_grad()
def twohop_accuracy(
    model: torch.nn.Module,
    task_args: dict[str, Any] | None,
    depths: Sequence[int],
    *,
    batch_size: int = 512,
    device: str | torch.device = "cpu",
) -> list[dict[str, Any]]:
    """One row per (set, T): ``{"set", "depth", "n_correct", "n_examples", "sum_nll"}`` over
    every prompt of the set (:data:`SETS`), one unroll per batch for all depths."""
    kb = knowledge_base(task_args)
    model.eval()
    rows = []
    for which in SETS:
        p = prompts(kb, which)
        acc: dict[int, list[float]] = {}
        for i in range(0, len(p.triples), batch_size):
            x = p.input_ids[i : i + batch_size].to(device)
            y = p.answer[i : i + batch_size].to(device)
            for T, h in model.iter_depths(x, list(depths)):
                logits = model.readout(h[:, -1]).float()
                a = acc.setdefault(T, [0, 0, 0.0])
                a[0] += int((logits.argmax(-1) == y).sum())
                a[1] += int(y.numel())
                a[2] += float(torch.nn.functional.cross_entropy(logits, y, reduction="sum"))
        for T, (c, n, nll) in sorted(acc.items()):
            rows.append({"set": which, "depth": T, "n_correct": c, "n_examples": n, "sum_nll": nll})
    return rows
