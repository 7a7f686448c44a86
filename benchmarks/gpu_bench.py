"""The GPU suite's measurements, in one process, within a wall-time budget.

Sections (in this order; each is skipped, and said so, if the budget is already spent), one module
each in ``benchmarks/gpubench/``:

1. ``tests``: ``pytest tests/test_gpu.py`` in a subprocess (bf16 + compile vs fp32 eager, chunked
   loss, flat evaluation memory, a compiled training run); their measured errors are reported.
2. ``matmul``: the measured dense bf16 matrix rate (8192³ products), the MFU denominator.
3. ``throughput``: training tokens/s of looplm's ``train_step`` (compiled blocks + bf16 autocast
   + fused AdamW) for SCSE at 22m and 95.6m, T = 8, dropout 0, context 128, batch 32, random
   tokens, against a straightforward Listing-1 SCSE written here around a plain pre-norm block
   (same compile/autocast/optimizer settings, plain full-logits cross-entropy); MFU of each
   against the measured matrix rate, with FLOPs = 3 × Eq. 21 per token. Peak memory of
   training at T = 8 and of evaluation at T = 8, 48, 96 (above the resident weights).
4. ``ratio``: step time of SCSE (T = 8) over the unshared Transformer-8, 22m width, alternating.
5. ``depth``: SCSE 22m step time at T ∈ {1, 2, 4, 8, 16}.
6. ``wt2``: the WikiText-2 diagnostic table: 22M, 1,200 steps, context 128, batch 32, lr 3e-4,
   500 warmup, depth 1–8, dropout 0.1, bf16, for scse, looped, tuned_adapter and norm_reset × 3
   seeds, test PPL at T = 8, 24, 48. Runs go seed-major (every method's seed 0 first) in
   parallel worker processes sharing the GPU; a run is started only if the time measured so far
   says it can finish inside the budget, so a short budget cuts whole seeds, never steps, and the
   table says which runs were cut.

The summary table is printed last and written into ``benchmarks/RESULTS.md`` (section
``gpu_bench``; ``--results`` names another file). ``--smoke`` runs every section at toy size on
the CPU (no compile, tiny models, a few steps) to check the code paths.

    PYTHONPATH=. python benchmarks/gpu_bench.py --data-dir .data [--budget-s 290]
    PYTHONPATH=. python benchmarks/gpu_bench.py --smoke --data-dir ../shared/data --results /tmp/r.md
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback
from pathlib import Path
from typing import Any

HERE = Path(__file__).resolve().parent
REPO = HERE.parent
for p in (str(REPO), str(HERE)):
    if p not in sys.path:
        sys.path.insert(0, p)

from _results import RESULTS, machine_line, update_section  # noqa: E402
from gpubench import matmul, ratio, tests, throughput, wt2  # noqa: E402
from gpubench.common import Budget, free  # noqa: E402

SECTIONS = {
    "tests": tests,
    "matmul": matmul,
    "throughput": throughput,
    "ratio": ratio,
    "wt2": wt2,
}


def summary(out: dict[str, Any], args, wall: float) -> str:
    mode = (
        " — SMOKE run (toy sizes on the CPU; the numbers are not benchmarks)" if args.smoke else ""
    )
    L = [
        f"## GPU suite{mode}",
        "",
        f"{machine_line()} · total wall {wall:.0f} s (budget {args.budget_s:.0f} s)",
        "",
    ]
    for module in SECTIONS.values():
        L += module.summarize(out, args)
    if out.get("cut"):
        L.append("Sections cut: " + "; ".join(out["cut"]))
    if out.get("errors"):
        L.append("Errors: " + "; ".join(out["errors"]))
    return "\n".join(L)


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument(
        "--data-dir",
        default=os.environ.get("LOOPLM_DATA_DIR", str(REPO.parent / "shared" / "data")),
        help="folder with wikitext-2/ and gpt2-tokenizer/ (laid out like ../shared/data)",
    )
    ap.add_argument(
        "--cache-dir", default=None, help="token cache folder (default: $TMP/looplm-cache)"
    )
    ap.add_argument("--smoke", action="store_true", help="everything at toy size on the CPU")
    ap.add_argument("--budget-s", type=float, default=290.0, help="wall-time budget of the suite")
    ap.add_argument("--reserve-s", type=float, default=10.0, help="kept back for the summary")
    ap.add_argument(
        "--results",
        default=None,
        help="results file (default benchmarks/RESULTS.md; --smoke writes nothing unless given)",
    )
    ap.add_argument(
        "--skip",
        default="",
        help="comma list of sections to skip: tests,matmul,throughput,ratio,wt2",
    )
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--steps", type=int, default=20, help="timed steps per throughput measurement")
    ap.add_argument("--warmup", type=int, default=5, help="untimed (compile) steps")
    ap.add_argument("--ref-compile", choices=["block", "full", "none"], default="block")
    ap.add_argument("--wt2-steps", type=int, default=1200)
    ap.add_argument("--wt2-seeds", type=int, default=3)
    ap.add_argument(
        "--wt2-workers",
        type=int,
        default=None,
        help="parallel WikiText-2 worker processes (default 4 on GPU, 1 with --smoke)",
    )
    ap.add_argument("--wt2-compile", action="store_true", help="compile blocks in WikiText-2 runs")
    ap.add_argument("--json", default=None, help="also write the raw results here")
    return ap


def _setup_torch(smoke: bool) -> bool:
    """Threads and compiler settings; False when a GPU run has no GPU."""
    import torch

    if smoke:
        torch.set_num_threads(1)  # toy sizes: threads only add contention on a shared machine
    if not smoke and not torch.cuda.is_available():
        print("error: no CUDA GPU; use --smoke for the CPU check", file=sys.stderr)
        return False
    if not smoke:
        import torch._dynamo

        torch._dynamo.config.automatic_dynamic_shapes = False  # no surprise recompiles
        torch._dynamo.config.cache_size_limit = 64
    return True


def main(argv: list[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    if args.wt2_workers is None:
        args.wt2_workers = 1 if args.smoke else 4
    os.environ.setdefault("LOOPLM_NO_PROGRESS", "1")
    tok_dir = Path(args.data_dir) / "gpt2-tokenizer"
    if tok_dir.is_dir():
        os.environ.setdefault("LOOPLM_GPT2_DIR", str(tok_dir.resolve()))
    budget = Budget(args.budget_s, float(os.environ.get("LOOPLM_SUITE_T0", time.time())))
    skip = {s.strip() for s in args.skip.split(",") if s.strip()}
    if not _setup_torch(args.smoke):
        return 2
    out: dict[str, Any] = {}
    for name, module in SECTIONS.items():
        if name in skip:
            out.setdefault("cut", []).append(f"{name}: skipped (--skip)")
            continue
        if budget.left() < args.reserve_s:
            out.setdefault("cut", []).append(f"{name}: budget spent")
            continue
        t = time.time()
        try:
            module.run(args, out, budget)
        except Exception as exc:
            traceback.print_exc()
            out.setdefault("errors", []).append(f"{name}: {type(exc).__name__}: {exc}")
        print(f"[{name}] {time.time() - t:.1f} s (elapsed {budget.elapsed():.0f} s)", flush=True)
        if name == "ratio":
            out.pop("_state_22m", None)  # the 22m state the throughput section left for ratio
            free()
    text = summary(out, args, budget.elapsed())
    results = Path(args.results) if args.results else (None if args.smoke else RESULTS)
    if results is not None:
        update_section("gpu_bench_smoke" if args.smoke else "gpu_bench", text, path=results)
    if args.json:
        Path(args.json).write_text(json.dumps(out, indent=1, default=str))
    print("\n" + "=" * 100 + "\n" + text, flush=True)
    bad = bool(out.get("errors")) or (out.get("tests", {}).get("rc", 0) not in (0, 5))
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
