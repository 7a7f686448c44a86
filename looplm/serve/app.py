"""The HTTP side of ``looplm serve``: a Starlette app on uvicorn speaking OpenAI's API.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (both streaming as server-sent
events with ``"stream": true``), ``GET /v1/models``, ``GET /health``, ``GET /metrics``
(Prometheus text), and the vLLM-style ``GET /tokenizer_info``, ``POST /tokenize``,
``POST /detokenize`` through which lm-evaluation-harness's ``local-completions`` model uses the
server's own tokenizer.

A request is checked completely (:mod:`looplm.serve.schemas`) before any of it is queued; its
sequences (``n`` per prompt) then go to the :class:`~looplm.serve.scheduler.Scheduler` together
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
from dataclasses import dataclass, field
from typing import Any

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request as HTTPRequest
from starlette.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.routing import Route

from looplm.batching import Request
from looplm.errors import LoopLMError
from looplm.serve.metrics import Metrics
from looplm.serve.scheduler import Depth, Job, QueueFull, Scheduler
from looplm.serve.schemas import (
    ApiError,
    ChatRequest,
    CompletionRequest,
    DetokenizeRequest,
    TokenizeRequest,
    check_neutral,
    check_range,
    parse_body,
)
from looplm.serve.settings import ServeSettings

log = logging.getLogger("looplm.serve")

MAX_BODY = 8 << 20  # bytes of one request body
MAX_STOPS = 4  # stop strings per request (OpenAI's limit)
MAX_PROMPTS = 64  # prompts in one /v1/completions request
PLAIN_STOP = "\nUser:"  # the plain chat template's turn marker: the model's reply ends before it


def plain_chat_prompt(messages: list[dict[str, str]]) -> str:
    """The documented plain template: ``"<Role>: <content>\\n\\n"`` per message, then
    ``"Assistant:"`` (the reply is generated after it and ends at ``"\\nUser:"``)."""
    turns = [f"{m['role'].capitalize()}: {m['content']}\n\n" for m in messages]
    return "".join(turns) + "Assistant:"


@dataclass
class ServerState:
    """Everything the routes share."""

    settings: ServeSettings
    model: Any
    tokenizer: Any
    model_name: str
    default_loops: int
    scheduler: Scheduler
    metrics: Metrics = field(default_factory=Metrics)
    draining: bool = False
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.model.config.context


# ====================================================================== request → sequences
@dataclass
class _Choice:
    """One sequence of a request as it comes back: tokens, depths, text so far."""

    index: int
    key: int
    prompt_ids: tuple[int, ...]
    prompt_text: str
    stops: list[str]
    tokens: list[int] = field(default_factory=list)
    loops: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    top: list[list[tuple[int, float]]] = field(default_factory=list)
    prompt_logprobs: list | None = None
    text: str = ""  # the completion text (cut before a stop string)
    sent: int = 0  # characters of ``text`` already streamed
    sent_tokens: int = 0  # tokens already streamed
    finish: str | None = None


class _Call:
    """One HTTP request's sequences in the scheduler, and their events."""

    def __init__(
        self,
        state: ServerState,
        choices: list[_Choice],
        requests: list[Request],
        depth: Depth,
        echo_logprobs: int | None,
    ) -> None:
        self.state, self.choices = state, choices
        self.loop = asyncio.get_running_loop()
        self.events: asyncio.Queue = asyncio.Queue()
        self.deadline = time.monotonic() + state.settings.request_timeout
        self.jobs = [
            Job(c.key, r, depth, self._sink(i), echo_logprobs)
            for i, (c, r) in enumerate(zip(choices, requests))
        ]
        self.eot = state.tokenizer.eot_id
        self.max_stop = max((len(s) for c in choices for s in c.stops), default=0)

    def _sink(self, i: int):
        def put(event: tuple) -> None:  # called on the scheduler thread
            try:
                self.loop.call_soon_threadsafe(self.events.put_nowait, (i, event))
            except RuntimeError:  # the event loop is gone (shutdown)
                pass

        return put

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.jobs)
        except QueueFull:
            self.state.metrics.rejected_full += 1
            s = self.state.settings
            raise ApiError(
                429,
                f"the server is full ({s.slots} running, {s.max_queue} waiting); retry later",
                type_="rate_limit_exceeded",
                headers={"Retry-After": "1"},
            ) from None

    def cancel_unfinished(self) -> None:
        for c in self.choices:
            if c.finish is None:
                self.state.scheduler.cancel(c.key)

    @property
    def done(self) -> bool:
        return all(c.finish is not None for c in self.choices)

    async def next(self) -> int:
        """Apply the next event; returns the choice it touched. Raises ApiError(504) past the
        deadline, ApiError(500) when the scheduler failed the sequence."""
        left = self.deadline - time.monotonic()
        try:
            i, event = await asyncio.wait_for(self.events.get(), timeout=max(left, 0.0))
        except asyncio.TimeoutError:
            self.cancel_unfinished()
            raise ApiError(
                504,
                f"the request took longer than request_timeout="
                f"{self.state.settings.request_timeout:g} s",
                type_="timeout",
            ) from None
        c = self.choices[i]
        kind = event[0]
        if kind == "prompt_logprobs":
            c.prompt_logprobs = event[1]
        elif kind == "token" and c.finish is None:
            c.tokens.append(event[1])
            c.loops.append(event[2])
            self._update_text(c)
        elif kind == "done":
            out = event[1]
            n = len(c.tokens)  # tokens after a stop string were dropped
            c.logprobs, c.top = out.logprobs[:n], out.top_logprobs[:n]
            if c.finish is None:
                c.finish = "stop" if out.finish in ("stop", "cancelled") else "length"
                self._update_text(c, final=True)
        elif kind == "error":
            self.cancel_unfinished()
            raise ApiError(500, event[1], type_="server_error")
        return i

    def _update_text(self, c: _Choice, final: bool = False) -> None:
        ids = c.tokens[:-1] if c.tokens and c.tokens[-1] == self.eot else c.tokens
        text = self.state.tokenizer.decode(ids)
        for s in c.stops:
            at = text.find(s)
            if at >= 0:
                text = text[:at]
                if c.finish is None:
                    c.finish = "stop"
                    self.state.scheduler.cancel(c.key)  # the slot is freed at the next token
        c.text = text

    def stream_delta(self, c: _Choice) -> str:
        """Text of ``c`` safe to send now: held back while it may still become a stop string or
        ends in an incomplete UTF-8 character."""
        end = len(c.text)
        if c.finish is None:
            end -= max(self.max_stop - 1, 0)
            while end > c.sent and c.text[end - 1] == "\ufffd" and len(c.text) - end < 4:
                end -= 1
        if end <= c.sent:
            return ""
        out = c.text[c.sent : end]
        c.sent = end
        return out


