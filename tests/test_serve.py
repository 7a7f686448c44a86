"""`looplm serve` against real clients on 127.0.0.1: the openai package, lm-evaluation-harness's
local-completions model, raw HTTP for faults, a 32-client load test and SIGTERM draining.

The model is the tiny configuration with random weights (context 64, bytes tokenizer), nudged off
its initialisation so that KL halting stops tokens at mixed depths. Every response is checked
against generating the same prompt alone (looplm.decoding.decoder.decode, what `looplm generate` runs)."""

from __future__ import annotations

import contextlib
import json
import logging
import os
import re
import signal
import subprocess
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest
import torch

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
pytest.importorskip("starlette", reason="the serve extra is not installed")
requests = pytest.importorskip("requests")

from looplm.data import get_tokenizer  # noqa: E402
from looplm.decoding.decoder import decode  # noqa: E402
from looplm.decoding.serve.app import Server, load_state  # noqa: E402
from looplm.decoding.serve.settings import ServeSettings  # noqa: E402
from looplm.model import model_from_config  # noqa: E402
from looplm.settings.config import load_config  # noqa: E402

T = 4  # the server's default loop depth in these tests
KL = 0.02  # a KL threshold at which this model's tokens halt at mixed depths (asserted)
CONTEXT = 64


@pytest.fixture(scope="module")
def tiny():
    cfg = load_config("tiny_wt2", ["model.dropout=0.0", f"model.context={CONTEXT}"])
    torch.manual_seed(0)
    model = model_from_config(cfg.model).eval()
    with torch.no_grad():  # away from the init so that tokens halt at different depths
        for p in model.parameters():
            p.add_(0.02 * torch.randn_like(p))
    return model, cfg, get_tokenizer("bytes")


@contextlib.contextmanager
def serving(tiny, **settings):
    """A server on a free port of 127.0.0.1, in a thread; yields (state, base URL)."""
    model, cfg, tok = tiny
    values = dict(host="127.0.0.1", port=0, model_name="tiny", loops=T, slots=4)
    values.update(settings)
    state = load_state(ServeSettings(**values), model=model, tokenizer=tok, cfg=cfg)
    server = Server(state)
    ready, port = threading.Event(), []
    thread = threading.Thread(
        target=server.run, kwargs={"on_ready": lambda p: (port.append(p), ready.set())}
    )
    thread.start()
    assert ready.wait(30), "the server did not start"
    try:
        yield state, f"http://127.0.0.1:{port[0]}"
    finally:
        server.stop()
        thread.join(30)
        assert not thread.is_alive()


@pytest.fixture(scope="module")
def server(tiny):
    with serving(tiny) as s:
        yield s


def alone(
    model,
    tok,
    prompt,
    max_new,
    *,
    loops=T,
    halt="none",
    thr=0.0,
    temp=0.0,
    top_k=None,
    seed=0,
    prefill_halt=False,
):
    """(tokens, depths) of generating ``prompt`` alone, as `looplm generate` does."""
    ids = tok.encode(prompt) if isinstance(prompt, str) else list(prompt)
    got = decode(
        model,
        torch.tensor([ids]),
        max_new,
        loops,
        halt=halt,
        threshold=thr,
        temperature=temp,
        top_k=top_k,
        generator=torch.Generator().manual_seed(seed),
        prefill_halt=prefill_halt,
    )
    tokens, depths = got.tokens[0, len(ids) :].tolist(), got.loops[0].tolist()
    if tok.eot_id in tokens:  # the server ends a sequence at the end-of-text token
        cut = tokens.index(tok.eot_id) + 1
        tokens, depths = tokens[:cut], depths[:cut]
    return tokens, depths


def _text(tok, tokens):
    return tok.decode([t for t in tokens if t != tok.eot_id])


