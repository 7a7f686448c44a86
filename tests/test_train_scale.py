"""Training at scale, on the CPU: fault handling, truncated backprop, activation checkpointing,
memory that stays flat in T, the chunked vocabulary loss and the FLOP/MFU accounting."""

from __future__ import annotations

import contextlib
import copy
import json
import math
import os
import signal
import subprocess
import sys
import time
import weakref
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from looplm.errors import LoopLMError
from looplm.model import build_model
from looplm.model.checkpoint import load_checkpoint
from looplm.settings.config import load_config
from looplm.training.loop import (
    fit,
    host_metrics,
    setup,
    sync_free_step,
    train_flops,
    train_step,
)

REPO = Path(__file__).resolve().parents[1]


def _cfg(out: Path, *extra: str):
    return load_config(
        "tiny_bool",
        [
            "train.steps=6",
            "train.batch_size=8",
            "train.warmup=2",
            "train.log_every=1",
            "train.depth_max=3",
            "eval.n_examples=16",
            "model.d_model=32",
            "model.n_heads=2",
            "model.d_ff=64",
            "model.dropout=0.0",
            f"out_dir={out}",
            *extra,
        ],
    )


def _tiny(recurrence: str = "scse", dropout: float = 0.0):
    torch.manual_seed(0)
    return build_model("tiny", recurrence, d_model=32, n_heads=2, d_ff=64, dropout=dropout)


def _batch(vocab: int = 257, B: int = 3, L: int = 16, seed: int = 1):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, L), generator=g)
    y = torch.randint(0, vocab, (B, L), generator=g)
    y[0, :3] = -100
    return x, y


