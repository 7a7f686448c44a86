"""`looplm serve` under load: throughput and latency with 1 / 8 / 32 concurrent clients, adaptive
(kl) against fixed depth, continuous batching against one request at a time.

Two servers (`python -m looplm serve`, subprocesses on 127.0.0.1 free ports) serve the same
checkpoint: ``--slots 32`` (continuous batching) and ``--slots 1`` (one request at a time; the
others wait in the queue). Each measurement runs C closed-loop clients (threads; each sends its
next request when the last is answered) until ``--requests`` per client are answered; a request
is ``--new`` tokens (sampled at temperature 1 with its own seed: greedy decoding of a small
byte-level model falls into repeating one word) from a prompt of 8–64 tokens (WikiText-2 test
text when ``--data-dir`` has it, else random bytes), at fixed depth (``halt: none``) or adaptive
(``halt: kl, threshold: X`` as request fields). Configurations alternate within each of
``--rounds`` rounds (the order reverses every round); reported: medians over rounds of tokens/s
(generated tokens / wall time of the measurement) and p50 / p99 of the requests' latencies (all
rounds pooled). Mean loops/token from the responses. The machine's load average is recorded.

Quality at the threshold: the held-out NLL gap of adaptive against fixed depth on WikiText-2
(``benchmarks/generation_adaptive.heldout``: prompts prefilled, then every next true token decoded
with per-token halting) when a trained checkpoint and the data are given.

    python benchmarks/serve_bench.py --checkpoint runs/tiny_wt2/ckpt --threshold 0.1
    python benchmarks/serve_bench.py --stand-in 22m --halt update --threshold 0.5   # speed only

``--modes loop-level continuous --slots 64 --clients 1 8 32 64`` compares loop-level batching
(``serve --schedule loop``) with token-level continuous batching instead (section ``…_loop``).
"""

from __future__ import annotations

import argparse
import os
import re
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

from _results import machine_line, update_section

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def start_server(
    ckpt: str, slots: int, loops: int, threads: int, schedule: str = "continuous"
) -> tuple[subprocess.Popen, str]:
    """A `looplm serve` subprocess on a free loopback port; (process, base URL)."""
    env = dict(os.environ, PYTHONPATH=str(REPO))
    cmd = [
        sys.executable,
        "-m",
        "looplm",
        "serve",
        ckpt,
        "--host",
        "127.0.0.1",
        "--port",
        "0",
        "--slots",
        str(slots),
        "--max-queue",
        "256",
        "--loops",
        str(loops),
        "--threads",
        str(threads),
        "--schedule",
        schedule,
        "--max-tokens-limit",
        "4096",
    ]
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True, env=env)
    line = proc.stderr.readline()
    m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
    if not m:
        proc.kill()
        raise SystemExit(f"server did not start: {line}{proc.stderr.read()}")
    return proc, f"http://127.0.0.1:{m.group(1)}"


def prompts(cfg, data_dir: str | None, n: int, seed: int = 0) -> list[list[int]]:
    """n token-id prompts of 8–64 tokens of held-out text if available (WikiText-2's test split,
    or the model's own text corpus's: ``generation_adaptive.heldout_corpus``)."""
    import numpy as np

    rng = np.random.default_rng(seed)
    lengths = rng.integers(8, 65, n)
    try:
        from generation_adaptive import heldout_corpus

        from looplm.data.cache import get_split_tokens

        corpus = heldout_corpus(cfg)[0]
        tokens = np.asarray(get_split_tokens(corpus, "test", cfg.model.tokenizer, data_dir))
        starts = rng.integers(0, len(tokens) - 65, n)
        return [tokens[s : s + L].tolist() for s, L in zip(starts, lengths)]
    except Exception:  # no data: random bytes (the speed does not depend on the text)
        return [rng.integers(97, 123, L).tolist() for L in lengths]


