"""Loading published checkpoints: bad input gives one line, the import is a normal looplm
checkpoint, dtypes are kept, memory stays near one copy of the weights, and grouped-query
attention (a block option no fixture exercises) equals attention with repeated heads."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from pretrained_common import fixture, load, logits_at
from safetensors.torch import load_file, save_file

import looplm
from looplm.cli import main
from looplm.errors import LoopLMError
from looplm.model.checkpoint import load_checkpoint


def _copy(family: str, tmp_path: Path) -> Path:
    dst = tmp_path / family
    shutil.copytree(fixture(family), dst, ignore=shutil.ignore_patterns("*.py", "published"))
    return dst


def _edit_config(folder: Path, **changes) -> None:
    cfg = json.loads((folder / "config.json").read_text())
    cfg.update(changes)
    (folder / "config.json").write_text(json.dumps(cfg))


def test_pretrained_unknown_architecture_is_one_line(tmp_path):
    src = _copy("ouro", tmp_path)
    _edit_config(src, architectures=["LlamaForCausalLM"], model_type="llama")
    with pytest.raises(
        LoopLMError, match="architecture 'LlamaForCausalLM' is not one looplm loads"
    ):
        looplm.from_pretrained(src)


def test_pretrained_missing_shard_is_named(tmp_path):
    src = _copy("huginn", tmp_path)
    (src / "model-00002-of-00002.safetensors").unlink()
    with pytest.raises(LoopLMError, match="shard model-00002-of-00002.safetensors .* is missing"):
        looplm.from_pretrained(src)


def test_pretrained_shape_that_does_not_match_the_config_is_named(tmp_path):
    src = _copy("ouro", tmp_path)
    _edit_config(src, intermediate_size=96)
    with pytest.raises(
        LoopLMError,
        match=r"mlp.gate_proj.weight has shape \[128, 64\], the config implies \[96, 64\]",
    ):
        looplm.from_pretrained(src)


def test_pretrained_unknown_config_key_is_named(tmp_path):
    src = _copy("parcae", tmp_path)
    _edit_config(src, use_mystery_gate=True)
    with pytest.raises(
        LoopLMError, match="config key 'use_mystery_gate' is not part of the parcae"
    ):
        looplm.from_pretrained(src)


def test_pretrained_unsupported_value_is_named(tmp_path):
    src = _copy("parcae", tmp_path)
    _edit_config(src, injection_type="linear")
    with pytest.raises(LoopLMError, match="injection_type='linear' is not supported"):
        looplm.from_pretrained(src)


def test_pretrained_extra_tensor_is_named(tmp_path):
    src = _copy("ouro", tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    tensors["model.mystery.weight"] = torch.zeros(3)
    save_file(tensors, str(src / "model.safetensors"))
    with pytest.raises(LoopLMError, match="'model.mystery.weight' is not part of the layout"):
        looplm.from_pretrained(src)


def test_pretrained_hub_id_offline_names_the_local_folder_form(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    monkeypatch.setenv("HF_HOME", str(tmp_path / "hf"))
    monkeypatch.chdir(tmp_path)
    assert main(["import", "SandyResearch/parcae-140m", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "no network" in err and "pass its local folder" in err
    assert not (tmp_path / "out").exists()


def test_pretrained_import_writes_a_normal_checkpoint_with_the_tokenizer(tmp_path, capsys):
    src = _copy("huginn", tmp_path)  # the fixture's own (character) tokenizer.json
    assert main(["import", str(src), str(tmp_path / "ckpt")]) == 0
    assert "imported" in capsys.readouterr().out
    model, cfg, meta = load_checkpoint(tmp_path / "ckpt")
    tok = (src / "tokenizer.json").read_text()
    assert (tmp_path / "ckpt" / "tokenizer.json").read_text() == tok
    assert meta["state"]["pretrained"]["family"] == "huginn"
    assert cfg.train.depth_max == 32 and 64 in cfg.eval.depths  # trained T, and beyond it
    ids = torch.randint(0, 128, (2, 7), generator=torch.Generator().manual_seed(0))
    assert torch.equal(model(ids, loops=5), load("huginn")(ids, loops=5))


def test_pretrained_bf16_stays_bf16_through_import_and_load(tmp_path):
    src = _copy("ouro", tmp_path)
    tensors = load_file(str(src / "model.safetensors"))
    save_file({k: v.bfloat16() for k, v in tensors.items()}, str(src / "model.safetensors"))
    model = looplm.from_pretrained(src)
    assert {p.dtype for p in model.parameters()} == {torch.bfloat16}
    assert looplm.from_pretrained(src, dtype="float32").tok_emb.weight.dtype == torch.float32
    looplm.import_pretrained(src, tmp_path / "ckpt")
    loaded, _, _ = load_checkpoint(tmp_path / "ckpt")
    assert {p.dtype for p in loaded.parameters()} == {torch.bfloat16}
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(0))
    assert torch.equal(loaded(ids, loops=2), model(ids, loops=2))


PEAK = """
import sys, torch, looplm
import looplm.model.families, looplm.model.families.base  # imports count before the load
looplm.from_pretrained(sys.argv[2])  # a first load warms every lazy import and allocator pool
def status(key):  # kB in /proc/self/status; VmHWM is this process's own peak (ru_maxrss is not:
    # it inherits the forking parent's)
    line = next(l for l in open('/proc/self/status') if l.startswith(key + ':'))
    return int(line.split()[1]) * 1024
