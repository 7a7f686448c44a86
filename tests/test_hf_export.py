"""`looplm export` round-trips through `transformers` (AutoModelForCausalLM, trust_remote_code)."""

from __future__ import annotations

import json

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'looplm[hf]' or '.[test]')"
)

from conftest import HF_VARIANTS, tiny_checkpoint  # noqa: E402
from transformers import AutoModelForCausalLM  # noqa: E402

from looplm.decoding.decoder import generate  # noqa: E402
from looplm.decoding.hf import export_checkpoint  # noqa: E402


def _checkpoint(tmp_path, recurrence: str = "scse", *overrides: str):
    return tiny_checkpoint(tmp_path / "ck", recurrence, *overrides)


def _load(path):
    return AutoModelForCausalLM.from_pretrained(str(path), trust_remote_code=True).eval()


@pytest.mark.parametrize("variant", sorted(HF_VARIANTS))
def test_exported_model_has_looplm_logits_and_greedy_tokens(tmp_path, variant: str) -> None:
    recurrence, *extra = HF_VARIANTS[variant]
    ck, model = _checkpoint(tmp_path, recurrence, *extra)
    out = export_checkpoint(ck, tmp_path / "hf", loops=4)
    config = json.loads((out / "config.json").read_text())
    assert config["loops"] == 4 and config["looplm_model"]["recurrence"] == recurrence
    hf = _load(out)
    assert hf.config.loops == 4
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(hf(ids).logits, model(ids, loops=4))  # config value
        torch.testing.assert_close(hf(ids, loops=7).logits, model(ids, loops=7))  # call time
    for use_cache in (True, False):
        got = hf.generate(
            ids, max_new_tokens=12, do_sample=False, loops=3, use_cache=use_cache, eos_token_id=None
        )
        assert torch.equal(got, generate(model, ids, 12, loops=3)), use_cache


def test_exported_generation_slides_past_the_context(tmp_path) -> None:
    ck, model = _checkpoint(tmp_path, "scse", "model.context=16")
    hf = _load(export_checkpoint(ck, tmp_path / "hf", loops=3))
    ids = torch.randint(0, 256, (1, 6), generator=torch.Generator().manual_seed(1))
    want = generate(model, ids, 30, loops=3)  # 36 tokens > context 16
    for use_cache in (True, False):
        got = hf.generate(
            ids, max_new_tokens=30, do_sample=False, use_cache=use_cache, eos_token_id=None
        )
        assert torch.equal(got, want), use_cache


def test_exported_loss_matches_looplm(tmp_path) -> None:
    ck, model = _checkpoint(tmp_path)
    hf = _load(export_checkpoint(ck, tmp_path / "hf"))
    assert hf.config.loops == 8  # default: the training ceiling train.depth_max
    ids = torch.randint(0, 256, (2, 12), generator=torch.Generator().manual_seed(2))
    with torch.no_grad():
        want = model.loss(ids[:, :-1], ids[:, 1:], loops=8)
        torch.testing.assert_close(hf(ids, labels=ids).loss, want)


def test_cli_export(tmp_path, capsys) -> None:
    from looplm.cli import main

    ck, _ = _checkpoint(tmp_path)
    out = tmp_path / "hf"
    assert main(["export", str(ck), str(out), "--loops", "5"]) == 0
    names = {p.name for p in out.iterdir()}
    assert {"config.json", "model.safetensors", "modeling_looplm.py"} <= names
    assert main(["export", str(ck), str(out)]) == 2  # exists
    assert main(["export", str(ck), str(out), "--overwrite", "--loops", "0"]) == 2
    assert main(["export", str(ck), str(out), "--overwrite"]) == 0
    assert json.loads((out / "config.json").read_text())["loops"] == 8
