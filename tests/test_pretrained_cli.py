"""Analyses on imported checkpoints through the command line: each fixture imported with a
small tokenizer of its own, then evaluated over depths (beyond the trained count too) and used
for generation with per-token halting over many prompts."""

from __future__ import annotations

import json
import random

import pytest
from pretrained_common import fixture

from looplm.cli import main

TRAINED = {"parcae": 8, "huginn": 32, "ouro": 4}


def _tokenizer(path) -> None:
    """A character tokenizer (ids < 98, inside every fixture's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<|endoftext|>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "<unk>": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    root = tmp_path_factory.mktemp("pretrained_cli")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while loops read text".split()
    docs = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(9)]
    (root / "corpus.txt").write_text("\n\n".join(docs))
    (root / "prompts.txt").write_text("the quick brown\nloops read\n")
    out = {}
    for family in TRAINED:
        import shutil

        src = root / f"src_{family}"
        shutil.copytree(fixture(family), src)
        _tokenizer(src / "tokenizer.json")
        assert main(["import", str(src), str(root / family)]) == 0
        out[family] = root / family
    return root, out


@pytest.mark.parametrize("family", list(TRAINED))
def test_pretrained_eval_over_depths_beyond_the_trained_count(imported, family, capsys):
    root, ckpt = imported
    T = TRAINED[family]
    capsys.readouterr()
    args = ["eval", str(ckpt[family]), "--depths", f"1,{T + 1}", "--max-tokens", "48"]
    assert main([*args, "--dataset", f"text:{root / 'corpus.txt'}"]) == 0
    rows = json.loads(capsys.readouterr().out)["results"]
    assert [r["depth"] for r in rows] == [1, T + 1]
    assert all(r["n_tokens"] == 48 and r["nll"] > 0 for r in rows)


@pytest.mark.parametrize("family", list(TRAINED))
def test_pretrained_generate_prompts_with_per_token_halting(imported, family, capsys):
    root, ckpt = imported
    rule = "gate" if family == "ouro" else "maxtoken"
    capsys.readouterr()
    code = main(["generate", str(ckpt[family]), "--prompts", str(root / "prompts.txt"),
                 "--max-new", "3", "--loops", "3", "--halt", rule, "--threshold", "0.5"])  # fmt: skip
    assert code == 0
    lines = [json.loads(x) for x in capsys.readouterr().out.splitlines() if x.startswith("{")]
    assert [x["index"] for x in lines] == [0, 1]
    assert all(x["new_tokens"] == 3 and 1 <= x["mean_loops"] <= 3 for x in lines)


def test_pretrained_kl_halting_with_a_coda_says_why_in_one_line(imported, capsys):
    _, ckpt = imported
    code = main(["generate", str(ckpt["parcae"]), "--prompt", "the", "--max-new", "2",
                 "--halt", "kl", "--threshold", "0.1"])  # fmt: skip
    err = capsys.readouterr().err.strip()
    assert code == 2 and "coda" in err and "\n" not in err
