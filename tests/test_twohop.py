"""The two-hop knowledge task: deterministic generation, answers checked by an independent solver
that reads the knowledge base back from the training text alone."""

from __future__ import annotations

import pytest
import torch

from looplm.data.sources import TaskSource
from looplm.data.synthetic import PAD_ID, make_batch
from looplm.data.twohop import knowledge_base
from looplm.errors import LoopLMError
from looplm.settings.config import DataConfig, ModelConfig

ARGS = {"n_entities": 12, "n_relations": 3, "holdout": 0.25, "kb_seed": 7}


def _examples(batch) -> list[tuple[str, str]]:
    """(prompt, answer) pairs of a batch, read from its token ids and targets only."""
    out = []
    for ids, tgt in zip(batch.input_ids.tolist(), batch.targets.tolist()):
        text = bytes(c for c in ids if c != PAD_ID).decode()
        start = 0
        for i, t in enumerate(tgt):
            if t != -100:
                out.append((text[start : i + 1], chr(t)))
                assert text[i + 1] == chr(t)  # the answer follows the '='
                start = i + 3  # skip the answer and ';'
    return out


def _solver(facts: list[tuple[str, str]]) -> dict[tuple[str, str], str]:
    """The one-hop table as the training text states it ('A1=' → 'Q'), checked consistent."""
    table: dict[tuple[str, str], str] = {}
    for prompt, ans in facts:
        assert len(prompt) == 3 and prompt[2] == "="
        key = (prompt[0], prompt[1])
        assert table.setdefault(key, ans) == ans  # a relation is a function
    return table


def test_one_hop_text_states_every_fact_and_two_hop_answers_compose_them() -> None:
    facts = _examples(make_batch("twohop", 600, (1, 1), seed=1, task_args=ARGS))
    table = _solver(facts)
    ents, rels = {e for e, _ in table}, {r for _, r in table}
    assert len(table) == 12 * 3 and ents == set("ABCDEFGHIJKL") and rels == set("012")
    assert all(table[k] != k[0] for k in table)  # no fact maps an entity to itself
    for split in ("train", "heldout"):
        queries = _examples(make_batch("twohop", 300, (2, 2), seed=2, task_args=ARGS, split=split))
        assert len(queries) == 300
        for prompt, ans in queries:
            e, r1, r2, eq = prompt
            bridge = table[(e, r1)]
            assert eq == "=" and bridge not in prompt  # the bridge is never in the prompt
            assert ans == table[(bridge, r2)], prompt


def test_held_out_compositions_are_never_trained_and_splits_partition_the_triples() -> None:
    held = {p for p, _ in _examples(
        make_batch("twohop", 2000, (2, 2), seed=3, task_args=ARGS, split="heldout")
    )}  # fmt: skip
    train = {p for p, _ in _examples(make_batch("twohop", 4000, (1, 2), seed=4, task_args=ARGS))}
    two_hop_train = {p for p in train if len(p) == 4}
    assert held and two_hop_train and not held & two_hop_train
    assert len(held) == round(0.25 * 12 * 3 * 3)  # every held-out triple was drawn
    assert len(held) + len(two_hop_train) == 12 * 3 * 3  # together: every composition


def test_generation_is_deterministic_and_the_knowledge_base_depends_on_kb_seed_only() -> None:
    a = make_batch("twohop", 64, (1, 2), seed=5, task_args=ARGS, seq_len=40)
    b = make_batch("twohop", 64, (1, 2), seed=5, task_args=ARGS, seq_len=40)
    assert torch.equal(a.input_ids, b.input_ids) and torch.equal(a.targets, b.targets)
    assert not torch.equal(a.input_ids, make_batch("twohop", 64, (1, 2), seed=6,
                                                    task_args=ARGS, seq_len=40).input_ids)  # fmt: skip
    assert knowledge_base(ARGS) == knowledge_base(dict(ARGS))
    other = knowledge_base({**ARGS, "kb_seed": 8})
    assert other.table != knowledge_base(ARGS).table
    assert set(a.difficulty[a.targets != -100].tolist()) == {1, 2}


def test_training_source_uses_the_runs_knowledge_base() -> None:
    data = DataConfig(
        dataset="twohop", train_difficulty=[1, 1], eval_difficulty=[1, 1], task_args=dict(ARGS)
    )
    src = TaskSource(data, ModelConfig(context=16), seed=0)
    x, y = src.global_batch(0, 200)
    got = _solver(_examples(type("B", (), {"input_ids": x, "targets": y})()))
    (xe, ye), *_ = src.eval_batches(200, n_examples=200)  # evaluation reads the same base
    got.update(_solver(_examples(type("B", (), {"input_ids": xe, "targets": ye})())))
    kb = knowledge_base(ARGS)
    assert set(e for e, _ in got) <= set(kb.entities)  # 12 entities, not the default 32
    for (e, r), ans in got.items():
        assert ans == kb.entities[kb.hop(kb.entities.index(e), int(r))]


def test_bad_settings_are_one_line_errors() -> None:
    with pytest.raises(LoopLMError, match="twohop difficulty range"):
        make_batch("twohop", 2, (1, 3), seed=0)
    with pytest.raises(LoopLMError, match="n_entities=99"):
        make_batch("twohop", 2, (1, 1), seed=0, task_args={"n_entities": 99})
    with pytest.raises(LoopLMError, match="holdout=1.5"):
        knowledge_base({"holdout": 1.5})
    with pytest.raises(LoopLMError, match="twohop split 'test'"):
        make_batch("twohop", 2, (2, 2), seed=0, split="test")
    data = DataConfig(dataset="twohop", task_args={"n_entity": 3})
    with pytest.raises(LoopLMError, match="n_entity.*allowed: holdout, kb_seed"):
        TaskSource(data, ModelConfig(context=16), seed=0)
