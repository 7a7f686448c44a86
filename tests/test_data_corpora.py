"""Corpora: document rules, paper splits with scaled counts, local formats, errors, LAMBADA."""

from __future__ import annotations

import gzip
import json
import logging
import sys
import types

import pytest
from conftest import require_data

from looplm.data.corpora import (
    SplitCounts,
    available_splits,
    lambada_examples,
    load_documents,
    locate_target,
    locate_targets,
    resolve_split,
    split_last_word,
    wikitext_articles,
)
from looplm.data.tokenizers import get_tokenizer
from looplm.errors import LoopLMError

# ----------------------------------------------------------------------------- WikiText


@pytest.mark.parametrize(
    "name,split,n_articles",
    [
        ("wikitext-2", "train", 600),
        ("wikitext-2", "validation", 60),
        ("wikitext-2", "test", 60),
        ("wikitext-2-raw", "valid", 60),
    ],
)
def test_wikitext2_articles_match_published_counts_and_rejoin_to_file(name, split, n_articles):
    folder = require_data("wikitext-2")
    docs = list(load_documents(name, split, folder))
    assert len(docs) == n_articles  # WikiText-2 has 600 / 60 / 60 articles
    stem = {"validation": "valid", "valid": "valid"}.get(split, split)
    suffix = "raw" if name.endswith("raw") else "tokens"
    text = (folder / f"wiki.{stem}.{suffix}").read_text(encoding="utf-8")
    assert "".join(docs) == text  # nothing dropped or changed
    assert all(
        d.lstrip(" \n").startswith("= ") and not d.lstrip(" \n").startswith("= =") for d in docs
    )


def test_wikitext_article_rule_ignores_equation_lines():
    lines = [
        " \n",
        " = A = \n",
        " \n",
        " x \n",
        " = y = \n",
        " \n",
        " = = Sec = = \n",
        " \n",
        " \n",
        " = B = \n",
        " \n",
        " z \n",
    ]
    docs = list(wikitext_articles(lines))
    assert len(docs) == 2 and docs[1].startswith(" = B = ")
    assert "".join(docs) == "".join(lines)


def test_wikitext103_has_no_local_train_split():
    folder = require_data("wikitext-103")
    assert len(list(load_documents("wikitext-103", "test", folder))) == 60
    assert available_splits("wikitext-103", folder) == ["validation", "test"]
    with pytest.raises(LoopLMError, match="no wiki.train.tokens"):
        resolve_split("wikitext-103", "train", folder)
    with pytest.raises(LoopLMError, match="no wiki.valid.raw"):
        resolve_split("wikitext-103-raw", "validation", folder)


def test_name_and_split_errors_list_allowed_values(tmp_path):
    with pytest.raises(LoopLMError, match="unknown corpus 'wikitext2'; allowed: wikitext-2, "):
        resolve_split("wikitext2", "train")
    with pytest.raises(LoopLMError, match="unknown split 'dev2'.*allowed: train, validation, test"):
        resolve_split("wikitext-2", "dev2", tmp_path)
    with pytest.raises(LoopLMError, match="allowed: test"):
        resolve_split("lambada", "train", tmp_path)
    with pytest.raises(LoopLMError, match="does not exist"):
        resolve_split("wikitext-2", "test", tmp_path / "missing")
    with pytest.raises(LoopLMError, match="split counts apply only to"):
        resolve_split("wikitext-2", "test", tmp_path, counts=(1, 1, 1))
    with pytest.raises(LoopLMError, match="three integers"):
        SplitCounts.parse("1,2")
    with pytest.raises(LoopLMError, match=">= 1"):
        SplitCounts.parse("10,0,1")


# ----------------------------------------------------------------------------- OpenWebText / C4


