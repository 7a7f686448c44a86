"""The HTTP side of ``looplm serve``: a Starlette app on uvicorn speaking OpenAI's API.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text), and the vLLM-style ``GET /tokenizer_info``, ``POST /tokenize``,
``POST /detokenize`` through which lm-evaluation-harness's ``local-completions`` model uses the
server's own tokenizer.

A request is checked completely (:mod:`looplm.decoding.serve.schemas`) before any of it is queued; its
sequences (``n`` per prompt) then go to the :class:`~looplm.decoding.serve.scheduler.Scheduler` together
or not at all (a full queue answers 429 with ``Retry-After``). Events come back from the
scheduler thread through one asyncio queue per HTTP request. A stop string, a client that goes
away and a request past its timeout each cancel the request's sequences, which leave the batch
at the next token. After SIGTERM the server answers new requests 503, lets in-flight ones finish
(up to ``drain_timeout``) and exits.
"""

from __future__ import annotations

import asyncio
import json
import logging
import signal
import time
import uuid
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from looplm.decoding.batching import Request
from looplm.decoding.serve.calls import (
    Call,
    Choice,
    ServerState,
    chat_prompt,
    check_model,
    depths_field,
    logprobs_field,
    prompt_ids,
    request_depth,
    request_sampling,
    usage_field,
)
from looplm.decoding.serve.metrics import Metrics
from looplm.decoding.serve.scheduler import Scheduler, call_each
from looplm.decoding.serve.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_range,
    parse_body,
)
from looplm.decoding.serve.settings import ServeSettings
from looplm.errors import LoopLMError

log = logging.getLogger("looplm.decoding.serve")

MAX_BODY = 8 << 20  # bytes of one request body
DRAIN_GRACE_S = 5.0  # after drain_timeout, seconds a cut stream has to send its error event


# ====================================================================== routes
def _error(exc: ApiError) -> JSONResponse:
    return JSONResponse(exc.body(), status_code=exc.status, headers=exc.headers)


async def _read(request: HTTPRequest) -> bytes:
    body = b""
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY:
            raise ApiError(413, f"the body is larger than {MAX_BODY} bytes")
    return body


def _route(name: str):
    """Wrap a handler: ApiError → its JSON; any other fault → one log line and a 500; count."""

    def wrap(fn):
        async def handler(request: HTTPRequest) -> Response:
            state: ServerState = request.app.state.looplm
            try:
                if state.draining and name not in ("health", "metrics"):
                    raise ApiError(
                        503,
                        "the server is shutting down; retry on another",
                        type_="unavailable",
                        headers={"Retry-After": "5"},
                    )
                response = await fn(request, state)
            except ApiError as exc:
                response = _error(exc)
            except Exception as exc:  # noqa: BLE001 — one line, never a traceback
                log.error("%s failed: %s: %s", name, type(exc).__name__, exc)
                response = _error(
                    ApiError(500, f"internal error ({type(exc).__name__})", type_="server_error")
                )
            state.metrics.request(name, response.status_code)
            return response

        return handler

    return wrap


async def _generate(request: HTTPRequest, state: ServerState, chat: bool) -> Response:
    req = parse_body(await _read(request), ChatRequest if chat else CompletionRequest)
    check_model(state, req.model)
    samp = request_sampling(state, req)
    depth = request_depth(state, req)
    stops = samp.pop("stops")
    echo = False
    logprobs = None
    if chat:
        if req.logprobs or req.top_logprobs:
            raise ApiError(
                400, "logprobs are served by /v1/completions only; allowed: false", "logprobs"
            )
        text, extra = chat_prompt(state, req)
        prompts = prompt_ids(state, text)
        stops = stops + [s for s in extra if s not in stops]
    else:
        prompts = prompt_ids(state, req.prompt)
        echo = req.echo
        if req.logprobs is not None:
            check_range("logprobs", req.logprobs, 0, state.settings.max_logprobs)
            logprobs = req.logprobs
        if echo and req.stream:
            raise ApiError(400, "echo with stream is not served; allowed: echo=false", "echo")
    choices, requests = [], []
    for ids, text in prompts:
        for j in range(req.n):
            seed = samp["seed"] + j
            r = Request(ids, samp["max_new"], samp["temperature"], samp["top_k"], seed, logprobs)
            key = state.scheduler.new_key()
            choices.append(Choice(len(choices), key, ids, text, stops, seed=seed))
            requests.append(r)
    call = Call(
        state, choices, requests, depth, logprobs if echo and logprobs is not None else None
    )
    call.submit()
    kind = "chat.completion" if chat else "text_completion"
    rid = ("chatcmpl-" if chat else "cmpl-") + uuid.uuid4().hex[:24]
    head = dict(id=rid, created=int(time.time()), model=state.model_name)
    n_prompt = sum(len(ids) for ids, _ in prompts)
    if req.stream:
        usage = req.stream_options is not None and req.stream_options.include_usage
        return StreamingResponse(
            _stream(call, head, kind, chat, usage, n_prompt),
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache"},
        )
    return await _whole(request, call, head, kind, chat, echo, logprobs, n_prompt)