def _grads(model) -> dict[str, torch.Tensor]:
    return {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


# ----------------------------------------------------------------------------- fault handling
def _snapshot(ts):
    params = {n: p.detach().clone() for n, p in ts.raw_model.named_parameters()}
    return params, copy.deepcopy(ts.optimizer.state_dict())


def _same_state(a, b) -> bool:
    (pa, oa), (pb, ob) = a, b
    if any(not torch.equal(pa[k], pb[k]) for k in pa):
        return False
    for pid, st in oa["state"].items():
        for k, v in st.items():
            w = ob["state"][pid][k]
            if torch.is_tensor(v) and not torch.equal(v, w):
                return False
    return True


@pytest.mark.parametrize("mode", ["skip", "stop"])
def test_nonfinite_guard_leaves_weights_and_optimizer_state_untouched(
    mode: str, tmp_path: Path
) -> None:
    ts = setup(_cfg(tmp_path, f"train.nonfinite={mode}"))
    for _ in range(2):  # so AdamW has moments and a step count to protect
        assert not train_step(ts)["skipped"]
    before = _snapshot(ts)
    # Poison one step: the shared block returns NaN, so the loss and every gradient are NaN.
    handle = ts.raw_model.block.register_forward_hook(lambda m, i, out: out * float("nan"))
    if mode == "stop":  # stop reads the host each step, to raise before the next one
        assert not sync_free_step(ts)
        with pytest.raises(LoopLMError, match="non-finite loss/gradient at step 2"):
            train_step(ts)
        assert all(p.grad is None for p in ts.raw_model.parameters())
    else:  # skip is decided on the device: fused AdamW's found_inf, no host read
        with _host_reads() as reads:
            m = train_step(ts)
        assert reads == []
        m = host_metrics(m)
        assert m["skipped"] is True and not math.isfinite(m["loss"])
    handle.remove()
    assert _same_state(before, _snapshot(ts)), "a poisoned step changed weights or AdamW state"
    if mode == "skip":  # training goes on normally afterwards
        m = host_metrics(train_step(ts))
        assert m["skipped"] is False and math.isfinite(m["loss"])
        assert not _same_state(before, _snapshot(ts))


@contextlib.contextmanager
def _host_reads():
    """Records each read of a float or bool tensor's value into Python (what waits for a GPU).
    Integer tensors are left out: on a CPU they cannot be told from the host-side batches, whose
    token ids and counts a step reads on purpose."""
    reads: list[str] = []
    names = ["item", "tolist", "numpy", "__float__", "__bool__", "__int__", "__index__"]
    real = {n: getattr(torch.Tensor, n) for n in names}

    def counting(name):
        def read(t, *a, **k):
            if t.dtype.is_floating_point or t.dtype == torch.bool:
                reads.append(name)
            return real[name](t, *a, **k)

        return read

    try:
        for n in names:
            setattr(torch.Tensor, n, counting(n))
        yield reads
    finally:
        for n in names:
            setattr(torch.Tensor, n, real[n])


def test_a_fused_single_process_step_reads_nothing_on_the_host(tmp_path: Path) -> None:
    ts = setup(_cfg(tmp_path, "train.grad_accum=2"))
    assert sync_free_step(ts)  # the default: fused AdamW, one process, nonfinite=skip
    with _host_reads() as reads:
        ms = [train_step(ts) for _ in range(3)]
    assert reads == [], reads
    assert all(isinstance(m["loss"], torch.Tensor) for m in ms)
    ms = [host_metrics(m) for m in ms]
    assert all(isinstance(m["loss"], float) and m["skipped"] is False for m in ms)
    assert ms[-1]["loss"] < ms[0]["loss"] + 1.0 and ms[-1]["grad_norm"] > 0


def test_fit_reads_the_host_only_at_logged_steps(tmp_path: Path) -> None:
    at: dict[int, int] = {}
    cfg = _cfg(tmp_path, "train.log_every=3", "train.eval_every=0", "train.ckpt_every=0")
    with _host_reads() as reads:
        fit(
            cfg,
            progress=False,
            quiet=True,
            callbacks=[lambda ts, m: at.update({ts.step: len(reads)})],
        )
    assert [at[k] - at[k - 1] for k in (2, 4, 5)] == [0, 0, 0]  # the steps between logged ones
    assert at[3] > at[2]  # a logged step reads its loss, grad norm and skipped flag


def test_metrics_jsonl_rows_equal_the_host_read_step(tmp_path: Path) -> None:
    # nonfinite=stop takes the host-read step (floats computed on the host, as before): the same
    # run with the sync-free default must write the same numbers, rows only at logged steps.
    fit(_cfg(tmp_path / "run", "train.log_every=2", "train.eval_every=0"), progress=False)
    rows = [json.loads(x) for x in (tmp_path / "run" / "metrics.jsonl").read_text().splitlines()]
    ts = setup(_cfg(tmp_path / "ref", "train.nonfinite=stop"))
    ref = [train_step(ts) for _ in range(6)]
    assert [r["step"] for r in rows[:-1]] == [2, 4, 6] and "val_loss" in rows[-1]
    for row in rows[:-1]:
        want = ref[row["step"] - 1]
        assert list(row)[: len(want)] == list(want)
        assert {k: row[k] for k in want} == want
        assert type(row["loss"]) is float and row["skipped"] is False


def test_sigterm_writes_checkpoint_and_resume_continues_exactly(tmp_path: Path) -> None:
    # A constant learning rate, so a resumed run's shorter train.steps leaves the schedule alone;
    # dropout on, so the restored RNG state matters.
    over = [
        "train.warmup=0",
        "train.min_lr_ratio=1.0",
        "train.log_every=1",
        "model.dropout=0.1",
        "model.d_model=32",
        "model.n_heads=2",
        "model.d_ff=64",
        "train.batch_size=8",
        "train.depth_max=3",
        "eval.n_examples=16",
    ]
    run_a = tmp_path / "a"
    env = {**os.environ, "LOOPLM_NO_PROGRESS": "1", "OMP_NUM_THREADS": "1"}
    env["PYTHONPATH"] = os.pathsep.join([str(REPO), env.get("PYTHONPATH", "")])
    cmd = [sys.executable, "-m", "looplm", "train", "tiny_bool", *over, "train.steps=100000"]
    proc = subprocess.Popen(
        [*cmd, f"out_dir={run_a}"], cwd=REPO, env=env, stderr=subprocess.PIPE, text=True
    )
    metrics = run_a / "metrics.jsonl"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if metrics.exists() and len(metrics.read_text().splitlines()) >= 3:
            break
        time.sleep(0.05)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=120)
    assert proc.returncode == 128 + signal.SIGTERM, err[-2000:]
    _, _, meta = load_checkpoint(run_a / "ckpt")
    k = meta["state"]["step"]
    assert k >= 3 and f"checkpoint written at step {k}" in err
    assert len(metrics.read_text().splitlines()) == k

    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # the same intra-op threading as the subprocess
    try:
        resumed = fit(
            load_config("tiny_bool", [*over, f"train.steps={k + 3}", f"out_dir={run_a}"]),
            resume=True,
            progress=False,
        )
        run_b = tmp_path / "b"
        ref = fit(
            load_config("tiny_bool", [*over, f"train.steps={k + 3}", f"out_dir={run_b}"]),
            progress=False,
        )
    finally:
        torch.set_num_threads(threads)
    a, _, _ = load_checkpoint(run_a / "ckpt")
    b, _, _ = load_checkpoint(run_b / "ckpt")
    for (n, p), (_, q) in zip(a.state_dict().items(), b.state_dict().items()):
        assert torch.equal(p, q), n
    assert resumed["loss"] == ref["loss"]
    lines = [json.loads(x) for x in (run_b / "metrics.jsonl").read_text().splitlines()]
    assert [x["step"] for x in lines[:-1]] == list(range(1, k + 4))
    assert lines[0]["tok_per_s"] > 0 and lines[0]["peak_rss_mb"] > 0 and "mfu" not in lines[0]