def test_owt_sample_paper_split_with_scaled_counts():
    src = require_data("owt-sample", "openwebtext_sample.txt")
    everything = list(load_documents("text:" + str(src), "all"))
    assert len(everything) == 2121  # blank-line blocks of the 4,242-line sample
    counts = SplitCounts(1500, 300, 300)
    parts = {
        s: list(load_documents("openwebtext", s, src, counts=counts))
        for s in ("train", "validation", "test")
    }
    assert [len(parts[s]) for s in ("train", "validation", "test")] == [1500, 300, 300]
    assert parts["train"] + parts["validation"] + parts["test"] == everything[:2100]
    assert parts["train"][0].startswith("Port-au-Prince, Haiti (CNN) -- Earthquake victims")
    rule = resolve_split("openwebtext", "test", src, counts="1500,300,300").rule
    assert rule["slice"] == [1800, 2100] and rule["counts"] == [1500, 300, 300]


def test_owt_paper_counts_on_a_small_sample(caplog):
    src = require_data("owt-sample")
    with caplog.at_level(logging.WARNING, logger="looplm.data"):
        train = list(load_documents("openwebtext", "train", src))
    assert len(train) == 2121
    assert "only 2,121 of the 200,000 documents" in caplog.text
    with pytest.raises(LoopLMError, match="no documents left for this split"):
        list(load_documents("openwebtext", "validation", src))


def test_c4_sample_stream_split_and_split_named_files(tmp_path):
    src = require_data("c4-sample")
    docs = {
        s: list(load_documents("c4", s, src, counts=(800, 100, 100)))
        for s in ("train", "validation", "test")
    }
    assert [len(d) for d in docs.values()] == [800, 100, 100]
    assert docs["train"][0].startswith(
        "The woman who died after falling from a bridge over the A21"
    )
    assert not set(docs["validation"]) & set(docs["test"])
    # a C4-style folder: train files and validation files; validation/test are two slices of
    # the validation files
    rows = [json.loads(x) for x in gzip.open(next(src.glob("*.json.gz")), "rt")]
    layout = tmp_path / "c4"
    layout.mkdir()
    for fname, part in [
        ("c4-train.00000-of-00002.json.gz", rows[:300]),
        ("c4-train.00001-of-00002.json.gz", rows[300:600]),
        ("c4-validation.00000-of-00001.json.gz", rows[600:]),
    ]:
        with gzip.open(layout / fname, "wt", encoding="utf-8") as f:
            f.writelines(json.dumps(r) + "\n" for r in part)
    c = SplitCounts(500, 150, 200)
    train = list(load_documents("c4", "train", layout, counts=c))
    val = list(load_documents("c4", "validation", layout, counts=c))
    test = list(load_documents("c4", "test", layout, counts=c))
    assert train == [r["text"] for r in rows[:500]]
    assert val == [r["text"] for r in rows[600:750]]
    assert test == [r["text"] for r in rows[750:950]]


# ----------------------------------------------------------------------------- local text


def test_local_formats_and_folders(tmp_path):
    (tmp_path / "a.txt").write_text("para one\nstill one\n\n\npara two\n")
    (tmp_path / "b.jsonl").write_text('{"text": "j1"}\n\n{"text": "j2", "x": 1}\n')
    with gzip.open(tmp_path / "c.jsonl.gz", "wt", encoding="utf-8") as f:
        f.write('{"text": "g1"}\n')
    (tmp_path / "d.json").write_text('[{"text": "arr1"}, "arr2"]')
    (tmp_path / "notes.md").write_text("ignored: not a corpus format")
    assert list(load_documents(str(tmp_path / "a.txt"), "all")) == [
        "para one\nstill one",
        "para two",
    ]
    assert list(load_documents("text:" + str(tmp_path), "all")) == [
        "para one\nstill one",
        "para two",
        "j1",
        "j2",
        "g1",
        "arr1",
        "arr2",
    ]
    # no files named by split: the last documents are held out (5%, at least one each)
    assert available_splits("text:" + str(tmp_path)) == ["train", "validation", "test"]
    name = "text:" + str(tmp_path)
    assert list(load_documents(name, "train")) == [
        "para one\nstill one",
        "para two",
        "j1",
        "j2",
        "g1",
    ]
    assert list(load_documents(name, "valid")) == ["arr1"]
    assert list(load_documents(name, "test")) == ["arr2"]
    with pytest.raises(LoopLMError, match="has 2 document"):
        resolve_split(str(tmp_path / "a.txt"), "train")
    with pytest.raises(LoopLMError, match="unknown split"):
        resolve_split(name, "dev2")


