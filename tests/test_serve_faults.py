"""`looplm serve` under a careless client or operator: text that is not Unicode, a port already
taken, fields silently dropped or defaulted, a rule the model cannot run, an IPv6 host, and a
second stop signal or a drain that runs out during a stream. Every answer is a 4xx or an error
event, never a 500 or a traceback. Servers bind to 127.0.0.1 (or ::1) on a free port."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytest.importorskip("uvicorn", reason="the serve extra is not installed")
requests = pytest.importorskip("requests")

from test_serve import serving, tiny  # noqa: E402,F401 — the shared tiny model and server

from looplm.decoding.serve.app import load_state  # noqa: E402
from looplm.decoding.serve.settings import ServeSettings  # noqa: E402
from looplm.errors import LoopLMError  # noqa: E402

REPO = Path(__file__).resolve().parents[1]


def _post(url: str, route: str, body: bytes) -> requests.Response:
    return requests.post(url + route, data=body, timeout=30)


def test_lone_surrogates_are_a_400_naming_the_field(tiny) -> None:  # noqa: F811
    with serving(tiny, chat_template="plain") as (_, url):
        cases = [
            ("/v1/completions", b'{"prompt": "a\\ud800b", "max_tokens": 1}', "prompt"),
            ("/v1/completions", b'{"prompt": ["ok", "\\udfff"], "max_tokens": 1}', "prompt.1"),
            (
                "/v1/chat/completions",
                b'{"messages": [{"role": "user", "content": "\\ud800"}]}',
                "messages.0.content",
            ),
            ("/tokenize", b'{"prompt": "\\ud800"}', "prompt"),
        ]
        for route, body, param in cases:
            r = _post(url, route, body)
            assert r.status_code == 400, (route, r.text)
            err = r.json()["error"]
            assert err["param"] == param and "surrogate" in err["message"], err
        # a paired surrogate is one valid character
        r = _post(url, "/tokenize", b'{"prompt": "\\ud83d\\ude00"}')
        assert r.status_code == 200 and r.json()["count"] == 4  # four UTF-8 bytes


def test_chat_max_completion_tokens_is_checked_under_its_own_name(tiny) -> None:  # noqa: F811
    with serving(tiny, chat_template="plain") as (_, url):
        msg = [{"role": "user", "content": "hi"}]
        for value in (0, -1):
            r = requests.post(
                url + "/v1/chat/completions",
                json={"messages": msg, "max_completion_tokens": value},
                timeout=30,
            )
            assert r.status_code == 400, r.text  # not 256 tokens of the default
            assert r.json()["error"]["param"] == "max_completion_tokens"
        r = requests.post(
            url + "/v1/chat/completions",
            json={"messages": msg, "max_completion_tokens": 2, "max_tokens": 9, "temperature": 0},
            timeout=30,
        )
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] <= 2


def test_an_image_part_is_refused_not_dropped(tiny) -> None:  # noqa: F811
    with serving(tiny, chat_template="plain") as (_, url):
        parts = [
            {"type": "text", "text": "what is this?"},
            {"type": "image_url", "image_url": {"url": "http://x/y.png"}},
        ]
        r = requests.post(
            url + "/v1/chat/completions",
            json={"messages": [{"role": "user", "content": parts}], "max_tokens": 1},
            timeout=30,
        )
        assert r.status_code == 400
        err = r.json()["error"]
        assert err["param"] == "messages.0.content.1" and "image_url" in err["message"]


def test_halt_gate_without_a_gate_is_refused_at_start(tiny) -> None:  # noqa: F811
    model, cfg, tok = tiny
    settings = ServeSettings(host="127.0.0.1", port=0, halt="gate")
    with pytest.raises(LoopLMError, match="exit gate"):
        load_state(settings, model=model, tokenizer=tok, cfg=cfg)


def _serve(*args: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(REPO))
    return subprocess.Popen(
        [sys.executable, "-m", "looplm", "serve", *args],
        stderr=subprocess.PIPE,
        text=True,
        env=env,
    )


def test_a_port_in_use_is_one_line_before_loading(tmp_path) -> None:
    with socket.socket() as held:
        held.bind(("127.0.0.1", 0))
        held.listen()
        port = held.getsockname()[1]
        # the checkpoint does not exist: the port is checked before any loading
        proc = _serve(str(tmp_path / "missing"), "--port", str(port))
        _, err = proc.communicate(timeout=60)
    assert proc.returncode == 2
    assert err.strip().count("\n") == 0 and "already in use" in err and str(port) in err


@pytest.fixture(scope="module")
def checkpoint(tiny, tmp_path_factory):  # noqa: F811
    from looplm.model.checkpoint import save_checkpoint

    model, cfg, _ = tiny
    return save_checkpoint(tmp_path_factory.mktemp("serve_faults") / "ck", model, cfg)


def _ipv6_loopback() -> bool:
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
        return True
    except OSError:
        return False


def _started(proc: subprocess.Popen) -> str:
    line = proc.stderr.readline()
    m = re.search(r"(http://\S+):(\d+)/v1", line)
    assert m, line
    return line


def _stop(proc: subprocess.Popen) -> None:
    if proc.poll() is None:
        proc.kill()
        proc.wait()


@pytest.mark.skipif(not _ipv6_loopback(), reason="this machine has no IPv6 loopback")
def test_an_ipv6_host_prints_a_bracketed_url(checkpoint) -> None:
    proc = _serve(str(checkpoint), "--host", "::1", "--port", "0")
    try:
        line = _started(proc)
        port = re.search(r"\]:(\d+)/v1", line)
        assert "http://[::1]:" in line and port, line
        r = requests.get(f"http://[::1]:{port.group(1)}/health", timeout=10)
        assert r.status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        _stop(proc)


def _long_stream(url: str):
    r = requests.post(
        url + "/v1/completions",
        stream=True,
        timeout=60,
        json=dict(prompt="The history of", max_tokens=4000, temperature=0, stream=True),
    )
    lines = (x for x in r.iter_lines() if x)
    assert next(lines).startswith(b"data: {")
    return lines


@pytest.mark.parametrize("how", ["second_signal", "drain_timeout"])
def test_a_cut_stream_ends_with_an_error_event(checkpoint, how) -> None:
    drain = "60" if how == "second_signal" else "0.5"
    proc = _serve(
        str(checkpoint), "--port", "0", "--max-tokens-limit", "4000", "--drain-timeout", drain
    )
    try:
        line = _started(proc)
        url = "http://127.0.0.1:" + re.search(r":(\d+)/v1", line).group(1)
        lines = _long_stream(url)
        t0 = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        if how == "second_signal":
            time.sleep(0.3)
            proc.send_signal(signal.SIGINT)  # Ctrl-C after SIGTERM: stop now
        rest = list(lines)
        assert rest[-1] == b"data: [DONE]"
        error = json.loads(rest[-2][6:])["error"]
        assert error["type"] == "unavailable" and "cut" in error["message"]
        if how == "drain_timeout":
            assert "drain_timeout=0.5" in error["message"]
        assert time.monotonic() - t0 < 30
        code = proc.wait(timeout=60)
        err = proc.stderr.read()
        assert code == (130 if how == "second_signal" else 0), err
        for bad in ("Traceback", "CancelledError", "KeyboardInterrupt", "never retrieved"):
            assert bad not in err, err
    finally:
        _stop(proc)