# ====================================================================== checks
def _depth(state: ServerState, req) -> Depth:
    s = state.settings
    loops = state.default_loops if req.loops is None else req.loops
    check_range("loops", loops, 1, s.max_loops)
    halt = s.halt if req.halt is None else req.halt
    rule = "maxtoken" if halt == "update" else halt
    threshold = s.threshold if req.threshold is None else req.threshold
    check_range("threshold", threshold, 0, float("inf"))
    prefill = s.prefill_halt if req.prefill_halt is None else req.prefill_halt
    if rule == "kl" and threshold > 0 and len(getattr(state.model, "coda", ())):
        raise ApiError(
            400,
            "halt=kl is not served for this model (it has coda layers); allowed: none, update",
            "halt",
        )
    if rule == "none":
        threshold, prefill = 0.0, False
    return Depth(loops, rule, float(threshold), bool(prefill))


def _sampling(state: ServerState, req) -> dict[str, Any]:
    s = state.settings
    check_neutral(req)
    max_tokens = getattr(req, "max_completion_tokens", None) or req.max_tokens
    max_tokens = s.max_tokens if max_tokens is None else max_tokens
    check_range("max_tokens", max_tokens, 1, s.max_tokens_limit)
    temperature = 1.0 if req.temperature is None else req.temperature
    check_range("temperature", temperature, 0, 100)
    top_k = None if req.top_k in (None, -1) else req.top_k
    if top_k is not None:
        check_range("top_k", top_k, 1, state.model.config.vocab_size)
    check_range("n", req.n, 1, s.max_n)
    if req.seed is not None:
        check_range("seed", req.seed, 0, 2**63 - 1 - s.max_n)
    stops = [req.stop] if isinstance(req.stop, str) else list(req.stop or [])
    if len(stops) > MAX_STOPS or any(not x for x in stops):
        raise ApiError(400, f"stop must hold 1 to {MAX_STOPS} non-empty strings", "stop")
    return dict(
        max_new=max_tokens,
        temperature=float(temperature),
        top_k=top_k,
        seed=req.seed or 0,
        stops=stops,
    )