async def _whole(request, call: Call, head, kind, chat, echo, logprobs, n_prompt) -> Response:
    async def collect() -> None:
        while not call.done:
            await call.next()

    async def gone() -> None:  # the client closed the connection
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, watch = asyncio.ensure_future(collect()), asyncio.ensure_future(gone())
    try:
        await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        call.cancel_unfinished()
        raise
    finally:
        watch.cancel()
    if not work.done():  # the client went away: free the slots, answer no one
        work.cancel()
        call.cancel_unfinished()
        return Response(status_code=499)
    call.state.calls.discard(call)
    work.result()  # ApiError (timeout, scheduler fault, the server stopping) surfaces here
    tok = call.state.tokenizer
    out = []
    for c in call.choices:
        item: dict[str, Any] = {"index": c.index, "finish_reason": c.finish}
        text = (c.prompt_text + c.text) if echo else c.text
        if chat:
            item["message"] = {"role": "assistant", "content": text}
            item["logprobs"] = None
        else:
            item["text"] = text
            item["logprobs"] = logprobs_field(tok, c, echo) if logprobs is not None else None
        item["looplm"] = depths_field(c)
        out.append(item)
    n_new = sum(len(c.tokens) for c in call.choices)
    body = dict(head, object=kind, choices=out, usage=usage_field(call, n_prompt, n_new))
    return JSONResponse(body)


async def _stream(call: Call, head, kind, chat, usage, n_prompt):
    """Server-sent events: one chunk per token with new text, then ``data: [DONE]``."""
    obj = kind + ".chunk" if chat else kind

    def chunk(c: Choice, text: str, finish: str | None, first: bool = False) -> str:
        new = c.tokens[c.sent_tokens :]
        depths = c.loops[c.sent_tokens :]
        c.sent_tokens = len(c.tokens)
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}
        choice["looplm"] = {"tokens": new, "loops": depths, "seed": c.seed}
        return "data: " + json.dumps(dict(head, object=obj, choices=[choice])) + "\n\n"

    finished = set()
    try:
        if chat:
            for c in call.choices:
                yield chunk(c, "", None, first=True)
        while not call.done or len(finished) < len(call.choices):
            if call.done:
                i = next(c.index for c in call.choices if c.index not in finished)
            else:
                try:
                    i = await call.next()
                except ApiError as exc:
                    yield "data: " + json.dumps(exc.body()) + "\n\n"
                    break
                except Exception as exc:  # noqa: BLE001 — one log line and an error event
                    log.error("stream failed: %s: %s", type(exc).__name__, exc)
                    err = ApiError(
                        500, f"internal error ({type(exc).__name__})", type_="server_error"
                    )
                    yield "data: " + json.dumps(err.body()) + "\n\n"
                    break
            c = call.choices[i]
            text = call.stream_delta(c)
            if c.finish is not None and i not in finished:
                finished.add(i)
                yield chunk(c, text, c.finish)
            elif text or c.sent_tokens < len(c.tokens):
                yield chunk(c, text, None)
        else:
            if usage:
                n_new = sum(len(c.tokens) for c in call.choices)
                yield (
                    "data: "
                    + json.dumps(
                        dict(head, object=obj, choices=[], usage=usage_field(call, n_prompt, n_new))
                    )
                    + "\n\n"
                )
        yield "data: [DONE]\n\n"
    finally:  # the client went away (or the stream ended): no sequence keeps its slot
        call.cancel_unfinished()


@_route("completions")
async def completions(request: HTTPRequest, state: ServerState) -> Response:
    return await _generate(request, state, chat=False)


@_route("chat")
async def chat_completions(request: HTTPRequest, state: ServerState) -> Response:
    return await _generate(request, state, chat=True)


@_route("models")
async def models(request: HTTPRequest, state: ServerState) -> Response:
    card = {
        "id": state.model_name,
        "object": "model",
        "created": state.created,
        "owned_by": "looplm",
        "max_model_len": state.context,
    }
    return JSONResponse({"object": "list", "data": [card]})