# ============================================================================ the openai client
CASES = [  # (prompt, max_tokens, extra request fields, decode settings)
    ("The history of", 12, {"temperature": 0}, {}),
    ("a", 9, {"temperature": 1.0, "top_k": 20, "seed": 7}, {"temp": 1.0, "top_k": 20, "seed": 7}),
    (
        "Looped models think",
        14,
        {"temperature": 0, "halt": "kl", "threshold": KL},
        {"halt": "kl", "thr": KL},
    ),
    (
        "Depth",
        10,
        {"temperature": 0.8, "seed": 3, "halt": "update", "threshold": 0.5, "prefill_halt": True},
        {"temp": 0.8, "seed": 3, "halt": "maxtoken", "thr": 0.5, "prefill_halt": True},
    ),
    ("x" * 60, 20, {"temperature": 0, "loops": 3}, {"loops": 3}),  # slides past the context
]


@pytest.mark.parametrize("stream", [False, True])
def test_openai_client_gets_what_generating_alone_gives(tiny, server, stream: bool) -> None:
    openai = pytest.importorskip("openai")
    model, _, tok = tiny
    state, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    depths_seen = []
    for prompt, n, fields, ref in CASES:
        want, depths = alone(model, tok, prompt, n, **ref)
        extra = {k: v for k, v in fields.items() if k not in ("temperature", "seed")}
        kw = dict(
            model="tiny",
            prompt=prompt,
            max_tokens=n,
            temperature=fields["temperature"],
            seed=fields.get("seed"),
            extra_body=extra,
        )
        if stream:
            chunks = list(client.completions.create(stream=True, **kw))
            text = "".join(c.choices[0].text for c in chunks if c.choices)
            tokens = [t for c in chunks for t in c.choices[0].model_extra["looplm"]["tokens"]]
            loops = [d for c in chunks for d in c.choices[0].model_extra["looplm"]["loops"]]
            finish = chunks[-1].choices[0].finish_reason
        else:
            r = client.completions.create(**kw)
            text, finish = r.choices[0].text, r.choices[0].finish_reason
            tokens = r.choices[0].model_extra["looplm"]["tokens"]
            loops = r.choices[0].model_extra["looplm"]["loops"]
            assert r.usage.prompt_tokens == len(tok.encode(prompt))
            assert r.usage.completion_tokens == len(want)
        assert tokens == want, prompt
        assert loops == depths, prompt
        assert text == _text(tok, want)
        assert finish == ("stop" if want[-1] == tok.eot_id else "length")
        depths_seen.append(depths)
    kl_depths = depths_seen[2]
    assert min(kl_depths) < T and max(kl_depths) == T  # halting acted, at mixed depths
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]


def test_chat_needs_a_template_and_the_plain_one_is_documented(tiny, server) -> None:
    openai = pytest.importorskip("openai")
    model, _, tok = tiny
    state, url = server
    client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=30)
    msgs = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]
    with pytest.raises(openai.BadRequestError, match="no chat template"):
        client.chat.completions.create(model="tiny", messages=msgs, max_tokens=4)
    from looplm.decoding.serve.calls import plain_chat_prompt

    state.settings.chat_template = "plain"  # read per request
    try:
        prompt = plain_chat_prompt(msgs)
        assert prompt == "System: Be brief.\n\nUser: Hi\n\nAssistant:"
        want, _ = alone(model, tok, prompt, 6)
        r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=6, temperature=0)
        assert r.choices[0].message.content == _text(tok, want).split("\nUser:")[0]
        chunks = list(
            client.chat.completions.create(
                model="tiny",
                messages=msgs,
                max_tokens=6,
                temperature=0,
                stream=True,
                stream_options={"include_usage": True},
            )
        )
        assert chunks[0].choices[0].delta.role == "assistant"
        assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == (
            r.choices[0].message.content
        )
        assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    finally:
        state.settings.chat_template = "none"


def test_stop_strings_end_a_sequence_and_free_its_slot(tiny, server) -> None:
    model, _, tok = tiny
    state, url = server
    want, _ = alone(model, tok, "The history of", 30)
    text = _text(tok, want)
    stop = text[5:7]  # a string the greedy continuation contains
    assert stop in text
    for stream in (False, True):
        body = dict(
            prompt="The history of", max_tokens=30, temperature=0, stop=[stop], stream=stream
        )
        r = requests.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200
        if stream:
            events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
            got = "".join(e["choices"][0]["text"] for e in events)
            finish = events[-1]["choices"][0]["finish_reason"]
        else:
            got, finish = r.json()["choices"][0]["text"], r.json()["choices"][0]["finish_reason"]
        assert got == text[: text.index(stop)] and finish == "stop"
    _wait(lambda: state.scheduler.running == 0)
    assert state.metrics.cancelled >= 2


