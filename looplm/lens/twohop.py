"""The Jacobian lens on the two-hop knowledge task: is the bridge entity in the workspace?

For one checkpoint and one depth T, :func:`lens_twohop` fits the Jacobian lens
(:func:`looplm.lens.jacobian.fit_jacobian_lens`) on ``n_fit`` single-example rows of training
text, then on every two-hop prompt (``"A12="``; the bridge ``r1(A)`` is never in the prompt) reads
the query position's loop states h_0 … h_T under each lens arm (``jlens``: ``unembed(J_t h)``;
``logit``: ``unembed(h)``; ``tuned``: ``unembed(A_t h + b_t)`` trained to the final distribution on
the same fitting prompts, :func:`looplm.lens.readout.fit_tuned_lens`) and measures, per loop step t and per prompt:

* ``rank`` — the bridge entity's rank among the whole vocabulary (0 = the lens's top-1);
* ``kl`` — ``KL(p_T ‖ lens_t)``, the fidelity to the model's own final distribution;
* ``agree`` — whether the lens's top-1 is the model's top-1.

The **swap test** (:func:`swap_test`) edits the query position over a band of loop steps: the
coordinates of the bridge ``b`` and another entity ``b'`` (with ``r2(b') ≠ r2(b)``) along the lens's
token directions are exchanged (:func:`looplm.lens.interventions.coordinate_swap`,
to the unedited run's coordinates at every step of the band, so consecutive steps do not swap
back), and the model's own unroll continues. Success: the answer becomes ``r2(b')``. The control swaps an
unrelated pair of entities (neither the subject, ``b`` nor ``b'``) and is scored against the same
target. Only prompts the model answers correctly at T are swapped.

The **subspace overlap** (:func:`subspace_overlap`) compares the top-k right-singular subspaces of
J_t across steps (t = 0 … T−1; ``J_T = I``) and across depths, against random k-subspaces.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from looplm.data.synthetic import PAD_ID, make_batch
from looplm.data.twohop import ENTITY_CHARS, KnowledgeBase
from looplm.errors import LoopLMError
from looplm.evaluate.twohop import Prompts
from looplm.lens.settings import ARMS

LENS_FIT_SEED = 2_000_003  # fitting prompts: a seed no training or evaluation batch uses


def fit_prompts(task_args: dict[str, Any] | None, n_fit: int, context: int) -> torch.Tensor:
    """``n_fit`` single-example rows of training text (one-hop facts and trained two-hop queries,
    answer included, padded with the end-of-text id): (n_fit, L) ids."""
    b = make_batch("twohop", n_fit, (1, 2), seed=LENS_FIT_SEED, max_len=context,
                   task_args=task_args)  # fmt: skip
    return b.input_ids


def fit_arms(
    model: torch.nn.Module,
    task_args: dict[str, Any] | None,
    loops: int,
    n_fit: int,
    arms: Sequence[str] = ARMS,
    tuned_steps: int = 250,
) -> dict[str, Any]:
    """The lens arms at depth T, fitted on the same ``n_fit`` prompts: ``jlens`` (exact fit),
    ``logit`` (J = I), ``tuned`` (affine per step)."""
    from looplm.lens.jacobian import fit_jacobian_lens, logit_lens
    from looplm.lens.readout import fit_tuned_lens

    bad = [a for a in arms if a not in ARMS]
    if bad or "jlens" not in arms:
        raise LoopLMError(f"lens arms {list(arms)}; allowed: {', '.join(ARMS)} (jlens required)")
    ids = fit_prompts(task_args, n_fit, model.config.context)
    out: dict[str, Any] = {}
    for a in arms:
        if a == "jlens":
            out[a] = fit_jacobian_lens(model, [ids], loops=loops, mode="exact", pad_id=PAD_ID,
                                       corpus="twohop")  # fmt: skip
        elif a == "logit":
            out[a] = logit_lens(model, loops)
        else:
            out[a] = fit_tuned_lens(model, [ids], loops, steps=tuned_steps, pad_id=PAD_ID)
    return out


def _ranks(logits: torch.Tensor, token: torch.Tensor) -> torch.Tensor:
    """(N,) rank of ``token`` (N,) in each row of ``logits`` (N, V): the number of strictly larger
    logits."""
    own = logits.gather(1, token[:, None])
    return (logits > own).sum(1)


@torch.no_grad()
def readout_measures(
    model: torch.nn.Module, arms: dict[str, Any], p: Prompts, batch_size: int = 512
) -> dict[str, Any]:
    """Per arm (``{name: lens}``, each with ``.loops`` and ``.apply``) and loop step t = 0 … T,
    per prompt: bridge rank, KL(p_T ‖ lens_t), top-1 agreement at the query position, the bridge
    rank at the first relation's position (``rank_r1``: where ``A1`` is read, the one-hop prefix
    whose answer is the bridge); and the model's own answer
    correctness at T (``correct``, (N,)). Arrays (T+1, N)."""
    from looplm.lens.jacobian import loop_states

    T = next(iter(arms.values())).loops
    out: dict[str, Any] = {a: {"rank": [], "kl": [], "agree": [], "rank_r1": []} for a in arms}
    correct = []
    for i in range(0, p.input_ids.shape[0], batch_size):
        ids = p.input_ids[i : i + batch_size]
        bridge = p.bridge[i : i + batch_size]
        hidden, logits = loop_states(model, ids, T)
        final = logits[:, -1].float().log_softmax(-1)
        top = final.argmax(-1)
        correct.append((top == p.answer[i : i + batch_size]).numpy())
        for a, ln in arms.items():
            r, k, g, r1 = [], [], [], []
            for t, h in enumerate(hidden):
                lt = ln.apply(model, h[:, -1], t).float()
                lp = lt.log_softmax(-1)
                r.append(_ranks(lt, bridge).numpy())
                r1.append(_ranks(ln.apply(model, h[:, 1], t).float(), bridge).numpy())
                k.append((final.exp() * (final - lp)).sum(-1).clamp_min(0).numpy())
                g.append((lt.argmax(-1) == top).numpy())
            out[a]["rank"].append(np.stack(r))
            out[a]["kl"].append(np.stack(k))
            out[a]["agree"].append(np.stack(g))
            out[a]["rank_r1"].append(np.stack(r1))
    for a in arms:
        for m in ("rank", "kl", "agree", "rank_r1"):
            out[a][m] = np.concatenate(out[a][m], axis=1)
    out["correct"] = np.concatenate(correct)
    return out


def swap_pairs(kb: KnowledgeBase, triples: Sequence[tuple[int, int, int]], seed: int = 0):
    """Per two-hop triple (e, r1, r2): (b, b', c, c') entity indices — the bridge, its swap
    partner (``≠ e``, ``r2(b') ≠ r2(b)``) and an unrelated control pair (neither e, b nor b');
    seeded by the triple, so every model gets the same pairs."""
    out = []
    for e, a, r2 in triples:
        rng = random.Random(f"swap/{seed}/{e}/{a}/{r2}")
        b = kb.bridge(e, a)
        partners = [
            x for x in range(kb.n_entities) if x not in (e, b) and kb.hop(x, r2) != kb.hop(b, r2)
        ]
        if not partners:
            raise LoopLMError(f"no swap partner for the bridge of {kb.query_prompt(e, a, r2)!r}")
        b2 = rng.choice(partners)
        rest = [x for x in range(kb.n_entities) if x not in (e, b, b2)]
        c, c2 = rng.sample(rest, 2)
        out.append((b, b2, c, c2))
    return out


def _tok(kb_index: Sequence[int]) -> torch.Tensor:
    return torch.tensor([ord(ENTITY_CHARS[i]) for i in kb_index], dtype=torch.long)


@torch.no_grad()
def swap_test(
    model: torch.nn.Module,
    lens: Any,
    kb: KnowledgeBase,
    p: Prompts,
    band: tuple[int, int],
    *,
    select: np.ndarray | None = None,
    batch_size: int = 512,
    where: str = "query",
) -> dict[str, np.ndarray]:
    """Per selected prompt: ``success`` (the answer became r2(b') after the bridge swap),
    ``control`` (the same target after the unrelated-pair swap), ``changed`` / ``control_changed``
    (the answer moved at all), ``prompt`` (the index of each prompt in ``p``). ``select``: a boolean mask of prompts (default all). ``where``:
    edit the ``query`` position only, or ``all`` positions of the prompt."""
    if where not in ("query", "all"):
        raise LoopLMError(f"swap positions {where!r}; allowed: query, all")
    from looplm.lens.interventions import intervene, token_edit
    from looplm.lens.jacobian import loop_states

    idx = np.arange(len(p.triples)) if select is None else np.flatnonzero(select)
    triples = [p.triples[i] for i in idx]
    pairs = swap_pairs(kb, triples)
    T = lens.loops
    res: dict[str, list[np.ndarray]] = {
        k: [] for k in ("success", "control", "changed", "control_changed")
    }
    for i in range(0, len(idx), batch_size):
        sl = idx[i : i + batch_size]
        ids = p.input_ids[sl]
        chunk = pairs[i : i + batch_size]
        target = _tok([kb.hop(b2, t[2]) for (b, b2, c, c2), t in
                       zip(chunk, triples[i : i + batch_size])])  # fmt: skip
        answer = p.answer[sl]
        pos = torch.zeros_like(ids, dtype=torch.bool)
        pos[:, -1] = True
        if where == "all":
            pos[:] = True
        for name, (ka, kb_) in (("success", (0, 1)), ("control", (2, 3))):
            ta, tb = _tok([q[ka] for q in chunk]), _tok([q[kb_] for q in chunk])
            clean, _ = loop_states(model, ids, T)  # each step writes the clean coordinates, swapped
            edit = token_edit("swap", model, lens, ta, tb, 1.0, reference=clean)
            top = intervene(model, ids, T, band, edit, positions=pos)[:, -1].argmax(-1)
            res[name].append((top == target).numpy())
            res["changed" if name == "success" else "control_changed"].append(
                (top != answer).numpy()
            )
    out = {k: np.concatenate(v) if v else np.zeros(0, bool) for k, v in res.items()}
    out["prompt"] = idx  # the index of each swapped prompt in ``p``
    return out


def subspace_overlap(lenses: dict[int, Any], k: int) -> dict[str, Any]:
    """Top-k subspace overlaps of J_t (t = 0 … T−1): the mean over pairs of distinct steps within
    each fit, the same-step overlap of the shallowest fit with each deeper fit, the full matrices,
    and the random-subspace baseline."""
    from looplm.lens.structure import overlap_matrix, random_overlap

    depths = sorted(lenses)
    base = lenses[depths[0]]
    out: dict[str, Any] = {"k": k, "random": random_overlap(base.d_model, k), "within": {},
                           "same_step": {}, "matrix": {}}  # fmt: skip
    for T in depths:
        m = overlap_matrix(lenses[T], k=k)[:T, :T]
        off = m[~np.eye(T, dtype=bool)]
        out["within"][T] = float(off.mean()) if off.size else float("nan")
        out["matrix"][T] = m.round(4).tolist()
    for T in depths[1:]:
        m = overlap_matrix(base, lenses[T], k=k)
        t0 = base.loops
        out["same_step"][T] = float(np.mean([m[t, t] for t in range(t0)]))
    return out
