"""GPU checks (skipped without CUDA): bf16 autocast + torch.compile against fp32 eager, the chunked
vocabulary loss under bf16, evaluation memory flat in T, and a compiled/fused training run.

Run by ``benchmarks/gpu_suite.sh`` on the H200 machine. When ``LOOPLM_GPU_REPORT`` names a file, the
measured errors and memory figures are appended to it as JSON lines (the suite prints them).
"""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.gpu

B, L = 32, 128  # the benchmark's shapes: the inductor cache then serves the benchmark's compile


def _report(**kw) -> None:
    path = os.environ.get("LOOPLM_GPU_REPORT")
    if path:
        with open(path, "a") as f:
            f.write(json.dumps(kw) + "\n")


def _model(preset: str = "22m", recurrence: str = "scse"):
    from looplm.model import build_model

    torch.manual_seed(0)
    return build_model(preset, recurrence, dropout=0.0).cuda()


def _batch(vocab: int = 50257, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randint(0, vocab, (B, L), generator=g)
    y = torch.randint(0, vocab, (B, L), generator=g)
    return x.cuda(), y.cuda()


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30))


def test_bf16_compiled_matches_fp32_eager() -> None:
    from looplm.training.compiled_step import compile_blocks

    prec = torch.get_float32_matmul_precision()
    torch.set_float32_matmul_precision("highest")  # a true fp32 reference (no TF32)
    try:
        ref = _model()
        x, y = _batch()
        logits_ref = ref(x, loops=8).float()
        ref.loss(x, y, loops=8).backward()
        g_ref = {n: p.grad.float().clone() for n, p in ref.named_parameters()}
    finally:
        torch.set_float32_matmul_precision(prec)
    fast = copy.deepcopy(ref)
    fast.zero_grad(set_to_none=True)
    assert compile_blocks(fast) == 1
    with torch.autocast("cuda", dtype=torch.bfloat16):
        logits = fast(x, loops=8).float()
        loss = fast.loss(x, y, loops=8)
    loss.backward()
    g = {n: p.grad.float() for n, p in fast.named_parameters()}
    logit_err = _rel(logits, logits_ref)
    flat_ref = torch.cat([v.flatten() for v in g_ref.values()])
    flat = torch.cat([g[n].flatten() for n in g_ref])
    grad_err = _rel(flat, flat_ref)
    worst = max((_rel(g[n], g_ref[n]), n) for n in g_ref)
    _report(
        test="bf16+compile vs fp32 eager (22m, T=8, 32x128)",
        logits_rel_err=logit_err,
        grad_rel_err=grad_err,
        worst_param=worst[1],
        worst_param_rel_err=worst[0],
    )
    assert logit_err < 3e-2, logit_err
    assert grad_err < 5e-2, grad_err
    assert worst[0] < 0.15, worst


def test_chunked_loss_under_bf16_matches_plain_and_saves_memory() -> None:
    from looplm.model.loss import linear_cross_entropy

    g = torch.Generator(device="cuda").manual_seed(0)
    N, d, V = B * L, 384, 50257
    x = torch.randn(N, d, device="cuda", generator=g, requires_grad=True)
    w = (0.02 * torch.randn(V, d, device="cuda", generator=g)).requires_grad_()
    t = torch.randint(0, V, (N,), device="cuda", generator=g)
    peaks, outs = [], []
    for chunked in (False, True):
        torch.cuda.synchronize()
        base = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        with torch.autocast("cuda", dtype=torch.bfloat16):
            if chunked:
                loss = linear_cross_entropy(x, w, t)
            else:
                loss = F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")
        gx, gw = torch.autograd.grad(loss, [x, w])
        torch.cuda.synchronize()
        peaks.append((torch.cuda.max_memory_allocated() - base) / 2**20)
        outs.append((loss.detach(), gx, gw))
    (l0, gx0, gw0), (l1, gx1, gw1) = outs
    _report(
        test="chunked vs plain CE, bf16, N=4096, V=50257",
        loss_rel_err=_rel(l1, l0),
        grad_x_rel_err=_rel(gx1, gx0),
        grad_w_rel_err=_rel(gw1, gw0),
        plain_peak_mb=peaks[0],
        chunked_peak_mb=peaks[1],
    )
    assert _rel(l1, l0) < 1e-3
    assert _rel(gx1, gx0) < 2e-2 and _rel(gw1, gw0) < 2e-2
    assert peaks[1] < 0.5 * peaks[0], peaks


def test_evaluation_memory_is_flat_in_T() -> None:
    model = _model().eval()
    x, y = _batch()
    peaks = {}
    with torch.no_grad(), torch.autocast("cuda", dtype=torch.bfloat16):
        model.nll_sum(x, y, 1)  # one-time allocations (library workspaces) happen here
        for T in (8, 48, 96):
            torch.cuda.synchronize()
            base = torch.cuda.memory_allocated()
            torch.cuda.reset_peak_memory_stats()
            model.nll_sum(x, y, T)
            torch.cuda.synchronize()
            peaks[T] = (torch.cuda.max_memory_allocated() - base) / 2**20
    _report(
        test="eval peak above weights (MiB), 22m, 32x128", **{f"T={k}": v for k, v in peaks.items()}
    )
    assert peaks[96] <= peaks[8] * 1.05 + 1.0, peaks
    assert peaks[48] <= peaks[8] * 1.05 + 1.0, peaks


def test_cuda_training_run_logs_mfu_and_memory(tmp_path: Path) -> None:
    from looplm.settings.config import load_config
    from looplm.training.loop import fit

    cfg = load_config(
        "tiny_bool",
        [
            "train.steps=20",
            "train.log_every=10",
            "train.device=cuda",
            "train.checkpoint_loops=true",
            "train.truncate_k=4",
            "eval.n_examples=64",
            f"out_dir={tmp_path}",
        ],
    )
    last = fit(cfg, progress=False)
    lines = [json.loads(x) for x in (tmp_path / "metrics.jsonl").read_text().splitlines()]
    assert lines[0]["loss"] > lines[1]["loss"]
    assert 0 < lines[1]["mfu"] < 1 and lines[1]["peak_mem_mb"] > 0
    assert last["val_accuracy"] >= 0.0
