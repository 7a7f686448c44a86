"""Fine-tuning from a checkpoint (``init=``): the architecture from the checkpoint and the run
from the config, contradictions as one-line errors, exact resume (full and LoRA), held-out loss
lowered by a few steps, LoRA merged ≡ adapter model, and adapters for another model refused."""

from __future__ import annotations

import dataclasses
import random
import shutil
from pathlib import Path

import pytest
import torch
from pretrained_common import fixture

from looplm.cli import main
from looplm.errors import LoopLMError
from looplm.model.checkpoint import load_checkpoint
from looplm.settings.config import LoraConfig
from looplm.training.finetune import init_model, load_adapter
from looplm.training.finetune import load_run_config as load_config
from looplm.training.loop import evaluate_loss, fit, setup

FAMILIES = ("parcae", "ouro", "huginn")


def char_tokenizer(path: Path) -> None:
    """A character tokenizer (ids < 98, inside every fixture's vocabulary)."""
    from tokenizers import Tokenizer, decoders, models

    vocab = {"<|endoftext|>": 0, **{chr(c): c - 31 for c in range(32, 127)}, "<unk>": 96}
    tok = Tokenizer(models.BPE(vocab=vocab, merges=[], unk_token="<unk>"))
    tok.decoder = decoders.Fuse()
    tok.save(str(path))


@pytest.fixture(scope="module")
def imported(tmp_path_factory):
    """Each family's fixture imported with a character tokenizer, and a small English-like text."""
    root = tmp_path_factory.mktemp("finetune")
    rng = random.Random(0)
    words = "the quick brown fox jumps over a lazy dog while loops read text".split()
    docs = [" ".join(rng.choice(words) for _ in range(40)) for _ in range(40)]
    (root / "corpus.txt").write_text("\n\n".join(docs))
    for family in FAMILIES:
        src = root / f"src_{family}"
        shutil.copytree(fixture(family), src)
        char_tokenizer(src / "tokenizer.json")
        assert main(["import", str(src), str(root / family)]) == 0
    return root


def _cfg(root: Path, family: str, out: str, *extra: str):
    return load_config(
        "finetune",
        [f"init={root / family}", f"data.dataset=text:{root / 'corpus.txt'}",
         f"out_dir={root / out}", "train.steps=4", "train.batch_size=4", "train.warmup=0",
         "train.lr=3e-3", "train.seq_len=32", "train.log_every=2", "train.eval_batches=4",
         *extra],
    )  # fmt: skip


def test_init_takes_the_architecture_tokenizer_recipe_and_depth(imported):
    cfg = _cfg(imported, "huginn", "a")
    model, _, meta = load_checkpoint(imported / "huginn")
    assert cfg.model.d_model == model.config.d_model and cfg.model.recurrence == "huginn"
    assert cfg.model.tokenizer == str((imported / "huginn" / "tokenizer.json").resolve())
    assert (cfg.train.recipe, cfg.train.depth_mean) == ("huginn", 32)  # the family's defaults
    assert _cfg(imported, "ouro", "a").train.recipe == "ouro"
    assert _cfg(imported, "parcae", "a", "train.recipe=looplm").train.recipe == "looplm"
    # a published folder (what `looplm import` reads) works as init too
    pub = load_config("finetune", [f"init={imported / 'src_parcae'}", "train.seq_len=32"])
    assert pub.model.recurrence == "parcae" and pub.train.depth_mean == 8


@pytest.mark.parametrize(
    ("setting", "named"),
    [("model.d_model=64", "model.d_model=64"), ("model.recurrence=scse", "model.recurrence"),
     ("model.vocab_size=50257", "model.vocab_size=50257"), ("model.preset=22m", "model.")],
)  # fmt: skip
def test_a_setting_that_contradicts_the_checkpoint_is_a_one_line_error(imported, setting, named):
    with pytest.raises(LoopLMError, match="contradicts the init checkpoint") as err:
        _cfg(imported, "parcae", "a", setting)
    assert named in str(err.value) and "\n" not in str(err.value)
    # settings of the run (not of the architecture) may differ
    assert _cfg(imported, "parcae", "a", "model.dropout=0.2").model.dropout == 0.2


def test_fine_tuning_lowers_held_out_loss(imported):
    cfg = _cfg(imported, "parcae", "lower", "train.steps=6")
    before = evaluate_loss(setup(cfg))["val_loss"]
    after = fit(cfg, progress=False, quiet=True)["val_loss"]
    assert after < before - 0.3, (before, after)