@_route("health")
async def health(request: HTTPRequest, state: ServerState) -> Response:
    if state.draining:
        return JSONResponse({"status": "draining"}, status_code=503)
    return JSONResponse(
        {"status": "ok", "running": state.scheduler.running, "queued": state.scheduler.queued}
    )


@_route("metrics")
async def metrics(request: HTTPRequest, state: ServerState) -> Response:
    text = state.metrics.render(
        queued=state.scheduler.queued,
        running=state.scheduler.running,
        slots=state.settings.slots,
        draining=state.draining,
    )
    return PlainTextResponse(text, media_type="text/plain; version=0.0.4")


@_route("tokenizer_info")
async def tokenizer_info(request: HTTPRequest, state: ServerState) -> Response:
    tok = state.tokenizer
    return JSONResponse(
        {
            "tokenizer_class": type(tok).__name__,
            "eos_token": "<|endoftext|>",
            "bos_token": None,
            "pad_token": None,
            "chat_template": getattr(tok, "chat_template", None),
            "model_max_length": state.context,
            "vocab_size": tok.vocab_size,
        }
    )


@_route("tokenize")
async def tokenize(request: HTTPRequest, state: ServerState) -> Response:
    req = parse_body(await _read(request), TokenizeRequest)
    ids = state.tokenizer.encode(req.prompt)
    return JSONResponse({"tokens": ids, "count": len(ids), "max_model_len": state.context})


@_route("detokenize")
async def detokenize(request: HTTPRequest, state: ServerState) -> Response:
    req = parse_body(await _read(request), DetokenizeRequest)
    vocab = state.model.config.vocab_size
    bad = [i for i in req.tokens if not 0 <= i < vocab]
    if bad:
        raise ApiError(
            400, f"token id {bad[0]} is outside the vocabulary; allowed: [0, {vocab - 1}]", "tokens"
        )
    return JSONResponse({"prompt": state.tokenizer.decode(req.tokens)})


async def _http_error(request: HTTPRequest, exc: HTTPException) -> Response:
    """404 / 405 from routing, in OpenAI's error shape."""
    state: ServerState = request.app.state.looplm
    state.metrics.request("other", exc.status_code)
    msg = {
        404: f"no route {request.url.path}",
        405: f"{request.method} is not allowed on {request.url.path}",
    }.get(exc.status_code, str(exc.detail))
    return _error(ApiError(exc.status_code, msg, type_="invalid_request_error"))


def build_app(state: ServerState) -> Starlette:
    """The Starlette app; the scheduler thread runs while the app's lifespan does."""
    from contextlib import asynccontextmanager

    @asynccontextmanager
    async def lifespan(app):
        loop = asyncio.get_running_loop()

        def deliver(events: list) -> None:  # on the scheduler thread: one wake-up per step
            try:
                loop.call_soon_threadsafe(call_each, events)
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        state.scheduler.deliver = deliver
        state.loop = loop
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()
            state.loop = None

    routes = [
        Route("/v1/completions", completions, methods=["POST"]),
        Route("/v1/chat/completions", chat_completions, methods=["POST"]),
        Route("/v1/models", models, methods=["GET"]),
        Route("/health", health, methods=["GET"]),
        Route("/metrics", metrics, methods=["GET"]),
        Route("/tokenizer_info", tokenizer_info, methods=["GET"]),
        Route("/tokenize", tokenize, methods=["POST"]),
        Route("/detokenize", detokenize, methods=["POST"]),
    ]
    app = Starlette(
        routes=routes, lifespan=lifespan, exception_handlers={HTTPException: _http_error}
    )
    app.state.looplm = state
    return app


def check_port_free(host: str, port: int) -> None:
    """One line, before the model is loaded, when ``host:port`` cannot be listened on (another
    server holds it, or the address is not this machine's)."""
    import errno
    import socket

    if port == 0:
        return
    try:
        infos = socket.getaddrinfo(host, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE)
    except OSError as exc:
        raise LoopLMError(f"--host {host}: cannot be resolved ({exc.strerror or exc})") from None
    family, kind, proto, _, addr = infos[0]
    with socket.socket(family, kind, proto) as sock:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as uvicorn binds
        try:
            sock.bind(addr)
        except OSError as exc:
            if exc.errno == errno.EADDRINUSE:
                raise LoopLMError(
                    f"--port {port} on {host} is already in use (another server listens there); "
                    "stop it or pass another --port (0 picks a free one)"
                ) from None
            raise LoopLMError(
                f"--host {host} --port {port}: cannot listen there ({exc.strerror or exc})"
            ) from None