# ----------------------------------------------------------------------------- backprop variants
@pytest.mark.parametrize("recurrence", ["scse", "looped"])
def test_truncated_backprop_matches_manual_last_k_loops(recurrence: str) -> None:
    T, k = 6, 2
    x, y = _batch()
    model = _tiny(recurrence)
    model.loss(x, y, loops=T, truncate_k=k).backward()
    got = _grads(model)

    model.zero_grad(set_to_none=True)
    rec, block = model.recurrence, model.block
    ctx = model.prepare(x)
    s = rec.init_state(ctx)
    with torch.no_grad():  # loops 0 … T−k−1 carry no gradient
        for t in range(T - k):
            s = rec.step(block, s, ctx, t)
    for t in range(T - k, T):
        s = rec.step(block, s, ctx, t)
    logits = model.readout(rec.to_hidden(s, ctx))  # (B, L, V)
    F.cross_entropy(logits.flatten(0, 1), y.flatten(), ignore_index=-100).backward()
    want = _grads(model)
    assert got.keys() == want.keys()
    for n in want:
        torch.testing.assert_close(got[n], want[n], rtol=1e-5, atol=1e-7, msg=n)

    model.zero_grad(set_to_none=True)
    model.loss(x, y, loops=T).backward()  # full backprop differs (the test can tell)
    full = _grads(model)
    rel = (full["block.mlp.down.weight"] - got["block.mlp.down.weight"]).norm() / full[
        "block.mlp.down.weight"
    ].norm()
    assert rel > 1e-3


def _saved_bytes(fn) -> int:
    total = [0]

    def pack(t):
        total[0] += t.numel() * t.element_size()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        out = fn()
    out.backward()
    return total[0]


