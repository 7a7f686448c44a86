"""`looplm export --standalone`: the folder loads in a Python that cannot import looplm, with
looplm's logits and greedy tokens, and AutoTokenizer gives looplm's token ids."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "transformers", reason="transformers is not installed (pip install 'looplm[hf]' or '.[test]')"
)

from conftest import HF_VARIANTS, tiny_checkpoint  # noqa: E402

from looplm.data import get_tokenizer  # noqa: E402
from looplm.decoding.decoder import generate  # noqa: E402
from looplm.decoding.hf import export_checkpoint, write_tokenizer  # noqa: E402
from looplm.decoding.hf.standalone import standalone_source  # noqa: E402
from looplm.model import recurrence_names  # noqa: E402

VARIANTS = {k: v for k, v in HF_VARIANTS.items() if k != "step_conditioned"}
TEXTS = ["Hello world", "  caf\u00e9 \u2014 na\u00efve \U0001f600<|endoftext|>x\n\tend", ""]

# Runs in a fresh interpreter (-I: no PYTHONPATH, no user site) with every path that holds a
# looplm package removed and an import hook refusing looplm (an editable install adds a finder).
CHILD = textwrap.dedent(
    """
    import importlib.abc, importlib.util, json, os, sys
    from pathlib import Path

    sys.path = [p for p in sys.path if not (Path(p or ".") / "looplm").exists()]

    class NoLoopLM(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name == "looplm" or name.startswith("looplm."):
                raise ModuleNotFoundError(f"No module named {name!r} (hidden)")
            return None

    sys.meta_path.insert(0, NoLoopLM())
    try:
        import looplm  # noqa: F401
        raise SystemExit("looplm is importable in the child")
    except ModuleNotFoundError:
        pass
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    job = json.loads(Path(sys.argv[1]).read_text())
    out = {"tokens": {}, "recurrences": None}
    for name, folder in job["models"].items():
        model = AutoModelForCausalLM.from_pretrained(folder, trust_remote_code=True).eval()
        ids = torch.tensor(job["ids"])
        with torch.no_grad():
            res = {
                "logits_default": model(ids).logits,
                "logits_7": model(ids, loops=7).logits,
                "greedy_cached": model.generate(
                    ids, max_new_tokens=12, do_sample=False, loops=3, eos_token_id=None
                ),
                "greedy_uncached": model.generate(
                    ids, max_new_tokens=12, do_sample=False, loops=3, use_cache=False,
                    eos_token_id=None,
                ),
            }
        torch.save(res, Path(job["out"]) / f"{name}.pt")
        mod = sys.modules[type(model).__module__]
        out["recurrences"] = mod.recurrence_names()
        out["looplm_modules"] = sorted(m for m in sys.modules if m.split(".")[0] == "looplm")
    for name, folder in job["tokenizers"].items():
        tok = AutoTokenizer.from_pretrained(folder)
        out["tokens"][name] = {
            "ids": [tok(t)["input_ids"] for t in job["texts"]],
            "decoded": [tok.decode(tok(t)["input_ids"]) for t in job["texts"]],
            "eos": tok.eos_token_id,
        }
    (Path(job["out"]) / "result.json").write_text(json.dumps(out))
    """
)


def _checkpoint(tmp_path, name: str):
    return tiny_checkpoint(tmp_path / f"ck_{name}", *VARIANTS[name])


def test_standalone_folder_loads_without_looplm(tmp_path) -> None:
    ids = torch.randint(0, 256, (2, 11), generator=torch.Generator().manual_seed(0))
    models, want = {}, {}
    for name in VARIANTS:
        ck, model = _checkpoint(tmp_path, name)
        folder = export_checkpoint(ck, tmp_path / f"hf_{name}", loops=4, standalone=True)
        models[name] = str(folder)
        with torch.no_grad():
            want[name] = {
                "logits_default": model(ids, loops=4),
                "logits_7": model(ids, loops=7),
                "greedy": generate(model, ids, 12, loops=3),
            }
    gpt2 = tmp_path / "gpt2_tokenizer"
    gpt2.mkdir()
    write_tokenizer(gpt2, "gpt2", 128)
    job = {
        "models": models,
        "tokenizers": {"bytes": models["scse"], "gpt2": str(gpt2)},
        "ids": ids.tolist(),
        "texts": TEXTS,
        "out": str(tmp_path),
    }
    (tmp_path / "job.json").write_text(json.dumps(job))
    (tmp_path / "child.py").write_text(CHILD)
    env = {k: v for k, v in os.environ.items() if not k.startswith(("PYTHON", "LOOPLM"))}
    env.update(HF_HOME=str(tmp_path / "hf_home"), HF_HUB_OFFLINE="1", TRANSFORMERS_OFFLINE="1")
    run = subprocess.run(
        [sys.executable, "-I", str(tmp_path / "child.py"), str(tmp_path / "job.json")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert run.returncode == 0, run.stderr[-3000:]
    result = json.loads((tmp_path / "result.json").read_text())
    assert result["looplm_modules"] == []
    assert result["recurrences"] == recurrence_names()  # every method registers in the bundle
    for name in VARIANTS:
        got = torch.load(tmp_path / f"{name}.pt")
        torch.testing.assert_close(got["logits_default"], want[name]["logits_default"])
        torch.testing.assert_close(got["logits_7"], want[name]["logits_7"])
        assert torch.equal(got["greedy_cached"], want[name]["greedy"]), name
        assert torch.equal(got["greedy_uncached"], want[name]["greedy"]), name
    for name in ("bytes", "gpt2"):
        tok = get_tokenizer(name)
        got = result["tokens"][name]
        assert got["ids"] == [tok.encode(t) for t in TEXTS], name
        assert got["decoded"] == [tok.decode(tok.encode(t)) for t in TEXTS], name
        assert got["eos"] == tok.eot_id


def test_standalone_source_imports_nothing_from_looplm() -> None:
    tree = ast.parse(standalone_source("0.0-test"))
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            assert node.level or not (node.module or "").startswith("looplm"), ast.unparse(node)
            if node.level:  # only the configuration file next to it
                assert node.module == "configuration_looplm", ast.unparse(node)
        elif isinstance(node, ast.Import):
            assert not any(a.name.split(".")[0] == "looplm" for a in node.names)
    names = {n.name for n in tree.body if isinstance(n, (ast.ClassDef, ast.FunctionDef))}
    assert {"LoopLMForCausalLM", "LoopedLM", "Block", "SCSE", "model_from_config"} <= names


def test_the_docs_state_the_standalone_size() -> None:
    """docs/generation.md's "about N lines" is within 15% of what --standalone writes."""
    import re

    text = (Path(__file__).resolve().parents[1] / "docs" / "generation.md").read_text()
    stated = int(re.search(r"about ([\d,]+) lines", text).group(1).replace(",", ""))
    actual = len(standalone_source("0.0-test").splitlines())
    assert abs(actual - stated) <= 0.15 * stated, (stated, actual)


def test_plain_export_writes_the_tokenizer_and_keeps_the_wrapper(tmp_path) -> None:
    ck, _ = _checkpoint(tmp_path, "scse")
    out = export_checkpoint(ck, tmp_path / "hf", loops=4)
    names = {p.name for p in out.iterdir()}
    assert {"tokenizer.json", "tokenizer_config.json", "modeling_looplm.py"} <= names
    code = (out / "modeling_looplm.py").read_text()
    assert "from looplm.model import model_from_config" in code  # the thin wrapper


def test_cli_export_standalone(tmp_path) -> None:
    from looplm.cli import main

    ck, _ = _checkpoint(tmp_path, "scse")
    assert main(["export", str(ck), str(tmp_path / "hf"), "--standalone"]) == 0
    code = (tmp_path / "hf" / "modeling_looplm.py").read_text()
    assert "looplm export --standalone" in code and "class LoopedLM" in code