def test_local_folder_with_split_named_files(tmp_path):
    for name, text in [
        ("train.txt", "t1\n\nt2\n"),
        ("valid.txt", "v1\n"),
        ("test.jsonl", '{"text": "x"}\n'),
    ]:
        (tmp_path / name).write_text(text)
    name = "text:" + str(tmp_path)
    assert available_splits(name) == ["train", "validation", "test"]
    assert list(load_documents(name, "train")) == ["t1", "t2"]
    assert list(load_documents(name, "valid")) == ["v1"]
    assert list(load_documents(name, "test")) == ["x"]


def test_local_errors_are_one_line(tmp_path):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "blank.txt").write_text("\n\n  \n")
    (tmp_path / "data.csv").write_text("a,b\n")
    (tmp_path / "nofield.jsonl").write_text('{"body": "x"}\n')
    (tmp_path / "bad.jsonl").write_text('{"text": \n')
    (tmp_path / "broken.jsonl.gz").write_bytes(b"\x1f\x8b\x08\x00garbage")
    (tmp_path / "sub").mkdir()
    cases = [
        ("text:" + str(tmp_path / "missing.txt"), "does not exist"),
        ("text:" + str(tmp_path / "empty.txt"), "empty file"),
        ("text:" + str(tmp_path / "blank.txt"), "no documents"),
        ("text:" + str(tmp_path / "data.csv"), "unknown format"),
        ("text:" + str(tmp_path / "nofield.jsonl"), "no string field 'text'"),
        ("text:" + str(tmp_path / "bad.jsonl"), "line 1 is not valid JSON"),
        ("text:" + str(tmp_path / "broken.jsonl.gz"), "could not read"),
        ("text:" + str(tmp_path / "sub"), "no .txt/"),
    ]
    for name, msg in cases:
        with pytest.raises(LoopLMError) as info:
            list(load_documents(name, "all"))
        assert msg in str(info.value), (name, str(info.value))
        assert "\n" not in str(info.value)


# ----------------------------------------------------------------------------- online path


def test_online_path_without_datasets_says_how_to_get_the_data(monkeypatch):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import fails like when not installed
    with pytest.raises(LoopLMError) as info:
        load_documents("wikitext-103", "train")
    msg = str(info.value)
    assert "'datasets' is not installed" in msg and "--source" in msg and "looplm[data]" in msg


def test_online_path_with_a_stand_in_datasets_module(monkeypatch):
    calls = []
    wiki_rows = [" = A = \n", "", " a1 \n", "", " = B = \n", "", " b1 \n"]
    owt_rows = [f"doc {i}" for i in range(20)]

    def load_dataset(dataset_id, config, split, streaming):
        calls.append((dataset_id, config, split, streaming))
        rows = wiki_rows if "wikitext" in dataset_id else owt_rows
        return iter({"text": r} for r in rows)

    monkeypatch.setitem(sys.modules, "datasets", types.SimpleNamespace(load_dataset=load_dataset))
    # a stand-in network too: the hub counts as reachable
    monkeypatch.setattr("looplm.data.corpora.hub_offline_reason", lambda timeout=3.0: None)
    docs = list(load_documents("wikitext-2-raw", "valid"))
    assert docs == [" = A = \n \n a1 \n \n", " = B = \n \n b1 \n"]
    assert calls[-1] == ("Salesforce/wikitext", "wikitext-2-raw-v1", "validation", False)
    assert list(load_documents("openwebtext", "test", counts=(10, 3, 4))) == [
        f"doc {i}" for i in range(13, 17)
    ]
    assert calls[-1] == ("Skylion007/openwebtext", None, "train", True)
    assert list(load_documents("c4", "test", counts=(10, 3, 4))) == [
        f"doc {i}" for i in range(3, 7)
    ]
    assert calls[-1] == ("allenai/c4", "en", "validation", True)


# ----------------------------------------------------------------------------- LAMBADA

LAMBADA_EXAMPLES = 5153