@pytest.mark.parametrize("lora", [0, 4])
def test_resume_is_exact(imported, lora):
    """4 steps at once ≡ 2 steps, then --resume for 2 more (full and LoRA)."""
    extra = (f"lora.rank={lora}",)
    whole = fit(_cfg(imported, "parcae", f"whole{lora}", *extra), progress=False, quiet=True)
    part = _cfg(imported, "parcae", f"part{lora}", *extra, "train.steps=4")
    first = dataclasses.replace(part, train=dataclasses.replace(part.train, max_wall_s=1e-9))
    assert fit(first, progress=False, quiet=True)["stopped"] == "max_wall_s"
    resumed = fit(part, resume=True, progress=False, quiet=True)
    assert resumed["loss"] == whole["loss"]
    a, _, _ = load_checkpoint(imported / f"whole{lora}" / "ckpt")
    b, _, _ = load_checkpoint(imported / f"part{lora}" / "ckpt")
    for (n, x), (_, y) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(x, y), n


def test_lora_merged_model_equals_the_adapter_model(imported):
    cfg = _cfg(imported, "huginn", "lora", "lora.rank=4", "lora.targets=all", "train.steps=3")
    fit(cfg, progress=False, quiet=True)
    merged, saved, _ = load_checkpoint(imported / "lora" / "ckpt")  # the plain, merged weights
    adapted = init_model(saved, torch.device("cpu"), adapter=imported / "lora/ckpt/adapter")
    frozen = [n for n, p in adapted.named_parameters() if not p.requires_grad]
    assert frozen and all("lora_" not in n for n in frozen)
    ids = torch.randint(1, 97, (2, 12))
    adapted.eval()
    with torch.no_grad():
        want = adapted(ids, loops=5)
        got = merged(ids, loops=5)
        plain = dataclasses.replace(saved, lora=LoraConfig())
        base = init_model(plain, torch.device("cpu")).eval()(ids, loops=5)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)
    assert (want - base).abs().max() > 1e-3  # the adapter changed the model
    # the merged result exports as a standalone Hugging Face folder with the same logits
    from transformers import AutoModelForCausalLM

    assert main(["export", str(imported / "lora" / "ckpt"), str(imported / "lora_hf"),
                 "--standalone", "--loops", "5"]) == 0  # fmt: skip
    hf = AutoModelForCausalLM.from_pretrained(imported / "lora_hf", trust_remote_code=True)
    with torch.no_grad():
        torch.testing.assert_close(hf.eval()(ids).logits, got.float(), rtol=1e-4, atol=1e-4)
    # the result fine-tunes further with its family's recipe and trained depth
    again = load_config("finetune", [f"init={imported / 'lora' / 'ckpt'}", "train.seq_len=32"])
    assert (again.train.recipe, again.train.depth_mean, again.lora.rank) == ("huginn", 32, 0)


def test_an_adapter_for_another_model_is_a_one_line_error(imported, tmp_path):
    cfg = _cfg(imported, "parcae", "lora_p", "lora.rank=2", "train.steps=1")
    fit(cfg, progress=False, quiet=True)
    other = _cfg(imported, "huginn", "x", "lora.rank=2")
    model = init_model(other, torch.device("cpu"))
    with pytest.raises(LoopLMError, match="made for another model") as err:
        load_adapter(model, imported / "lora_p/ckpt/adapter")
    assert "\n" not in str(err.value)
    wrong_rank = init_model(_cfg(imported, "parcae", "x", "lora.rank=3"), torch.device("cpu"))
    with pytest.raises(LoopLMError, match="does not fit this model"):
        load_adapter(wrong_rank, imported / "lora_p/ckpt/adapter")
    with pytest.raises(LoopLMError, match="no adapter_model.safetensors"):
        load_adapter(model, tmp_path)


# ------------------------------------------------------------------ prompt/completion pairs
def _pairs(path: Path, n: int = 60) -> Path:
    import json

    rng = random.Random(1)
    words = ["red", "blue", "green", "gold", "gray"]
    lines = []
    for _ in range(n):
        w = rng.choice(words)
        lines.append(json.dumps({"prompt": f"colour {w} ->", "completion": f" {w[::-1]}."}))
    path.write_text("\n".join(lines) + "\n")
    return path


