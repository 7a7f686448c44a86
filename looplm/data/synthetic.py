"""Synthetic compositional tasks generated on the fly from a seed (the tasks of "Thinking
Deeper, Not Longer").

``bool_logic``: nested boolean expressions over T/F with ``&``, ``|``, ``^`` and ``~`` (each
node negated with probability 0.1); the difficulty is the nesting depth. Each level combines the
deeper sub-expression with a literal partner on a random side, so the length grows linearly with
depth (depth 8 is ~35 characters) and train and test difficulty ranges can differ. Example
(depth 3)::

    (F|(T^~F))&T=T

Token ids are UTF-8 bytes (the byte-level tokenizer: 0..255, end-of-text 256 pads). The model reads
the expression and ``=`` and is supervised only at the ``=`` position, whose target is ``T`` or
``F``; labels are balanced, so chance accuracy is 50%. Rows pack several independent examples
(``expr=A;expr=A;…``) so each sequence carries several supervised answers.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import torch

from looplm.errors import LoopLMError
from looplm.settings.config import NODE_TASKS
from looplm.targets import IGNORE_INDEX

PAD_ID = 256  # the byte tokenizer's end-of-text id
_OPS = {"&": lambda a, b: a and b, "|": lambda a, b: a or b, "^": lambda a, b: a != b}


def _expr(rng: random.Random, depth: int) -> tuple[str, bool]:
    """A random expression of exactly ``depth`` nesting levels and its truth value."""
    if depth == 0:
        v = rng.random() < 0.5
        s = "T" if v else "F"
    else:
        deep, dv = _expr(rng, depth - 1)
        shallow, sv = _expr(rng, 0)
        op = rng.choice("&|^")
        left, right = (deep, shallow) if rng.random() < 0.5 else (shallow, deep)
        lv, rv = (dv, sv) if left is deep else (sv, dv)
        v = _OPS[op](lv, rv)
        s = f"({left}{op}{right})"
    if rng.random() < 0.1:
        s, v = "~" + s, not v
    return s, v


def bool_logic_example(rng: random.Random, depth: int, want: bool | None = None) -> tuple[str, str]:
    """(expression + '=', answer 'T'/'F'); outer parentheses dropped. Rejection-samples ``want``."""
    while True:
        s, v = _expr(rng, depth)
        if s.startswith("(") and s.endswith(")"):
            s = s[1:-1]
        if want is None or v == want:
            return s + "=", "T" if v else "F"


_NAMES = (
    "ann bob cal dan eve fay gus hal ivy jon kim lea max ned oli pam quin ray sue tom uma vic wes"
).split()


def _two_chains(rng: random.Random, depth: int, n_nodes: int) -> tuple[list[int], list[int]]:
    """Two disjoint chains of ``depth + 1`` distinct node ids each."""
    nodes = rng.sample(range(n_nodes), 2 * (depth + 1))
    return nodes[: depth + 1], nodes[depth + 1 :]


def graph_reach_example(
    rng: random.Random, depth: int, want: bool | None = None
) -> tuple[str, str]:
    """Graph reachability: shuffled directed edges of two disjoint chains, then a query.

    ``bc;ab;xy;yz|a?c=`` → ``Y`` (a reaches c in ``depth`` hops) or ``N`` (the target lies on the
    other chain). Nodes are letters a–z; difficulty = the query's path length (≤ 12).
    """
    if depth > 12:
        raise LoopLMError(f"graph_reach difficulty {depth} > 12 (26 letters, two chains)")
    reach = rng.random() < 0.5 if want is None else want
    a, b = _two_chains(rng, depth, 26)
    edges = [(c[i], c[i + 1]) for c in (a, b) for i in range(depth)]
    rng.shuffle(edges)
    letter = lambda i: chr(ord("a") + i)  # noqa: E731
    target = a[-1] if reach else b[-1]
    text = ";".join(letter(u) + letter(v) for u, v in edges)
    return f"{text}|{letter(a[0])}?{letter(target)}=", "Y" if reach else "N"


def relational_text_example(
    rng: random.Random, depth: int, want: bool | None = None
) -> tuple[str, str]:
    """Relational reasoning in text: chained "X is older than Y." facts, then a yes/no question.

    The facts of two disjoint chains are shuffled; the question asks whether the first person of
    one chain is older than the last person of that chain (``Y``, by transitivity over ``depth``
    facts) or of the other chain (``N``, not derivable). Difficulty = chain length (≤ 10).
    """
    if depth > 10:
        raise LoopLMError(f"relational_text difficulty {depth} > 10 (23 names, two chains)")
    reach = rng.random() < 0.5 if want is None else want
    a, b = _two_chains(rng, depth, len(_NAMES))
    facts = [(c[i], c[i + 1]) for c in (a, b) for i in range(depth)]
    rng.shuffle(facts)
    target = a[-1] if reach else b[-1]
    text = " ".join(f"{_NAMES[u]}>{_NAMES[v]}." for u, v in facts)
    return f"{text} {_NAMES[a[0]]}>{_NAMES[target]}?", "Y" if reach else "N"


@dataclass
class NodeExample:
    """A graph example with one token per node: ``text``; ``answers[i]`` is the label at text
    position i ('Y'/'N'), ``distance[i]`` the node's shortest-path distance from the source
    (−1 when unreachable)."""

    text: str
    answers: dict[int, str]
    distance: dict[int, int]


def graph_nodes_example(rng: random.Random, depth: int, want: bool | None = None) -> NodeExample:
    """Graph reachability with one token per node, for adjacency-masked attention.

    ``ab;bc;xb|Acbxy``: the directed edges (``u v`` pairs, shuffled), ``|``, then every node once
    (shuffled), the source in upper case. Every node except the source and the decoy root is a
    query: its label is ``Y`` if the source reaches it, else ``N``. The graph has two components
    with the same layered shape: the source's (layers 0 … ``depth``, 1–2 nodes per layer, each node
    of layer i+1 with an edge from layer i and sometimes a second one, never a shortcut) and a decoy
    one that the source cannot reach; a few extra edges from the decoy component run into the
    source's component and, mirrored, into the decoy's own (they change no label, and in-degree
    has the same distribution for both labels). So exactly half the queries are ``Y``, and the
    deepest reachable node is ``depth`` hops away: the difficulty is the number of propagation
    steps needed (≤ 12; 26 letters).
    """
    del want  # labels are balanced within each example
    if depth > 12:
        raise LoopLMError(f"graph_nodes difficulty {depth} > 12 (26 letters, two components)")
    extra = rng.randint(0, min(depth, 12 - depth))  # second nodes, in random layers
    doubled = set(rng.sample(range(1, depth + 1), extra))
    sizes = [1] + [2 if i in doubled else 1 for i in range(1, depth + 1)]
    letters = rng.sample("abcdefghijklmnopqrstuvwxyz", 2 * sum(sizes))
    edges: list[tuple[str, str]] = []
    comps = []
    for _c in range(2):
        layers = [[letters.pop() for _ in range(n)] for n in sizes]
        for i in range(depth):
            for v in layers[i + 1]:
                parents = rng.sample(layers[i], min(len(layers[i]), 1 + (rng.random() < 0.3)))
                edges += [(u, v) for u in parents]
        comps.append(layers)
    reach, decoy = comps
    decoy_nodes = [v for layer in decoy for v in layer]
    # Extra in-edges from the decoy component (labels unchanged), added in mirrored pairs: one into
    # a reachable node and one into the decoy node at the same layer and place, so a node's
    # in-degree says nothing about its label.
    for _ in range(rng.randint(0, max(1, depth // 2))):
        i = rng.randint(1, depth)
        j = rng.randrange(sizes[i])
        v, w = reach[i][j], decoy[i][j]
        u_v = [u for u in decoy_nodes if (u, v) not in edges]
        u_w = [u for u in decoy_nodes if u != w and (u, w) not in edges]
        if u_v and u_w:
            edges += [(rng.choice(u_v), v), (rng.choice(u_w), w)]
    edges = sorted(edges, key=lambda e: rng.random())
    dist = {v: i for i, layer in enumerate(reach) for v in layer}
    nodes = [v for layer in reach + decoy for v in layer]
    rng.shuffle(nodes)
    src, root = reach[0][0], decoy[0][0]
    head = ";".join(u + v for u, v in edges) + "|"
    text = head + "".join(v.upper() if v == src else v for v in nodes)
    answers, distance = {}, {}
    for j, v in enumerate(nodes):
        if v in (src, root):
            continue
        answers[len(head) + j] = "Y" if v in dist else "N"
        distance[len(head) + j] = dist.get(v, -1)
    return NodeExample(text, answers, distance)


_EXAMPLES = {
    "bool_logic": bool_logic_example,
    "graph_reach": graph_reach_example,
    "relational_text": relational_text_example,
    "graph_nodes": graph_nodes_example,
}
TWOHOP = "twohop"  # the knowledge task of looplm.data.twohop (its own example generator)
TASKS = (*_EXAMPLES, TWOHOP)


def task_arg_keys(task: str) -> frozenset[str]:
    """The ``data.task_args`` keys ``task`` takes (``seq_len`` packs examples for every task)."""
    from looplm.data.twohop import TASK_ARG_KEYS

    return frozenset({"seq_len"}) | (TASK_ARG_KEYS if task == TWOHOP else frozenset())


@dataclass
class TaskBatch:
    """input_ids (B, L) int64; targets (B, L), ``IGNORE_INDEX`` except at answer positions; difficulty (B, L);
    distance (B, L): graph tasks' per-query hop distance (−1 unreachable), 0 elsewhere."""

    input_ids: torch.Tensor
    targets: torch.Tensor
    difficulty: torch.Tensor  # difficulty of the example answered at each position, 0 elsewhere
    distance: torch.Tensor | None = None


