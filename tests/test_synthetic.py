"""Synthetic tasks: answers checked by independent solvers, balance, determinism, difficulty."""

from __future__ import annotations

import random
import re

import pytest
import torch

from looplm.data.synthetic import (
    NODE_TASKS,
    TASKS,
    TWOHOP,
    bool_logic_example,
    graph_reach_example,
    make_batch,
    relational_text_example,
)
from looplm.errors import LoopLMError


def _eval_bool(s: str) -> bool:
    """Recursive-descent evaluator: expr := unary (op unary)?, unary := '~' unary | atom."""
    pos = 0

    def unary() -> bool:
        nonlocal pos
        if s[pos] == "~":
            pos += 1
            return not unary()
        if s[pos] == "(":
            pos += 1
            v = expr()
            assert s[pos] == ")"
            pos += 1
            return v
        pos += 1
        return s[pos - 1] == "T"

    def expr() -> bool:
        nonlocal pos
        v = unary()
        if pos < len(s) and s[pos] in "&|^":
            op = s[pos]
            pos += 1
            w = unary()
            v = {"&": v and w, "|": v or w, "^": v != w}[op]
        return v

    out = expr()
    assert pos == len(s)
    return out


def _reachable(edges: list[tuple[str, str]], src: str, dst: str) -> bool:
    seen, todo = {src}, [src]
    while todo:
        u = todo.pop()
        for a, b in edges:
            if a == u and b not in seen:
                seen.add(b)
                todo.append(b)
    return dst in seen


@pytest.mark.parametrize("depth", [1, 2, 3, 5, 8])
def test_bool_logic_answers_and_depth(depth: int) -> None:
    rng = random.Random(depth)
    for _ in range(200):
        text, ans = bool_logic_example(rng, depth)
        expr = text[:-1]
        assert _eval_bool(expr) == (ans == "T"), text
        assert sum(expr.count(c) for c in "&|^") == depth  # one operator per nesting level


@pytest.mark.parametrize("depth", [1, 4, 12])
def test_graph_reach_answers(depth: int) -> None:
    rng = random.Random(depth)
    for _ in range(200):
        text, ans = graph_reach_example(rng, depth)
        edges_s, query = text[:-1].split("|")
        edges = [(e[0], e[1]) for e in edges_s.split(";")]
        assert len(edges) == 2 * depth
        src, dst = query.split("?")
        assert _reachable(edges, src, dst) == (ans == "Y"), text


@pytest.mark.parametrize("depth", [1, 3, 6])
def test_relational_text_answers(depth: int) -> None:
    rng = random.Random(depth)
    for _ in range(200):
        text, ans = relational_text_example(rng, depth)
        facts = re.findall(r"(\w+)>(\w+)\.", text)
        src, dst = re.search(r"(\w+)>(\w+)\?$", text).groups()
        assert len(facts) == 2 * depth
        assert _reachable(facts, src, dst) == (ans == "Y"), text


@pytest.mark.parametrize("task", [t for t in TASKS if t not in (*NODE_TASKS, TWOHOP)])
def test_batches_are_balanced_deterministic_and_supervised_once(task: str) -> None:
    a = make_batch(task, 64, (1, 3), seed=5)
    b = make_batch(task, 64, (1, 3), seed=5)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.input_ids, make_batch(task, 64, (1, 3), seed=6).input_ids)
    answers = a.targets[a.targets != -100]
    assert answers.numel() == 64  # one supervised answer per row (no packing)
    assert (answers == answers[0]).float().mean() == 0.5  # balanced labels
    assert set(a.difficulty[a.difficulty > 0].tolist()) <= {1, 2, 3}


def test_too_long_examples_and_bad_ranges_are_clear_errors() -> None:
    with pytest.raises(LoopLMError, match="longer than the context"):
        make_batch("relational_text", 2, (10, 10), seed=0, max_len=128)
    with pytest.raises(LoopLMError, match="1 <= lo <= hi"):
        make_batch("graph_reach", 2, (3, 1), seed=0)
    with pytest.raises(LoopLMError, match="unknown synthetic task"):
        make_batch("nope", 2, (1, 1), seed=0)


@pytest.mark.parametrize("task", NODE_TASKS)
def test_node_task_batches_are_balanced_deterministic_and_carry_distances(task: str) -> None:
    a = make_batch(task, 32, (1, 4), seed=5)
    b = make_batch(task, 32, (1, 4), seed=5)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    sup = a.targets != -100
    answers = a.targets[sup]
    assert (answers == ord("Y")).sum() == (answers == ord("N")).sum()  # balanced per example
    assert set(a.difficulty[sup].tolist()) <= {1, 2, 3, 4}
    reach = a.distance[sup][answers == ord("Y")]
    assert bool((reach >= 1).all()) and bool((a.distance[sup][answers == ord("N")] == -1).all())
    with pytest.raises(LoopLMError, match="one graph per row"):
        make_batch(task, 2, (1, 2), seed=0, seq_len=64)


def test_packed_rows_do_not_leak_answers_through_their_order() -> None:
    b = make_batch("bool_logic", 256, (1, 3), seed=2, seq_len=96)
    flips = same = 0
    for row in b.targets:
        ans = row[row != -100].tolist()
        flips += sum(a != c for a, c in zip(ans, ans[1:]))
        same += sum(a == c for a, c in zip(ans, ans[1:]))
    assert 0.4 < flips / (flips + same) < 0.6  # alternating answers would give 1.0
    answers = b.targets[b.targets != -100]
    assert 0.45 < (answers == ord("T")).float().mean() < 0.55