def test_split_last_word():
    assert split_last_word("a b  c") == ("a b", "c")
    assert split_last_word("ctx\n\nword") == ("ctx", "word")
    with pytest.raises(LoopLMError, match="no context"):
        split_last_word("alone")


def test_lambada_target_span_located_on_every_example():
    path = require_data("lambada", "lambada_test.jsonl")
    examples = lambada_examples(path)
    assert len(examples) == LAMBADA_EXAMPLES
    assert examples[0].text.startswith("In my palm is a clear stone")
    tok = get_tokenizer("gpt2")
    spans = locate_targets(examples, tok)
    n_in_text = 0
    for ex, span in zip(examples, spans):
        target_ids = tok.encode(" " + ex.target)
        assert span.ids[span.start : span.end] == target_ids
        assert span.end == len(span.ids) and span.start >= 1
        assert tok.decode(span.ids[: span.start]) == ex.context
        assert ex.text.startswith(ex.context) and ex.text.rstrip().endswith(ex.target)
        n_in_text += span.in_text
    # The span is found inside the tokenization of the whole passage every time: BPE never
    # merges the final " word" with what precedes it.
    assert n_in_text == LAMBADA_EXAMPLES
    normalized = [i for i, ex in enumerate(examples) if ex.text != ex.context + " " + ex.target]
    assert len(normalized) == 7  # last separator is a newline, not one space
    # SOURCE.md: 430,230 GPT-2 tokens over all texts, each encoded separately
    n_tokens = sum(len(sp.ids) for i, sp in enumerate(spans) if i not in normalized)
    n_tokens += sum(len(tok.encode(examples[i].text)) for i in normalized)
    assert n_tokens == 430_230
    assert locate_target(examples[0], tok) == spans[0]
    # the corpus view: one document per example
    docs = list(load_documents("lambada", "test", path.parent))
    assert docs == [ex.text for ex in examples]


def test_locate_target_falls_back_when_bpe_merges_across_the_space():
    from looplm.data.corpora import LambadaExample

    class Merging:  # a tokenizer whose full-text ids do not end with the target's ids
        def encode_batch(self, texts):
            return [[len(t)] for t in texts]

    ex = LambadaExample(text="ab cd", context="ab", target="cd")
    span = locate_target(ex, Merging())
    assert (span.ids, span.start, span.end, span.in_text) == ([2, 3], 1, 2, False)


def test_text_split_rule_is_contiguous_and_disjoint():
    from looplm.data.corpora import text_split_slices

    for n in (3, 10, 19, 20, 21, 400, 1001):
        sl = text_split_slices(n)
        tr, va, te = sl["train"], sl["validation"], sl["test"]
        assert tr[0] == 0 and tr[1] == va[0] and va[1] == te[0] and te[1] == n == sl["all"][1]
        k = va[1] - va[0]
        assert k == te[1] - te[0] == max(1, round(0.05 * n)) and tr[1] >= 1


def test_training_on_one_text_file_needs_no_split_settings(tmp_path, capsys):
    from looplm.cli import main

    text = "\n\n".join(
        f"Scene {i}. Enter a player, who speaks line {i} of the play." for i in range(60)
    )
    (tmp_path / "play.txt").write_text(text + "\n")
    corpus = f"text:{tmp_path / 'play.txt'}"
    cache = str(tmp_path / "cache")
    assert main(["data", "prepare", corpus, "--tokenizer", "bytes", "--out", cache]) == 0
    out = capsys.readouterr().out
    assert "train:" in out and "validation:" in out and "test:" in out
    assert "54 documents" in out and out.count(" 3 documents") == 2  # 5% of 60 held out twice
    args = [
        "train", "tiny_bool", f"data.dataset={corpus}", f"data.cache_dir={cache}",
        "model.d_model=32", "model.n_heads=2", "model.d_ff=64", "train.steps=2",
        "train.batch_size=2", f"out_dir={tmp_path / 'run'}", "--no-progress",
    ]  # fmt: skip
    assert main(args) == 0
    assert (tmp_path / "run" / "ckpt" / "state.json").is_file()
