"""Section ``ratio``: step time of SCSE (T = 8) over the unshared Transformer-8 at 22m width,
alternating who goes first; then SCSE 22m step time at T ∈ {1, 2, 4, 8, 16}. Reuses the 22m
training state the ``throughput`` section leaves in ``out["_state_22m"]``."""

from __future__ import annotations

import statistics
from typing import Any

from gpubench.common import SMOKE_DIMS, SMOKE_VOCAB, Budget, free, time_steps


def run(args, out: dict[str, Any], budget: Budget) -> None:
    from throughput import make_state

    from looplm.training.loop import train_step

    smoke = args.smoke
    ts = out.pop("_state_22m", None)
    if ts is None or budget.left() < args.reserve_s:
        out.setdefault("cut", []).append("ratio/depth: budget spent or no 22m state")
        return
    dev = ts.device
    batch = ts.cfg.train.batch_size
    warm, n = (1, 2) if smoke else (args.warmup, args.steps)
    extra = [*SMOKE_DIMS["22m"], *SMOKE_VOCAB, "model.n_layers=8"] if smoke else []
    un = make_state(
        "22m-unshared-8x384",
        "unshared",
        batch=batch,
        device=dev.type,
        compile=not smoke,
        seq_len=32 if smoke else None,
        extra=extra,
    )
    for _ in range(warm):
        train_step(un)
    t_s, t_u = [], []
    for r in range(4 if not smoke else 2):  # alternate who goes first
        pair = [(ts, t_s), (un, t_u)]
        for state, acc in pair if r % 2 == 0 else pair[::-1]:
            acc.append(time_steps(lambda state=state: train_step(state), max(1, n // 2)))
    out["ratio"] = {
        "scse_ms": 1e3 * statistics.median(t_s),
        "unshared_ms": 1e3 * statistics.median(t_u),
        "ratio": statistics.median(t_s) / statistics.median(t_u),
    }
    print(f"[ratio] {out['ratio']}", flush=True)
    del un
    free()
    depth = {}
    for T in (1, 2, 4, 8, 16):
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"depth T={T}: budget spent")
            break
        ts.cfg.train.depth_min = ts.cfg.train.depth_max = T
        train_step(ts)
        sec = time_steps(lambda ts=ts: train_step(ts), max(1, n // 2))
        depth[T] = {"ms": 1e3 * sec, "tok_s": batch * ts.cfg.model.context / sec}
    out["depth"] = depth
    print(f"[depth] {depth}", flush=True)
    del ts
    free()


def summarize(out: dict[str, Any], args) -> list[str]:
    L = []
    r = out.get("ratio")
    if r:
        L.append(
            f"**SCSE / unshared Transformer-8 step time** (22m width, T = 8): "
            f"{r['scse_ms']:.2f} ms / {r['unshared_ms']:.2f} ms = **{r['ratio']:.3f}**"
        )
        L.append("")
    dep = out.get("depth")
    if dep:
        L.append("| T | " + " | ".join(str(k) for k in dep) + " |")
        L.append("| --- |" + " ---: |" * len(dep))
        L.append(
            "| SCSE 22m step (ms) | " + " | ".join(f"{v['ms']:.2f}" for v in dep.values()) + " |"
        )
        L.append("| tokens/s | " + " | ".join(f"{v['tok_s']:,.0f}" for v in dep.values()) + " |")
        L.append("")
    return L
