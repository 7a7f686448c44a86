"""The Table 19 gap on the CPU: which stated or unstated setting moves the level and the order.

Table 19's recipe (22M, 1,200 steps, WikiText-2) run on a GPU gave SCSE 127.9 and normalization
reset 115.3 test PPL at T = 8 against the paper's 355.2 ± 2.4 and 387.8 ± 0.9. This script trains
the same recipe at a width the CPU trains (d 128, 2 heads, SwiGLU 512: every other setting as
``configs/wt2_22m.yaml``) and changes one setting at a time, for SCSE and normalization reset:

* training settings, one run each: the batch (8 or 32 windows of 128 tokens a step: 1.2M or
  4.9M tokens in 1,200 steps; the paper does not state it), raw against tokenised WikiText-2
  (``wikitext-2-raw``: no ``<unk>``, no `` @-@ ``), the cosine schedule's end point
  (``train.min_lr_ratio`` 0.1 or 0);
* evaluation settings, on every checkpoint: the unit (per GPT-2 token or per word of the tokenised
  test split, 245,569 words), non-overlapping 128-token windows against a sliding window (stride
  64: every scored token but the first window's sees at least 64 tokens), dropout left on at
  evaluation (``model.train()``, one pass, seed 0), and the ``<unk>`` pieces left out of the
  mean (tokenised split only).

Each run is ``looplm train`` in its own process (one thread; resumable: a run whose checkpoint is
complete is not trained again, a cut one continues with ``--resume``). Rows (one per run ×
evaluation variant × depth) go to ``--rows`` (JSONL, rewritten atomically after each run), and
``--report`` prints the table that benchmarks/RESULTS.md and docs/findings.md quote.

    LOOPLM_DATA_DIR=../shared/data python benchmarks/table19_gap.py --out runs/table19_gap \\
        --rows docs/data/table19_gap.jsonl --workers 2
    python benchmarks/table19_gap.py --rows docs/data/table19_gap.jsonl --report
"""

from __future__ import annotations

import argparse
import json
import math
import os
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from threading import Lock

WIDTH = ["model.d_model=128", "model.n_heads=2", "model.d_ff=512"]
METHODS = {"scse": "scse", "reset": "norm_reset"}
# (name suffix, overrides, what it changes) in the order they are run
SETTINGS = [
    ("b8", ["train.batch_size=8"], "batch 8 (1.2M tokens)"),
    ("b32", ["train.batch_size=32"], "batch 32 (4.9M tokens)"),
    ("raw_b8", ["train.batch_size=8", "data.dataset=wikitext-2-raw"], "raw WikiText-2, batch 8"),
    ("lr0_b8", ["train.batch_size=8", "train.min_lr_ratio=0"], "cosine to 0, batch 8"),
]
TEST_WORDS = 245_569  # WikiText-2 test, tokenised: whitespace words + one per line end
DEPTHS = [8, 48]
# Runs whose checkpoints also get the evaluation-only variants (sliding windows, dropout on): an
# evaluation of every variant costs about 15 minutes of one CPU thread at this width, and those
# settings are properties of the evaluation, so one training setting answers them.
FULL_EVAL = {"b8"}


def runs() -> list[dict]:
    out = []
    for suffix, overrides, what in SETTINGS:
        for short, rec in METHODS.items():
            out.append(
                {
                    "run": f"{short}_{suffix}",
                    "method": rec,
                    "setting": suffix,
                    "what": what,
                    "overrides": [f"model.recurrence={rec}", *overrides],
                }
            )
    return out


def _complete(ckpt: Path, steps: int = 1200) -> bool:
    from looplm.model.checkpoint import checkpoint_exists, read_meta

    return checkpoint_exists(ckpt) and read_meta(ckpt)["state"].get("step") == steps