@pytest.mark.parametrize("objective", ["final", "per_step"])
def test_activation_checkpointing_gives_the_same_gradients(objective: str) -> None:
    x, y = _batch(L=32)
    model = _tiny("scse", dropout=0.1)
    model.train()
    grads, saved = [], []
    for ckpt in (False, True):
        model.zero_grad(set_to_none=True)
        torch.manual_seed(5)  # the same dropout masks (checkpoint replays the RNG state)
        saved.append(
            _saved_bytes(
                lambda c=ckpt: model.loss(x, y, loops=8, objective=objective, checkpoint_loops=c)
            )
        )
        grads.append(_grads(model))
    for n in grads[0]:
        torch.testing.assert_close(grads[1][n], grads[0][n], rtol=1e-5, atol=1e-7, msg=n)
    # per loop only the step's inputs are kept instead of every block activation
    assert saved[1] < 0.5 * saved[0], saved


def test_per_step_objective_averages_every_readout() -> None:
    x, y = _batch()
    model = _tiny()
    got = model.loss(x, y, loops=4, objective="per_step")
    valid = y != -100
    hs = model.hidden_states(x, 4, keep_all=True)[1:]
    want = sum(F.cross_entropy(model.readout(h)[valid], y[valid]) for h in hs) / 4
    torch.testing.assert_close(got, want)


# ----------------------------------------------------------------------------- memory flat in T
def _peak_live_states(model, call) -> int:
    """Peak number of loop states alive at once during ``call()``.

    Every tensor a loop step returns (state coordinates) and every state mapped to hidden
    coordinates (``to_hidden``) is tracked by a weak reference; the count is taken at each step.
    Memory flat in T means this peak does not grow with T.
    """
    rec = model.recurrence
    real_step, real_hidden = rec.step, rec.to_hidden
    live = [0, 0]  # alive, peak

    def gone(_ref) -> None:
        live[0] -= 1

    refs = []

    def track(t: torch.Tensor) -> torch.Tensor:
        live[0] += 1
        live[1] = max(live[1], live[0])
        refs.append(weakref.ref(t, gone))
        return t

    rec.step = lambda *a, **k: track(real_step(*a, **k))
    rec.to_hidden = lambda *a, **k: track(real_hidden(*a, **k))
    try:
        out = call()
        del out
    finally:
        del rec.step, rec.to_hidden
    return live[1]


def test_evaluation_memory_is_flat_in_depth() -> None:
    x, y = _batch(L=16)
    model = _tiny().eval()
    with torch.no_grad():
        flat = [_peak_live_states(model, lambda T=T: model(x, loops=T)) for T in (8, 48, 96)]
        assert flat[0] == flat[1] == flat[2] <= 2, flat
        nll = [_peak_live_states(model, lambda T=T: model.nll_sum(x, y, T)) for T in (48, 96)]
        assert nll[0] == nll[1] <= 2, nll
        # the probe sees retention when states are requested …
        kept = _peak_live_states(model, lambda: model(x, loops=48, return_states=True))
        assert kept >= 49, kept
    # … and when autograd keeps activations for a backward pass
    assert _peak_live_states(model, lambda: model.loss(x, y, loops=48)) >= 48


# ----------------------------------------------------------------------------- vocabulary loss
def test_chunked_vocabulary_loss_matches_plain_and_keeps_no_logits() -> None:
    from looplm.model.loss import linear_cross_entropy

    g = torch.Generator().manual_seed(0)
    N, d, V = 96, 16, 700
    x = torch.randn(N, d, generator=g, requires_grad=True)
    w = (0.3 * torch.randn(V, d, generator=g)).requires_grad_()
    t = torch.randint(0, V, (N,), generator=g)
    plain = F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")
    gp = torch.autograd.grad(plain * 0.37, [x, w])
    saved: list[tuple[int, ...]] = []

    def pack(tensor):
        saved.append(tuple(tensor.shape))
        return tensor

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda u: u):
        chunked = linear_cross_entropy(x, w, t, rows=40)
    gc = torch.autograd.grad(chunked * 0.37, [x, w])
    torch.testing.assert_close(chunked, plain, rtol=1e-6, atol=1e-4)
    for a, b in zip(gc, gp):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)
    assert saved and all(s[-1] != V for s in saved), saved  # no (rows, V) tensor is kept
    with torch.autocast("cpu", dtype=torch.bfloat16):
        low = linear_cross_entropy(x, w, t, rows=40)
        ref = F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")
    torch.testing.assert_close(low, ref, rtol=1e-3, atol=1e-2)