def test_n_and_prompt_lists_fan_out_into_independent_sequences(tiny, server) -> None:
    model, _, tok = tiny
    state, url = server
    for prompts in (["ab", "xyz"], [[97, 98], [104, 105, 106]]):  # texts, token ids
        body = dict(prompt=prompts, n=2, max_tokens=5, temperature=1.0, seed=11)
        r = requests.post(url + "/v1/completions", json=body, timeout=30)
        assert r.status_code == 200, r.text
        choices = r.json()["choices"]
        assert [c["index"] for c in choices] == [0, 1, 2, 3]
        for c in choices:  # choice j of a prompt is sampled with seed + j
            p, j = divmod(c["index"], 2)
            want, _ = alone(model, tok, prompts[p], 5, temp=1.0, seed=11 + j)
            assert c["looplm"]["tokens"] == want and c["looplm"]["seed"] == 11 + j
    # without a seed each request draws one and reports it: the answer can be repeated
    body = dict(prompt="ab", max_tokens=6, temperature=1.0)
    c = requests.post(url + "/v1/completions", json=body, timeout=30).json()["choices"][0]
    want, _ = alone(model, tok, "ab", 6, temp=1.0, seed=c["looplm"]["seed"])
    assert c["looplm"]["tokens"] == want


# ============================================================================ faults
BAD = [  # (body, status, param the error names or None, text in the message)
    (b"{bad", 400, None, "not JSON"),
    (b"\xff\xfe{}", 400, None, "not UTF-8"),
    (b"", 400, None, "empty"),
    (b"[1, 2]", 400, None, "JSON object"),
    (b'{"prompt": 3}', 400, "prompt", "must be a string"),
    (b'{"prompt": "a", "max_tokens": "5"}', 400, "max_tokens", "integer"),
    (b'{"prompt": "a", "max_tokens": true}', 400, "max_tokens", "integer"),
    (b'{"prompt": "a", "temperatur": 1}', 400, "temperatur", "unknown field"),
    (b'{"prompt": ""}', 400, "prompt", "empty"),
    (b'{"prompt": []}', 400, "prompt", "empty"),
    (b"{}", 400, "prompt", "required"),
    (b'{"prompt": "a", "max_tokens": 0}', 400, "max_tokens", "[1, 2048]"),
    (b'{"prompt": "a", "max_tokens": 100000}', 400, "max_tokens", "[1, 2048]"),
    (b'{"prompt": "a", "n": 9}', 400, "n", "[1, 4]"),
    (b'{"prompt": "a", "logprobs": 6}', 400, "logprobs", "[0, 5]"),
    (b'{"prompt": "a", "loops": 65}', 400, "loops", "[1, 64]"),
    (b'{"prompt": "a", "loops": 0}', 400, "loops", "[1, 64]"),
    (b'{"prompt": "a", "halt": "magic"}', 400, "halt", "none, kl, update"),
    (b'{"prompt": "a", "threshold": -1}', 400, "threshold", "out of range"),
    (b'{"prompt": "a", "temperature": -0.5}', 400, "temperature", "out of range"),
    (b'{"prompt": "a", "top_p": 0.5}', 400, "top_p", "allowed: 1"),
    (b'{"prompt": "a", "stop": ["", "x"]}', 400, "stop", "non-empty"),
    (b'{"prompt": [99999]}', 400, "prompt", "outside the vocabulary"),
    (b'{"prompt": "' + b"y" * 65 + b'"}', 400, "prompt", "[1, 64]"),
    (b'{"prompt": "a", "model": "gpt-4"}', 404, "model", "not served"),
    (b'{"prompt": "a", "echo": true, "stream": true}', 400, "echo", "echo"),
]