def train(run: dict, out: Path, data_dir: str) -> Path:
    folder = out / run["run"]
    ckpt = folder / "ckpt"
    if _complete(ckpt):
        return ckpt
    cmd = [
        sys.executable,
        "-m",
        "looplm",
        "train",
        "wt2_22m",
        f"data.data_dir={data_dir}",
        *WIDTH,
        *run["overrides"],
        "train.log_every=100",
        f"out_dir={folder}",
        "--no-progress",
    ]
    from looplm.model.checkpoint import checkpoint_exists

    cmd.append("--resume" if checkpoint_exists(ckpt) else "--overwrite")
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    folder.mkdir(parents=True, exist_ok=True)
    with open(folder.parent / f"{run['run']}.log", "a") as log:
        subprocess.run(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, check=True)
    return ckpt


def _windows(tokens, context: int, stride: int):
    """(inputs, targets, first scored position) windows of ``context`` tokens every ``stride``,
    each target scored once: a window scores only the targets past the previous window's end."""
    n = len(tokens) - 1
    start, scored_to = 0, 0
    while scored_to < n:
        end = min(start + context, n)
        yield start, end, scored_to - start
        scored_to = end
        start += stride


def evaluate(ckpt: Path, data_dir: str, full: bool = True) -> list[dict]:
    import numpy as np
    import torch

    from looplm.data.cache import get_split_tokens
    from looplm.data.tokenizers import get_tokenizer
    from looplm.model.checkpoint import load_checkpoint
    from looplm.targets import IGNORE_INDEX

    torch.set_num_threads(1)
    model, cfg, _ = load_checkpoint(ckpt)
    tokens = np.asarray(
        get_split_tokens(
            cfg.data.dataset, "test", cfg.model.tokenizer, data_dir, cfg.data.cache_dir
        )
    ).astype(np.int64)
    unk = get_tokenizer(cfg.model.tokenizer).encode(" <unk>")
    is_unk = np.zeros(len(tokens), dtype=bool)  # target positions inside a " <unk>"
    if "raw" not in cfg.data.dataset:
        k = len(unk)
        hit = np.all([tokens[i : len(tokens) - k + 1 + i] == unk[i] for i in range(k)], axis=0)
        for i in range(k):
            is_unk[np.flatnonzero(hit) + i] = True
    L = cfg.model.context

    @torch.no_grad()
    def run(stride: int, train_mode: bool, depths: list[int]) -> dict[int, tuple]:
        model.train(train_mode)
        torch.manual_seed(0)
        sums = {T: [0.0, 0, 0.0, 0] for T in depths}  # Σ NLL, n, Σ NLL on <unk> pieces, n <unk>
        wins = list(_windows(tokens, L, stride))
        for b in range(0, len(wins), 32):
            chunk = wins[b : b + 32]
            w = max(e - s for s, e, _ in chunk)
            x = torch.zeros(len(chunk), w, dtype=torch.long)
            y = torch.full((len(chunk), w), IGNORE_INDEX, dtype=torch.long)
            u = torch.zeros(len(chunk), w, dtype=torch.bool)
            for r, (s, e, first) in enumerate(chunk):
                x[r, : e - s] = torch.from_numpy(tokens[s:e])
                tgt = torch.from_numpy(tokens[s + 1 : e + 1].copy())
                tgt[: max(first, 0)] = IGNORE_INDEX
                y[r, : e - s] = tgt
                u[r, : e - s] = torch.from_numpy(is_unk[s + 1 : e + 1])
            for T, h in model.iter_depths(x, depths):
                s_ = model.score(h, y, per_token=True, hits=False)
                valid = y != IGNORE_INDEX
                acc = sums[T]
                acc[0] += float(s_.nll.sum())
                acc[1] += int(valid.sum())
                acc[2] += float(s_.nll[valid & u].sum())
                acc[3] += int((valid & u).sum())
        model.eval()
        return sums

    rows = []

    def add(variant: str, T: int, sum_nll: float, n: int, words: int | None, **extra) -> None:
        nll = sum_nll / n
        row = {"variant": variant, "depth": T, "n_tokens": n, "nll": nll, "ppl": math.exp(nll)}
        if words:
            row["ppl_per_word"] = math.exp(sum_nll / words)
        rows.append({**row, **extra})

    t0 = time.perf_counter()
    for T, (s, n, su, nu) in run(L, False, DEPTHS).items():
        add("windows128", T, s, n, TEST_WORDS)
        if nu:
            add("windows128_no_unk", T, s - su, n - nu, None, unk_tokens=nu, unk_nll=su / nu)
    if full:  # the evaluation-only settings: measured on the batch-8 runs (see FULL_EVAL)
        for T, (s, n, _, _) in run(L // 2, False, [8]).items():
            add("sliding64", T, s, n, TEST_WORDS)
        for T, (s, n, _, _) in run(L, True, [8]).items():
            add("dropout_on", T, s, n, TEST_WORDS)
    n_params = sum(p.numel() for p in model.parameters())
    for r in rows:
        r["eval_wall_s"] = round(time.perf_counter() - t0, 1)
        r["params"] = n_params
    return rows


def work(run: dict, out: Path, data_dir: str, rows_path: Path, lock: Lock) -> None:
    from looplm.io import atomic_write_text
    from looplm.model.checkpoint import read_meta

    with lock:
        done = _read(rows_path)
    if any(r["run"] == run["run"] for r in done):
        print(f"{run['run']}: rows present", flush=True)
        return
    t0 = time.perf_counter()
    print(f"{run['run']}: training", flush=True)
    ckpt = train(run, out, data_dir)
    t_train = time.perf_counter() - t0
    meta = read_meta(ckpt)
    print(f"{run['run']}: evaluating ({t_train:.0f} s training)", flush=True)
    rows = evaluate(ckpt, data_dir, full=run["setting"] in FULL_EVAL)
    cfg = meta["config"]
    base = {
        "run": run["run"],
        "method": run["method"],
        "setting": run["setting"],
        "what": run["what"],
        "dataset": cfg["data"]["dataset"],
        "tokenizer": cfg["model"]["tokenizer"],
        "d_model": cfg["model"]["d_model"],
        "steps": meta["state"]["step"],
        "batch": cfg["train"]["batch_size"],
        "context": cfg["model"]["context"],
        "min_lr_ratio": cfg["train"]["min_lr_ratio"],
        "seed": cfg["train"]["seed"],
        "split": "test",
        "device": "cpu",
    }
    with lock:
        done = _read(rows_path)
        done += [{**base, **r} for r in rows]
        atomic_write_text(rows_path, "".join(json.dumps(r) + "\n" for r in done))
    print(f"{run['run']}: done, T=8 ppl {rows[0]['ppl']:.1f}", flush=True)


def _read(path: Path) -> list[dict]:
    if not path.exists():
        return []
    return [json.loads(x) for x in path.read_text().splitlines() if x.strip()]


def report(rows: list[dict]) -> str:
    """Markdown: one line per run, T = 8 test PPL under each evaluation variant, and T = 48."""
    by = {}
    for r in rows:
        by.setdefault(r["run"], {})[(r["variant"], r["depth"])] = r
    head = (
        "| run | setting | tokens/step | PPL/token T=8 | per word | sliding 64 | dropout on "
        "| no `<unk>` | T=48 |\n| --- | --- | ---: | ---: | ---: | ---: | ---: | ---: "
        "| ---: |"
    )
    lines = [head]
    for run in sorted(by, key=lambda k: [s[0] for s in SETTINGS].index(k.split("_", 1)[1])):
        v = by[run]
        b = v[("windows128", 8)]

        def g(key, field="ppl", v=v):
            r = v.get(key)
            return f"{r[field]:.1f}" if r and field in r else "—"

        lines.append(
            f"| {run} | {b['what']} | {b['batch'] * b['context']:,} | {b['ppl']:.1f} "
            f"| {g(('windows128', 8), 'ppl_per_word')} | {g(('sliding64', 8))} "
            f"| {g(('dropout_on', 8))} | {g(('windows128_no_unk', 8))} "
            f"| {g(('windows128', 48))} |"
        )
    return "\n".join(lines) + "\n\n" + factors(by)


def factors(by: dict) -> str:
    """What each setting does to the level (a ratio of T = 8 test PPLs, one seed, so no interval)
    and to the order (SCSE ÷ normalization reset; the paper's Table 19 has 355.2 ÷ 387.8 = 0.92)."""

    def ppl(run, variant="windows128", depth=8, field="ppl"):
        r = by.get(run, {}).get((variant, depth))
        return r[field] if r and field in r else None

    out = []

    def say(label, pairs):
        parts = [f"{m} {a / b:.2f}×" for m, a, b in pairs if a is not None and b is not None]
        if parts:
            out.append(f"- {label}: " + ", ".join(parts))

    methods = list(METHODS)
    say(
        "batch 8 ÷ batch 32 (¼ of the tokens)",
        [(m, ppl(f"{m}_b8"), ppl(f"{m}_b32")) for m in methods],
    )
    say(
        "raw ÷ tokenised WikiText-2, per word of the tokenised split (batch 8)",
        [
            (m, ppl(f"{m}_raw_b8", field="ppl_per_word"), ppl(f"{m}_b8", field="ppl_per_word"))
            for m in methods
        ],
    )
    say(
        "cosine to 0 ÷ to 0.1 (batch 8)", [(m, ppl(f"{m}_lr0_b8"), ppl(f"{m}_b8")) for m in methods]
    )
    for setting in ("b8", "b32"):
        say(
            f"`<unk>` pieces left out ÷ in (batch {setting[1:]})",
            [
                (m, ppl(f"{m}_{setting}", "windows128_no_unk"), ppl(f"{m}_{setting}"))
                for m in methods
            ],
        )
    say(
        "sliding window (stride 64) ÷ non-overlapping (batch 8)",
        [(m, ppl(f"{m}_b8", "sliding64"), ppl(f"{m}_b8")) for m in methods],
    )
    say(
        "dropout on ÷ off at evaluation (batch 8)",
        [(m, ppl(f"{m}_b8", "dropout_on"), ppl(f"{m}_b8")) for m in methods],
    )
    order = []
    for suffix, _, _ in SETTINGS:
        for variant, depth, label in (
            ("windows128", 8, "T=8"),
            ("windows128", 48, "T=48"),
            ("windows128_no_unk", 8, "T=8 no `<unk>`"),
        ):
            a, b = ppl(f"scse_{suffix}", variant, depth), ppl(f"reset_{suffix}", variant, depth)
            if a is not None and b is not None:
                order.append(f"{suffix} {label} {a / b:.2f}")
    if order:
        out.append("- SCSE ÷ normalization reset: " + ", ".join(order))
    return "\n".join(out)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--out", default="runs/table19_gap", help="folder for the runs")
    ap.add_argument("--rows", default="docs/data/table19_gap.jsonl")
    ap.add_argument("--data-dir", default=os.environ.get("LOOPLM_DATA_DIR", "../shared/data"))
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--only", default="", help="comma-separated run names (default: all)")
    ap.add_argument("--report", action="store_true", help="print the table from --rows")
    a = ap.parse_args()
    rows_path = Path(a.rows)
    if a.report:
        print(report(_read(rows_path)))
        return
    todo = [r for r in runs() if not a.only or r["run"] in a.only.split(",")]
    lock = Lock()
    out = Path(a.out).resolve()
    data_dir = str(Path(a.data_dir).resolve())
    with ThreadPoolExecutor(a.workers) as pool:
        for f in [pool.submit(work, r, out, data_dir, rows_path, lock) for r in todo]:
            f.result()


if __name__ == "__main__":
    main()