def _check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(
            404,
            f"model {name!r} is not served here; allowed: {state.model_name}",
            "model",
            type_="invalid_request_error",
            code="model_not_found",
        )


def _prompt_ids(state: ServerState, prompt) -> list[tuple[tuple[int, ...], str]]:
    """(token ids, text) of each prompt of a completions request."""
    tok, vocab = state.tokenizer, state.model.config.vocab_size
    if isinstance(prompt, str) or (prompt and isinstance(prompt[0], int)):
        prompt = [prompt]
    if not prompt:
        raise ApiError(400, "prompt is empty; send at least one token of text", "prompt")
    if len(prompt) > MAX_PROMPTS:
        raise ApiError(
            400, f"prompt holds {len(prompt)} prompts; allowed: [1, {MAX_PROMPTS}]", "prompt"
        )
    out = []
    for p in prompt:
        if isinstance(p, str):
            ids = tok.encode(p)
            text = p
        else:
            bad = [i for i in p if not 0 <= i < vocab]
            if bad:
                raise ApiError(
                    400,
                    f"prompt token id {bad[0]} is outside the vocabulary; "
                    f"allowed: [0, {vocab - 1}]",
                    "prompt",
                )
            ids, text = list(p), tok.decode(p)
        out.append((tuple(ids), text))
    for ids, _ in out:
        if not ids:
            raise ApiError(400, "prompt is empty; send at least one token of text", "prompt")
        if len(ids) > state.context:
            raise ApiError(
                400,
                f"the prompt is {len(ids)} tokens; allowed: [1, {state.context}] "
                "(the model's context)",
                "prompt",
            )
    return out


def _chat_prompt(state: ServerState, req: ChatRequest) -> tuple[str, list[str]]:
    """(prompt text, extra stop strings) of a chat request."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if not isinstance(content, str):  # OpenAI's content parts: text only
            try:
                content = "".join(p["text"] for p in content if p.get("type") == "text")
            except (KeyError, TypeError):
                raise ApiError(
                    400,
                    f"messages.{i}.content parts must be {{'type': 'text', 'text': ...}}",
                    f"messages.{i}.content",
                ) from None
        messages.append({"role": m.role, "content": content})
    if not messages:
        raise ApiError(400, "messages is empty; send at least one message", "messages")
    template = getattr(state.tokenizer, "chat_template", None)
    if template:
        from jinja2.sandbox import ImmutableSandboxedEnvironment

        text = (
            ImmutableSandboxedEnvironment()
            .from_string(template)
            .render(messages=messages, add_generation_prompt=True, eos_token="<|endoftext|>")
        )
        return text, []
    if state.settings.chat_template == "plain":
        return plain_chat_prompt(messages), [PLAIN_STOP]
    raise ApiError(
        400,
        "this model's tokenizer has no chat template; use /v1/completions, or "
        "start the server with --chat-template plain (documented in docs/serving.md)",
        "messages",
    )


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
    _check_model(state, req.model)
    samp = _sampling(state, req)
    depth = _depth(state, req)
    stops = samp.pop("stops")
    echo = False
    logprobs = None
    if chat:
        if req.logprobs or req.top_logprobs:
            raise ApiError(
                400, "logprobs are served by /v1/completions only; allowed: false", "logprobs"
            )
        text, extra = _chat_prompt(state, req)
        prompts = _prompt_ids(state, text)
        stops = stops + [s for s in extra if s not in stops]
    else:
        prompts = _prompt_ids(state, req.prompt)
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
            choices.append(_Choice(len(choices), state.scheduler.new_key(), ids, text, stops))
            requests.append(r)
    call = _Call(
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


async def _whole(request, call: _Call, head, kind, chat, echo, logprobs, n_prompt) -> Response:
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
    work.result()  # ApiError (timeout, scheduler fault) surfaces here
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
            item["logprobs"] = _logprobs(tok, c, echo) if logprobs is not None else None
        item["looplm"] = _depths(c)
        out.append(item)
    n_new = sum(len(c.tokens) for c in call.choices)
    body = dict(head, object=kind, choices=out, usage=_usage(call, n_prompt, n_new))
    return JSONResponse(body)


def _depths(c: _Choice) -> dict[str, Any]:
    mean = sum(c.loops) / len(c.loops) if c.loops else None
    return {"tokens": c.tokens, "loops": c.loops, "mean_loops": mean}


def _usage(call: _Call, n_prompt: int, n_new: int) -> dict[str, Any]:
    loops = [d for c in call.choices for d in c.loops]
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_new,
        "total_tokens": n_prompt + n_new,
        "mean_loops": sum(loops) / len(loops) if loops else None,
    }


def _logprobs(tok, c: _Choice, echo: bool) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset); with ``echo`` the prompt's tokens come first (the first has no logprob)."""
    ids, lps, tops = [], [], []
    if echo:
        ids = list(c.prompt_ids)
        lps = [None] + [lp for lp, _ in c.prompt_logprobs or []]
        tops = [None] + [_top(tok, alts) for _, alts in c.prompt_logprobs or []]
    ids += c.tokens
    lps += c.logprobs
    tops += [_top(tok, alts) for alts in c.top] if c.top else [None] * len(c.tokens)
    strings = [tok.decode([i]) for i in ids]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def _top(tok, alts: list[tuple[int, float]]) -> dict[str, float] | None:
    if not alts:
        return None
    out: dict[str, float] = {}
    for i, lp in alts:
        out.setdefault(tok.decode([i]), lp)
    return out