def test_pairs_are_packed_with_the_loss_on_completions_only(imported, tmp_path):
    from looplm.data.pairs import pack_pairs
    from looplm.data.tokenizers import get_tokenizer
    from looplm.targets import IGNORE_INDEX

    tok = get_tokenizer(str(imported / "parcae" / "tokenizer.json"))
    x, y = pack_pairs([("ab", "cd"), ("e", "fg")], tok, 4)
    ids = {c: ord(c) - 31 for c in "abcdefg"}
    eot, ign = tok.eot_id, IGNORE_INDEX
    # stream: a b c d | e f g  → inputs a b c d e f g (each pair's end-of-text is only a target)
    assert x.tolist() == [
        [ids["a"], ids["b"], ids["c"], ids["d"]],
        [ids["e"], ids["f"], ids["g"], 0],
    ]
    assert y.tolist() == [[ign, ids["c"], ids["d"], eot], [ids["f"], ids["g"], eot, ign]]
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a", "completion": "b"}\n{"prompt": "a"}\n')
    with pytest.raises(LoopLMError, match=r"line 2 has no string field 'completion'") as err:
        setup(_cfg(imported, "parcae", "bad", f"data.dataset=pairs:{bad}"))
    assert "\n" not in str(err.value)


def test_fine_tuning_on_pairs_lowers_the_completion_loss(imported, tmp_path):
    data = _pairs(tmp_path / "pairs.jsonl")
    cfg = _cfg(imported, "parcae", "pairs", f"data.dataset=pairs:{data}", "train.steps=8")
    ts = setup(cfg)
    x, y = ts.source.global_batch(0, 4)
    from looplm.targets import IGNORE_INDEX

    assert (y != IGNORE_INDEX).float().mean() < 0.5  # the prompts carry no loss
    before = evaluate_loss(ts)["val_loss"]
    after = fit(cfg, progress=False, quiet=True)["val_loss"]
    assert after < before - 0.3, (before, after)


def test_ouro_gate_stage_through_train_changes_only_the_gate(imported):
    cfg = _cfg(imported, "ouro", "gate", "train.recipe=ouro_gate", "train.steps=2")
    assert cfg.train.depth_mean == 4  # Ouro's trained loop count
    fit(cfg, progress=False, quiet=True)
    before, _, _ = load_checkpoint(imported / "ouro")
    after, _, _ = load_checkpoint(imported / "gate" / "ckpt")
    a, b = before.float().state_dict(), after.state_dict()
    changed = sorted(n for n in a if not torch.equal(a[n], b[n]))
    assert changed == ["recurrence.exit_gate.bias", "recurrence.exit_gate.weight"]


def test_train_command_reports_depth_response_and_exit_gate_before_and_after(imported, capsys):
    import json

    args = ["train", "finetune", f"init={imported / 'ouro'}", "eval.depths=[1,4,8]",
            f"data.dataset=text:{imported / 'corpus.txt'}", f"out_dir={imported / 'cli'}",
            "train.steps=4", "train.batch_size=4", "train.warmup=0", "train.lr=3e-3",
            "train.seq_len=32", "train.eval_batches=4"]  # fmt: skip
    assert main([*args, "--no-progress"]) == 0
    assert "report:" in capsys.readouterr().out
    report = json.loads((imported / "cli" / "finetune_report.json").read_text())
    assert report["depths"] == [1, 4, 8]
    assert report["after"]["4"] < report["before"]["4"] - 0.3  # Ouro's recipe trains at T = 4
    for key in ("exit_before", "exit_after"):
        assert len(report[key]) == 4 and sum(report[key]) == pytest.approx(1.0)
    assert report["exit_before"] != report["exit_after"]  # the objective moved the gate


def test_the_memory_table_of_the_docs_is_what_finetune_memory_computes():
    """docs/finetune.md's table: parameters counted on the meta device from each published
    config, the training state of full and LoRA fine-tuning (looplm.training.finetune.finetune_memory)."""
    import re

    from pretrained_common import published

    from looplm.model.families import published_model_config
    from looplm.training.finetune import finetune_memory

    text = (Path(__file__).resolve().parents[1] / "docs" / "finetune.md").read_text()
    rows = re.findall(r"^\| (parcae|huginn|ouro|hrm_text) \| ([\w.-]+) \| (.+) \|$", text, re.M)
    assert len(rows) == 8
    for family, name, rest in rows:
        cfg = published(family, f"{name}.json")
        _, mc = published_model_config(cfg.get("config", cfg))
        m = finetune_memory(mc, rank=16)
        want = (f"{m['params'] / 1e6:,.1f}M | {m['full_gib']:.1f} | "
                f"{m['lora_params'] / 1e6:.2f}M | {m['lora_gib']:.1f}")  # fmt: skip
        assert rest == want, (family, name)
