"""The tied-head cross-entropy: looplm's chunked loss vs the straightforward one (CPU).

    python benchmarks/vocab_loss.py [--rows 2048] [--widths 128,384] [--repeats 5]

Forward + backward of ``Σ CE(x Wᵀ, t)`` over the GPT-2 vocabulary (50,257) for ``rows`` supervised
tokens: ``looplm.model.loss.linear_cross_entropy`` (chunked over rows, one exponential pass per
chunk, no (N, V) logits kept for backward) against ``F.cross_entropy(F.linear(x, W).float(), t)``
with autograd, in fp32 and under bf16 autocast. Reports the median CPU time and wall time per
call (interleaved repeats) and checks that losses and gradients agree. Writes its section of
``benchmarks/RESULTS.md``.
"""

from __future__ import annotations

import argparse
import os
import statistics
import time

import torch
import torch.nn.functional as F
from _results import machine_line, update_section

from looplm.model.loss import linear_cross_entropy

V = 50257


def _plain(x: torch.Tensor, w: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(F.linear(x, w).float(), t, reduction="sum")


def _time(fn, x, w, t, autocast: bool) -> tuple[float, float, torch.Tensor, tuple]:
    x = x.detach().requires_grad_(True)
    w = w.detach().requires_grad_(True)
    c0, w0 = time.process_time(), time.perf_counter()
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast):
        loss = fn(x, w, t)
    loss.backward()
    return time.process_time() - c0, time.perf_counter() - w0, loss.detach(), (x.grad, w.grad)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rows", type=int, default=2048)
    ap.add_argument("--widths", default="128,384")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--threads", type=int, default=2)
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    load0 = os.getloadavg()
    rows = []
    for d in [int(v) for v in args.widths.split(",")]:
        g = torch.Generator().manual_seed(d)
        x = torch.randn(args.rows, d, generator=g)
        w = 0.02 * torch.randn(V, d, generator=g)
        t = torch.randint(0, V, (args.rows,), generator=g)
        for autocast in (False, True):
            res: dict[str, list[tuple[float, float]]] = {"looplm": [], "plain": []}
            out = {}
            for i in range(args.repeats + 1):  # first round is a warm-up
                for name, fn in (("looplm", linear_cross_entropy), ("plain", _plain)):
                    cpu, wall, loss, grads = _time(fn, x, w, t, autocast)
                    if i:
                        res[name].append((cpu, wall))
                    out[name] = (loss, grads)
            (la, ga), (lb, gb) = out["looplm"], out["plain"]
            rel = float((la - lb).abs() / lb.abs())
            gerr = max(float((a - b).norm() / b.norm()) for a, b in zip(ga, gb))
            med = {k: [statistics.median(v[j] for v in res[k]) for j in (0, 1)] for k in res}
            rows.append((d, "bf16 autocast" if autocast else "fp32", med, rel, gerr))
    load1 = os.getloadavg()
    lines = [
        "## Tied-head cross-entropy, CPU: chunked looplm loss vs the straightforward one",
        "",
        f"`python benchmarks/vocab_loss.py` · {machine_line()} · {args.rows} supervised rows × "
        f"vocabulary {V:,}, forward + backward, median of {args.repeats} interleaved repeats "
        f"(after a warm-up). Load average before {load0[0]:.2f}, after {load1[0]:.2f} (other work "
        "on the machine moves wall times; CPU time is the steadier figure).",
        "",
        "| width | precision | looplm CPU s | plain CPU s | speed-up (CPU) | looplm wall s | "
        "plain wall s | speed-up (wall) | loss rel. diff | grad rel. diff |",
        "|---:|---|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for d, prec, med, rel, gerr in rows:
        (lc, lw), (pc, pw) = med["looplm"], med["plain"]
        lines.append(
            f"| {d} | {prec} | {lc:.3f} | {pc:.3f} | {pc / lc:.2f}× | {lw:.3f} | {pw:.3f} | "
            f"{pw / lw:.2f}× | {rel:.1e} | {gerr:.1e} |"
        )
    lines += [
        "",
        "The plain path keeps the (N, V) fp32 logits and softmax for backward; looplm keeps one "
        "chunk's logits at a time and folds the softmax into the gradients during the forward "
        "pass. Under bf16 autocast both round logits and logit gradients to bf16, so they agree "
        "to bf16 rounding only.",
    ]
    body = "\n".join(lines)
    print(body)
    update_section("vocab_loss", body)


if __name__ == "__main__":
    main()