async def _stream(call: _Call, head, kind, chat, usage, n_prompt):
    """Server-sent events: one chunk per token with new text, then ``data: [DONE]``."""
    obj = kind + ".chunk" if chat else kind

    def chunk(c: _Choice, text: str, finish: str | None, first: bool = False) -> str:
        new = c.tokens[c.sent_tokens :]
        depths = c.loops[c.sent_tokens :]
        c.sent_tokens = len(c.tokens)
        if chat:
            delta = {"role": "assistant", "content": text} if first else {"content": text}
            choice = {"index": c.index, "delta": delta, "logprobs": None, "finish_reason": finish}
        else:
            choice = {"index": c.index, "text": text, "logprobs": None, "finish_reason": finish}
        choice["looplm"] = {"tokens": new, "loops": depths}
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
                        dict(head, object=obj, choices=[], usage=_usage(call, n_prompt, n_new))
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
        state.scheduler.start()
        try:
            yield
        finally:
            state.scheduler.stop()

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


def load_state(settings: ServeSettings, model=None, tokenizer=None, cfg=None) -> ServerState:
    """The server's state from a checkpoint (or an already loaded model, tokenizer, config)."""
    from pathlib import Path

    import torch

    settings.validate()
    if model is None:
        from looplm.checkpoint import load_checkpoint
        from looplm.data import get_tokenizer

        model, cfg, _ = load_checkpoint(settings.checkpoint)
        tokenizer = get_tokenizer(cfg.model.tokenizer)
    if not getattr(model, "is_looped", False):
        raise LoopLMError("looplm serve needs a looped model (recurrence != unshared)")
    if settings.threads:
        torch.set_num_threads(settings.threads)
    if settings.slide > model.config.context:
        raise LoopLMError(f"slide={settings.slide} must be in [1, context={model.config.context}]")
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
            timeout_graceful_shutdown=s.drain_timeout,
        )
        outer = self

        class _Uvicorn(uvicorn.Server):
            def handle_exit(self, sig, frame) -> None:
                outer.state.draining = True
                super().handle_exit(sig, frame)
                if sig == signal.SIGTERM and sig in self._captured_signals:
                    self._captured_signals.remove(sig)  # a drained SIGTERM is a clean stop: exit 0

        self.uvicorn = _Uvicorn(config)

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
        self.state.draining = True
        self.uvicorn.should_exit = True