before = status('VmRSS')
model = looplm.from_pretrained(sys.argv[1])
weights = sum(p.numel() * p.element_size() for p in model.parameters())
print(weights, status('VmHWM') - before)
"""


def test_pretrained_loading_peak_memory_is_near_one_copy_of_the_weights(tmp_path):
    """A 40 MB Ouro-layout checkpoint: peak resident memory of the load (above the process's
    resident set before it) ≤ 1.3 × the weights."""
    src = _copy("ouro", tmp_path)
    _edit_config(src, hidden_size=512, intermediate_size=1024, num_attention_heads=8,
                 num_key_value_heads=8, head_dim=64, num_hidden_layers=4, vocab_size=4096)  # fmt: skip
    cfg = json.loads((src / "config.json").read_text())
    from looplm.model.families import FAMILIES, build_meta, published_model_config

    fam, mc = published_model_config(cfg)
    names = set(load_file(str(fixture("ouro") / "model.safetensors")))
    plan = fam.weights(cfg, names, mc)  # the published names at the larger shape
    g = torch.Generator().manual_seed(0)
    shapes = {s: shape for w in plan.weights for s, shape in w.sources.items()}
    save_file({s: torch.randn(shape, generator=g) * 0.02 for s, shape in shapes.items()},
              str(src / "model.safetensors"))  # fmt: skip
    assert build_meta(mc).num_parameters() * 4 > 30e6 and FAMILIES["ouro"] is fam
    out = subprocess.run(
        [sys.executable, "-c", PEAK, str(src), str(fixture("ouro"))],
        capture_output=True,
        text=True,
        check=True,
    )
    weights, peak = map(int, out.stdout.split())
    assert peak <= 1.3 * weights, (peak / weights, weights)


def test_pretrained_grouped_query_attention_equals_repeated_heads():
    """n_kv_heads = 2 of 4 heads ≡ the same model with every key/value head repeated, in the
    plain, cached and active-row paths (the KV cache stores the 2 heads)."""
    from looplm.decoding.decoder import decode
    from looplm.model import build_model

    torch.manual_seed(0)
    kw = dict(d_model=64, n_heads=4, d_ff=128, dropout=0.0, positions="rope", core_layers=2,
              prelude_layers=1, norm_placement="sandwich", reference_rounding=True)  # fmt: skip
    gqa = build_model("tiny", "ouro", n_kv_heads=2, **kw).eval()
    mha = build_model("tiny", "ouro", **kw).eval()
    sd = gqa.state_dict()
    for name, w in sd.items():
        if name.endswith("attn.qkv.weight"):  # rows [q (64); k (32); v (32)], heads of 16
            q, k, v = w.split([64, 32, 32])
            rep = lambda z: z.view(2, 16, 64).repeat_interleave(2, 0).reshape(64, 64)  # noqa: E731
            sd[name] = torch.cat([q, rep(k), rep(v)])
    mha.load_state_dict(sd)
    ids = torch.randint(0, 257, (2, 9), generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(gqa(ids, loops=3), mha(ids, loops=3), rtol=1e-5, atol=1e-5)
    a = decode(gqa, ids, 5, loops=3, halt="maxtoken", threshold=0.05).tokens
    assert torch.equal(a, decode(mha, ids, 5, loops=3, halt="maxtoken", threshold=0.05).tokens)
    state = logits_at(gqa, ids, 2)
    assert state.shape == (2, 9, 257)