def test_bad_requests_get_openai_shaped_4xx_and_no_traceback(server, caplog) -> None:
    state, url = server
    caplog.set_level(logging.WARNING)
    for body, status, param, text in BAD:
        r = requests.post(url + "/v1/completions", data=body, timeout=30)
        assert r.status_code == status, (body, r.text)
        err = r.json()["error"]
        assert set(err) == {"message", "type", "param", "code"}
        assert err["param"] == param and text in err["message"], (body, err)
    chat = [
        (b'{"messages": []}', "messages"),
        (b'{"messages": [{"role": "robot", "content": "x"}]}', "messages.0.role"),
        (b'{"messages": "hi"}', "messages"),
        (b'{"messages": [{"role": "user", "content": "x"}], "logprobs": true}', "logprobs"),
    ]
    for body, param in chat:
        r = requests.post(url + "/v1/chat/completions", data=body, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    assert requests.get(url + "/v1/nothing", timeout=30).status_code == 404
    r = requests.get(url + "/v1/completions", timeout=30)
    assert r.status_code == 405 and "error" in r.json()
    assert not [x for x in caplog.records if x.levelno >= logging.ERROR]
    assert "Traceback" not in caplog.text
    metrics = requests.get(url + "/metrics", timeout=30).text
    assert 'looplm_requests_total{route="completions",status="500"}' not in metrics


def test_a_full_queue_answers_429_and_a_client_gone_frees_its_slot(tiny) -> None:
    with serving(tiny, slots=1, max_queue=1, max_tokens_limit=100000) as (state, url):
        hold = requests.post(
            url + "/v1/completions",
            stream=True,
            timeout=30,
            json=dict(prompt="a", max_tokens=100000, temperature=0, stream=True),
        )
        lines = hold.iter_lines()
        assert next(lines).startswith(b"data: ")  # it runs in the one slot
        waiting = ThreadPoolExecutor(1).submit(
            requests.post,
            url + "/v1/completions",
            timeout=60,
            json=dict(prompt="b", max_tokens=3, temperature=0),
        )
        _wait(lambda: state.scheduler.queued == 1)
        full = requests.post(url + "/v1/completions", json=dict(prompt="c"), timeout=30)
        assert full.status_code == 429 and full.headers["Retry-After"] == "1"
        assert full.json()["error"]["type"] == "rate_limit_exceeded"
        hold.close()  # the client goes away: its slot is freed at the next token
        assert waiting.result().status_code == 200
        _wait(lambda: state.scheduler.running == 0 and state.scheduler.queued == 0)
        metrics = requests.get(url + "/metrics", timeout=30).text
        assert _metric(metrics, "looplm_rejected_total") == 1
        assert _metric(metrics, "looplm_cancelled_total") >= 1


def test_a_client_that_hangs_up_before_its_answer_frees_its_slot(tiny) -> None:
    import socket

    with serving(tiny, slots=2, max_tokens_limit=100000) as (state, url):
        port = int(url.rsplit(":", 1)[1])
        body = json.dumps(dict(prompt="a", max_tokens=100000, temperature=0)).encode()
        head = (
            f"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(body)}\r\n\r\n"
        ).encode()
        with socket.create_connection(("127.0.0.1", port), timeout=10) as sock:
            sock.sendall(head + body)
            _wait(lambda: state.scheduler.running == 1)  # not streaming: it waits for the end
        _wait(lambda: state.scheduler.running == 0)  # hung up: the slot is freed
        assert state.metrics.cancelled == 1


def test_a_request_past_its_timeout_gets_504_and_leaves_the_batch(tiny) -> None:
    with serving(tiny, slots=2, request_timeout=0.5, max_tokens_limit=100000) as (state, url):
        t0 = time.monotonic()
        r = requests.post(
            url + "/v1/completions",
            timeout=30,
            json=dict(prompt="a", max_tokens=100000, temperature=0),
        )
        assert r.status_code == 504 and r.json()["error"]["type"] == "timeout"
        assert time.monotonic() - t0 < 10
        _wait(lambda: state.scheduler.running == 0)


# ============================================================================ metrics, lm-eval
def _metric(text: str, name: str, labels: str = "") -> float:
    m = re.search(rf"^{re.escape(name + labels)} (\S+)$", text, re.M)
    assert m, name
    return float(m.group(1))


def test_metrics_count_tokens_depths_and_halting(tiny) -> None:
    model, _, tok = tiny
    with serving(tiny, halt="kl", threshold=KL) as (state, url):
        prompts = ["Looped models think", "The history of"]
        want = [alone(model, tok, p, 10, halt="kl", thr=KL) for p in prompts]
        for p in prompts:
            r = requests.post(
                url + "/v1/completions",
                timeout=30,
                json=dict(prompt=p, max_tokens=10, temperature=0),
            )
            assert r.status_code == 200
        text = requests.get(url + "/metrics", timeout=30).text
        depths = [d for _, ds in want for d in ds]
        assert _metric(text, "looplm_generated_tokens_total") == len(depths)
        assert _metric(text, "looplm_loop_steps_total") == sum(depths)
        assert (
            _metric(text, "looplm_halted_tokens_total", '{rule="kl"}')
            == sum(d < T for d in depths)
            > 0
        )
        assert _metric(text, "looplm_mean_loops_per_token") == pytest.approx(
            sum(depths) / len(depths), abs=1e-3
        )
        assert _metric(text, "looplm_prompt_tokens_total") == sum(
            len(tok.encode(p)) for p in prompts
        )
        assert _metric(text, "looplm_queue_depth") == 0
        assert _metric(text, "looplm_tokens_per_second") > 0
        assert _metric(text, "looplm_requests_total", '{route="completions",status="200"}') == 2


def test_lm_eval_local_completions_scores_and_generates(tiny, server) -> None:
    pytest.importorskip("lm_eval")
    from lm_eval.api.instance import Instance
    from lm_eval.models.openai_completions import LocalCompletionsAPI

    model, _, tok = tiny
    state, url = server
    lm = LocalCompletionsAPI(
        base_url=url + "/v1/completions",
        model="tiny",
        tokenizer_backend="remote",
        max_length=CONTEXT,
        max_retries=1,
    )
    pairs = [("The cat sat on the", " mat"), ("Looped", " transformers think")]
    reqs = [Instance("loglikelihood", {}, pair, i) for i, pair in enumerate(pairs)]
    got = lm.loglikelihood(reqs, disable_tqdm=True)
    for (ctx, cont), (ll, greedy) in zip(pairs, got):
        a, b = tok.encode(ctx), tok.encode(cont)
        ids = torch.tensor([a + b])
        with torch.no_grad():
            logp = torch.log_softmax(model(ids, loops=T)[0].double(), -1)
        pos = torch.arange(len(a) - 1, len(a) + len(b) - 1)
        want = float(logp[pos, ids[0, len(a) :]].sum())
        assert ll == pytest.approx(want, abs=1e-3)
        assert greedy == bool((logp[pos].argmax(-1) == ids[0, len(a) :]).all())
    gen = [
        Instance(
            "generate_until",
            {},
            ("The history of", {"until": ["\n\n"], "max_gen_toks": 8, "do_sample": False}),
            0,
        )
    ]
    out = lm.generate_until(gen, disable_tqdm=True)
    want, _ = alone(model, tok, "The history of", 8)
    assert out == [_text(tok, want).split("\n\n")[0]]


# ============================================================================ load
@pytest.mark.parametrize("schedule", ["continuous", "loop"])
def test_32_concurrent_clients_each_get_their_own_answer(tiny, schedule: str) -> None:
    model, _, tok = tiny
    g = torch.Generator().manual_seed(5)
    jobs = []
    for i in range(48):  # mixed prompt lengths (1 … 60 tokens), lengths, depths, sampling
        L = int(torch.randint(1, 61, (1,), generator=g))
        prompt = bytes(torch.randint(97, 123, (L,), generator=g).tolist()).decode()
        n = int(torch.randint(1, 17, (1,), generator=g))
        body = dict(
            prompt=prompt,
            max_tokens=n,
            temperature=0.0 if i % 2 else 1.0,
            seed=i,
            stream=i % 3 == 0,
        )
        ref = dict(temp=body["temperature"], seed=i)
        if i % 4 == 1:
            body.update(halt="kl", threshold=KL)
            ref.update(halt="kl", thr=KL)
        elif i % 8 == 2:  # a setting the loop-level batch does not serve: a token-level one does
            body.update(halt="update", threshold=0.5, prefill_halt=True)
            ref.update(halt="maxtoken", thr=0.5, prefill_halt=True)
        jobs.append((body, alone(model, tok, prompt, n, **ref)))

    def client(item):
        body, _ = item
        r = requests.post(url + "/v1/completions", json=body, timeout=60)
        assert r.status_code == 200, r.text
        if not body["stream"]:
            c = r.json()["choices"][0]
            return c["looplm"]["tokens"], c["looplm"]["loops"], c["text"]
        events = [json.loads(x[6:]) for x in r.text.split("\n\n") if x.startswith("data: {")]
        ch = [e["choices"][0] for e in events]
        return (
            [t for c in ch for t in c["looplm"]["tokens"]],
            [d for c in ch for d in c["looplm"]["loops"]],
            "".join(c["text"] for c in ch),
        )

    with serving(tiny, slots=8, max_queue=64, schedule=schedule) as (state, url):
        t0 = time.monotonic()
        with ThreadPoolExecutor(32) as pool:
            results = list(pool.map(client, jobs))
        assert time.monotonic() - t0 < 60
        for (body, (tokens, depths)), (got, loops, text) in zip(jobs, results):
            assert got == tokens, body
            assert loops == depths, body
            assert text == _text(tok, tokens)
        # nothing is kept per finished request (no batch, no job): memory stays slots × context
        _wait(lambda: not state.scheduler._batchers and not state.scheduler._jobs)
        metrics = requests.get(url + "/metrics", timeout=30).text
        assert _metric(metrics, "looplm_generated_tokens_total") == sum(
            len(t) for _, (t, _) in jobs
        )


# ============================================================================ SIGTERM
def test_sigterm_drains_in_flight_requests_and_refuses_new_ones(tiny, tmp_path: Path) -> None:
    from looplm.model.checkpoint import save_checkpoint

    model, cfg, tok = tiny
    ck = save_checkpoint(tmp_path / "ck", model, cfg)
    env = dict(os.environ, PYTHONPATH=str(Path(__file__).resolve().parents[1]))
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "looplm",
            "serve",
            str(ck),
            "--port",
            "0",
            "--loops",
            str(T),
            "--max-tokens-limit",
            "4000",
        ],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )
    try:
        line = proc.stderr.readline()
        m = re.search(r"http://127\.0\.0\.1:(\d+)/v1", line)
        assert m, line
        url = f"http://127.0.0.1:{m.group(1)}"
        n = 150
        stream = requests.post(
            url + "/v1/completions",
            stream=True,
            timeout=60,
            json=dict(prompt="The history of", max_tokens=n, temperature=0, stream=True),
        )
        lines = stream.iter_lines()
        first = next(lines)
        assert first.startswith(b"data: ")
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.3)
        with pytest.raises(requests.ConnectionError):  # the listening socket is closed
            requests.post(url + "/v1/completions", json=dict(prompt="a"), timeout=5)
        rest = [x for x in (first, *lines) if x]  # events are separated by blank lines
        events = [json.loads(x[6:]) for x in rest if x.startswith(b"data: {")]
        tokens = [t for e in events for t in e["choices"][0]["looplm"]["tokens"]]
        assert rest[-1] == b"data: [DONE]"  # the in-flight request finished
        assert tokens == alone(model, tok, "The history of", n)[0]
        assert proc.wait(timeout=60) == 0
        err = proc.stderr.read()
        assert "Traceback" not in err and "stopped" in err
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


def _wait(cond, timeout: float = 20.0) -> None:
    t0 = time.monotonic()
    while not cond():
        assert time.monotonic() - t0 < timeout, "timed out waiting"
        time.sleep(0.02)