def measure(url: str, clients: int, per_client: int, ps: list[list[int]], body: dict) -> dict:
    """C closed-loop clients: tokens/s, latencies, mean loops."""
    import requests

    lat, toks, loops, errors = [], [0], [], []
    lock = threading.Lock()

    def client(c: int) -> None:
        s = requests.Session()
        for k in range(per_client):
            i = c * per_client + k
            t0 = time.perf_counter()
            r = s.post(
                url + "/v1/completions",
                timeout=600,
                json=dict(body, prompt=ps[i % len(ps)], seed=i),
            )
            dt = time.perf_counter() - t0
            with lock:
                if r.status_code != 200:
                    errors.append(r.text)
                    continue
                ch = r.json()["choices"][0]["looplm"]
                lat.append(dt)
                toks[0] += len(ch["tokens"])
                loops.extend(ch["loops"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0]}")
    return dict(tps=toks[0] / wall, lat=lat, loops=sum(loops) / len(loops))


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def median(xs: list[float]) -> float:
    xs = sorted(xs)
    n = len(xs)
    return xs[n // 2] if n % 2 else 0.5 * (xs[n // 2 - 1] + xs[n // 2])


def quality(args, model, cfg, T: int) -> str:
    """The held-out NLL gap of the adaptive setting, or why it is not measured."""
    if args.stand_in:
        return "not measured (random weights: speed only)"
    try:
        import torch
        from generation_adaptive import heldout, heldout_corpus, text_windows

        win = text_windows(cfg, args.data_dir, 16, 96, "cpu")
        torch.set_num_threads(args.threads)
        base, _ = heldout(model, win, 32, T, "none", 0.0)
        nll, depth = heldout(model, win, 32, T, args.rule, args.threshold)
        return (
            f"held-out NLL {base:.4f} (fixed T={T}) → {nll:.4f} ({100 * (nll / base - 1):+.2f}%) "
            f"at {depth:.2f} loops/token (16 {heldout_corpus(cfg)[1]} windows, 64 decoded tokens "
            "each)"
        )
    except Exception as exc:  # no data
        return f"not measured ({type(exc).__name__}: {exc})"


# server label → (its --schedule, whether it runs one request at a time)
MODES = {
    "continuous": ("continuous", False),  # token-level continuous batching
    "loop-level": ("loop", False),
    "one at a time": ("continuous", True),
}


def load_model(args):
    import torch

    from looplm.model import model_from_config
    from looplm.model.checkpoint import load_checkpoint, save_checkpoint
    from looplm.settings.config import load_config

    if args.checkpoint:
        model, cfg, _ = load_checkpoint(args.checkpoint)
        return model, cfg, args.checkpoint, None
    name = "tiny_wt2" if args.stand_in == "tiny" else "wt2_22m"
    cfg = load_config(name, [f"model.preset={args.stand_in}", "model.dropout=0.0"])
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    tmp = tempfile.TemporaryDirectory()
    save_checkpoint(Path(tmp.name) / "ck", model, cfg)
    return model, cfg, str(Path(tmp.name) / "ck"), tmp


# long: the measurement plan top to bottom (servers, alternating rounds, table, results file)
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint")
    which.add_argument("--stand-in", choices=["tiny", "22m"], help="random weights: speed only")
    p.add_argument("--halt", default="kl", choices=["kl", "update"])
    p.add_argument("--threshold", type=float, default=0.1)
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per measurement (≥ C)")
    p.add_argument("--new", type=int, default=32, help="tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--prefill-halt", action="store_true", help="adaptive: prompts halt too")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--data-dir", default=os.environ.get("LOOPLM_DATA_DIR", "../shared/data"))
    p.add_argument(
        "--modes",
        nargs="+",
        default=["continuous", "one at a time"],
        choices=list(MODES),
        help="servers to compare; the last is the baseline of the ratio column",
    )
    p.add_argument("--slots", type=int, default=32, help="slots of the batching servers")
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    args.rule = "maxtoken" if args.halt == "update" else args.halt
    model, cfg, ckpt, _tmp = load_model(args)
    T = args.loops
    ps = prompts(cfg, args.data_dir, 256)
    load0 = os.getloadavg()
    t_start = time.time()
    servers = {}
    for mode in args.modes:
        schedule, one = MODES[mode]
        servers[mode] = start_server(ckpt, 1 if one else args.slots, T, args.threads, schedule)
    adaptive = {"halt": args.halt, "threshold": args.threshold, "prefill_halt": args.prefill_halt}
    depths = {"fixed": {"halt": "none"}, args.halt: adaptive}
    configs = [(c, mode, d) for c in args.clients for mode in servers for d in depths]
    results: dict = {cfg_: [] for cfg_ in configs}
    try:
        for url in (u for _, u in servers.values()):  # warm-up
            measure(url, 1, 2, ps, dict(max_tokens=4, temperature=1.0))
        for r in range(args.rounds):
            for c, mode, d in configs if r % 2 == 0 else configs[::-1]:
                per = max(2, args.requests // c)  # ≥ 2 each: the batch reaches a steady state
                body = dict(max_tokens=args.new, temperature=1.0, **depths[d])
                results[(c, mode, d)].append(measure(servers[mode][1], c, per, ps, body))
                print(c, mode, d, round(results[(c, mode, d)][-1]["tps"], 1), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=60)
    load1 = os.getloadavg()
    rows = []
    for c, mode, d in configs:
        rs = results[(c, mode, d)]
        lat = [x for res in rs for x in res["lat"]]
        rows.append(
            dict(
                clients=c,
                mode=mode,
                depth=d,
                tps=median([x["tps"] for x in rs]),
                p50=pct(lat, 0.5),
                p99=pct(lat, 0.99),
                loops=rs[-1]["loops"],
            )
        )
    body = render(
        args, cfg, T, rows, quality(args, model, cfg, T), load0, load1, time.time() - t_start
    )
    print(body)
    if not args.no_write:
        name = "serve_bench" + ("" if args.checkpoint else f"_{args.stand_in}")
        if "loop-level" in args.modes:
            name += "_loop"
        update_section(name, body)
    return 0


def render(args, cfg, T, rows, qual, load0, load1, seconds) -> str:
    what = (
        f"checkpoint `{args.checkpoint}`"
        if args.checkpoint
        else f"{args.stand_in} stand-in (random weights, speed only)"
    )
    m = cfg.model
    by = {(r["clients"], r["mode"], r["depth"]): r for r in rows}
    base = args.modes[-1]
    lines = [
        f"## Serving (`benchmarks/serve_bench.py`): {what}",
        "",
        machine_line(),
        "",
        f"Model d {m.d_model}, {m.tokenizer} tokenizer, context {m.context}; T = {T}; "
        f"{args.new} sampled tokens per request from 8–64-token prompts; closed-loop clients, "
        f"max(2, {args.requests} ÷ clients) requests per client; medians of {args.rounds} alternating rounds; "
        f"servers: {', '.join(args.modes)} ({args.slots} slots; `continuous` is token-level batching); "
        f"each server {args.threads} torch thread(s). Load average {load0[0]:.1f} before, "
        f"{load1[0]:.1f} after ({seconds:.0f} s): the machine was shared, so compare ratios. "
        f"Adaptive: `halt={args.halt}, threshold={args.threshold:g}"
        + (", prefill_halt=true" if args.prefill_halt else "")
        + "` as request fields; "
        f"quality at it: {qual}.",
        "",
        "| clients | batching | depth | loops/token | tokens/s | p50 s | p99 s | adaptive ÷ fixed |"
        f" ÷ {base} |",
        "| ---: | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        other = "fixed" if r["depth"] != "fixed" else None
        ratio = f"{r['tps'] / by[(r['clients'], r['mode'], other)]['tps']:.2f}×" if other else ""
        vs = base if r["mode"] != base else None
        cont = f"{r['tps'] / by[(r['clients'], vs, r['depth'])]['tps']:.2f}×" if vs else ""
        lines.append(
            f"| {r['clients']} | {r['mode']} | {r['depth']} | {r['loops']:.2f} | {r['tps']:.1f} | "
            f"{r['p50']:.2f} | {r['p99']:.2f} | {ratio} | {cont} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