def url_host(host: str) -> str:
    """``host`` as it goes in a URL: an IPv6 address in brackets."""
    return f"[{host}]" if ":" in host else host


def load_state(settings: ServeSettings, model=None, tokenizer=None, cfg=None) -> ServerState:
    """The server's state from a checkpoint (or an already loaded model, tokenizer, config)."""
    from pathlib import Path

    import torch

    settings.validate()
    if model is None:
        from looplm.data import get_tokenizer
        from looplm.model.checkpoint import load_checkpoint

        model, cfg, _ = load_checkpoint(settings.checkpoint)
        tokenizer = get_tokenizer(cfg.model.tokenizer)
    if not getattr(model, "is_looped", False):
        raise LoopLMError("looplm serve needs a looped model (recurrence != unshared)")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.slide > model.config.context:
        raise LoopLMError(f"slide={settings.slide} must be in [1, context={model.config.context}]")
    gate = getattr(getattr(model, "recurrence", None), "exit_probability", None)
    if settings.halt == "gate" and gate is None:
        raise LoopLMError(
            "--halt gate needs a model with a learned exit gate (Ouro's); this one has none; "
            "allowed: none, kl, maxtoken"
        )
    loops = settings.loops or (cfg.train.depth_max if cfg is not None else 8)
    if loops > settings.max_loops:
        raise LoopLMError(f"loops={loops} is above max_loops={settings.max_loops}")
    name = settings.model_name or Path(settings.checkpoint or "looplm").resolve().name
    metrics = Metrics()
    scheduler = Scheduler(
        model,
        slots=settings.slots,
        max_queue=settings.max_queue,
        slide=settings.slide,
        eot_id=tokenizer.eot_id,
        metrics=metrics,
        schedule=settings.schedule,
        prefill_chunk=settings.prefill_chunk,
    )
    return ServerState(settings, model, tokenizer, name, loops, scheduler, metrics)


class Server:
    """uvicorn serving the app; SIGTERM / SIGINT first mark the state draining (new requests get
    503, /health says so), then uvicorn stops accepting connections and waits up to
    ``drain_timeout`` for the requests in flight."""

    def __init__(self, state: ServerState) -> None:
        import uvicorn

        s = state.settings
        self.state = state
        config = uvicorn.Config(
            build_app(state),
            host=s.host,
            port=s.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
            # the server cuts its own calls at drain_timeout (each stream ends with an error
            # event); uvicorn's own cancellation, later, only catches a connection that hangs
            timeout_graceful_shutdown=s.drain_timeout + DRAIN_GRACE_S,
        )
        outer = self

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                outer.drain(first=not outer.state.draining)
                self.should_exit = True
                if sig == signal.SIGINT:  # Ctrl-C: the command reports "interrupted"
                    outer.interrupted = True

        self.interrupted = False
        self.uvicorn = _Uvicorn(config)

    def drain(self, first: bool = True) -> None:
        """The first stop request drains (new requests 503; the calls in flight are cut with an
        error event at drain_timeout); a second one cuts them now."""
        state = self.state
        state.draining = True
        if not first:
            state.cut_calls("the server was stopped (a second stop signal); the answer is cut")
            return
        if state.loop is not None:
            why = (
                f"the server is stopping and this answer took longer than drain_timeout="
                f"{state.settings.drain_timeout:g} s; the answer is cut"
            )
            delay = state.settings.drain_timeout
            try:
                state.loop.call_soon_threadsafe(
                    lambda: state.loop.call_later(delay, state.cut_calls, why)
                )
            except RuntimeError:  # the loop is closed
                pass

    @property
    def port(self) -> int:
        """The bound port (after start; the real one when settings.port is 0)."""
        return self.uvicorn.servers[0].sockets[0].getsockname()[1]

    def run(self, on_ready=None) -> None:
        """Serve until SIGTERM/SIGINT (or :meth:`stop`); ``on_ready(port)`` once listening."""
        if on_ready is None:
            self.uvicorn.run()
            return
        import asyncio as _asyncio

        async def main() -> None:
            task = _asyncio.ensure_future(self.uvicorn.serve())
            while not self.uvicorn.started and not task.done():
                await _asyncio.sleep(0.02)
            if self.uvicorn.started:
                on_ready(self.port)
            await task

        _asyncio.run(main())

    def stop(self) -> None:
        """Drain and stop, as SIGTERM does."""
        self.drain(first=not self.state.draining)
        self.uvicorn.should_exit = True