def _generator(task: str, difficulty: tuple[int, int], task_args: dict | None, split: str):
    """The example generator ``(rng, depth, want) -> example`` of ``task``."""
    if task != TWOHOP:
        return _EXAMPLES[task]
    from looplm.data.twohop import knowledge_base

    kb = knowledge_base(task_args)
    if difficulty[1] > 2:
        raise LoopLMError(
            f"twohop difficulty range {difficulty}; allowed difficulties: 1 (one-hop fact), "
            "2 (two-hop query)"
        )
    return lambda rng, depth, want: kb.example(rng, depth, split)


# long: packs examples into rows and the rows into four aligned tensors in one pass
def make_batch(
    task: str,
    batch_size: int,
    difficulty: tuple[int, int],
    seed: int,
    max_len: int = 128,
    seq_len: int = 0,
    task_args: dict | None = None,
    split: str = "train",
) -> TaskBatch:
    """A deterministic batch for ``seed``.

    Each row packs independent examples ``expr=A;`` until ``seq_len`` tokens are filled (at least
    one), so every row carries several supervised answers; difficulty is drawn uniformly from
    [lo, hi] per example. With one example per row answers alternate T/F over rows (balanced
    batches); packed rows draw each answer independently (balanced in expectation), so the
    previous answer in a row says nothing about the next. ``task_args``: a task's generator
    settings (``twohop``: its knowledge base); ``split``: ``twohop`` compositions (``heldout``).
    """
    if task not in TASKS:
        raise LoopLMError(f"unknown synthetic task {task!r}; allowed: {', '.join(TASKS)}")
    lo, hi = difficulty
    if lo < 1 or hi < lo:
        raise LoopLMError(f"difficulty range {difficulty} must satisfy 1 <= lo <= hi")
    seq_len = min(seq_len, max_len) if seq_len > 0 else 0  # 0: one example per row
    if task in NODE_TASKS and seq_len:
        raise LoopLMError(
            f"task {task!r} takes one graph per row: data.task_args.seq_len must be 0"
        )
    make = _generator(task, difficulty, task_args, split)
    rng = random.Random(seed)
    rows, k = [], 0
    for _ in range(batch_size):
        ids: list[int] = []
        tgt: list[int] = []
        dif: list[int] = []
        hop: list[int] = []
        while True:
            depth = rng.randint(lo, hi)
            # One example per row: answers alternate over rows (exactly balanced batches). Packed
            # rows draw each answer at random: alternating answers inside a row would let a model
            # read the answer off the previous one.
            want = bool(k % 2) if not seq_len else rng.random() < 0.5
            ex = make(rng, depth, want=want)
            if isinstance(ex, NodeExample):
                text, answers, dist = ex.text, ex.answers, ex.distance
            else:  # '=' (the last character) predicts the answer, which follows it
                text, answers, dist = ex[0] + ex[1] + ";", {len(ex[0]) - 1: ex[1]}, {}
            n = len(text.encode())
            if n > max_len:
                raise LoopLMError(
                    f"difficulty {depth} gives a {n}-token example, longer than the "
                    f"context {max_len}; lower the difficulty or raise model.context"
                )
            if ids and len(ids) + n > seq_len:
                break
            k += 1
            base = len(ids)
            ids += list(text.encode())
            tgt += [IGNORE_INDEX] * n
            dif += [0] * n
            hop += [0] * n
            for i, a in answers.items():
                tgt[base + i], dif[base + i] = ord(a), depth
                hop[base + i] = dist.get(i, 0)
            if len(ids) >= seq_len:  # always true for seq_len = 0
                break
        rows.append((ids, tgt, dif, hop))
    L = max(len(r[0]) for r in rows)
    x = torch.full((batch_size, L), PAD_ID, dtype=torch.long)
    y = torch.full((batch_size, L), IGNORE_INDEX, dtype=torch.long)
    d = torch.zeros((batch_size, L), dtype=torch.long)
    h = torch.zeros((batch_size, L), dtype=torch.long)
    for i, (ids, tgt, dif, hop) in enumerate(rows):
        x[i, : len(ids)] = torch.tensor(ids)
        y[i, : len(ids)] = torch.tensor(tgt)
        d[i, : len(ids)] = torch.tensor(dif)
        h[i, : len(ids)] = torch.tensor(hop)
    return TaskBatch(x, y, d, h if task in NODE_TASKS else None)