def test_gradient_accumulation_equals_the_larger_batch(tmp_path: Path) -> None:
    one = setup(_cfg(tmp_path / "one", "train.batch_size=8"))
    acc = setup(_cfg(tmp_path / "acc", "train.batch_size=4", "train.grad_accum=2"))
    for _ in range(3):
        a, b = host_metrics(train_step(one)), host_metrics(train_step(acc))
        assert a["loss"] == pytest.approx(b["loss"], rel=1e-5)
    for (n, p), (_, q) in zip(one.raw_model.named_parameters(), acc.raw_model.named_parameters()):
        torch.testing.assert_close(p, q, rtol=1e-5, atol=2e-6, msg=n)


# ----------------------------------------------------------------------------- accounting
def test_train_flops_is_three_times_the_paper_proxy() -> None:
    from looplm import flops
    from looplm.settings.config import model_config

    for preset, rec, T in (("22m", "scse", 8), ("95.6m", "scse", 8), ("22m", "scse", 48)):
        want = flops(preset, rec, T, 128)["body_head"]
        got = train_flops(model_config(preset, rec), T, 128, 4096, 4096) / 3 / 4096
        assert got == want
    assert flops("22m", "scse", 8)["body_head"] == pytest.approx(77.9e6, rel=1e-3)
    unshared = model_config("22m-unshared-8x384", "unshared")
    assert train_flops(unshared, 16, 128, 1, 0) == train_flops(unshared, 8, 128, 1, 0)


# ----------------------------------------------------------------------------- GPU suite, --smoke
def test_gpu_bench_smoke_runs_every_section_on_cpu(tmp_path: Path) -> None:
    from conftest import require_data

    wt2, tok = require_data("wikitext-2"), require_data("gpt2-tokenizer")
    data = tmp_path / "data"
    (data / "wikitext-2").mkdir(parents=True)
    (data / "gpt2-tokenizer").mkdir()
    for split in ("train", "valid", "test"):  # a small excerpt: tokenizing stays quick
        lines = (wt2 / f"wiki.{split}.tokens").read_text().splitlines(keepends=True)[:150]
        (data / "wikitext-2" / f"wiki.{split}.tokens").write_text("".join(lines))
    for name in ("encoder.json", "vocab.bpe"):
        (data / "gpt2-tokenizer" / name).write_bytes((tok / name).read_bytes())
    sys.path.insert(0, str(REPO / "benchmarks"))
    threads, gpt2_env = torch.get_num_threads(), os.environ.get("LOOPLM_GPT2_DIR")
    try:
        import gpu_bench

        results = tmp_path / "RESULTS.md"
        rc = gpu_bench.main(
            [
                "--smoke",
                "--data-dir",
                str(data),
                "--cache-dir",
                str(tmp_path / "cache"),
                "--results",
                str(results),
                "--skip",
                "tests",
                "--wt2-seeds",
                "1",
            ]
        )
    finally:
        sys.path.remove(str(REPO / "benchmarks"))
        torch.set_num_threads(threads)
        if gpt2_env is None:
            os.environ.pop("LOOPLM_GPT2_DIR", None)
    text = results.read_text()
    assert rc == 0, text
    assert "<!-- gpu_bench_smoke:start -->" in text and "SMOKE run" in text
    assert "| 22m |" in text and "| 95.6m |" in text  # throughput rows
    assert (
        "SCSE / unshared Transformer-8 step time" in text and "| T | 1 | 2 | 4 | 8 | 16 |" in text
    )
    for m in ("scse", "looped", "tuned_adapter", "norm_reset"):
        assert f"| {m} | 1 |" in text  # one seed each, test PPL at 8 / 24 / 48
    assert "Errors:" not in text
