"""A request's way through the server: its checks against the server's limits (each a 400
naming the field and the allowed range, before anything is queued), its sequences in the
scheduler (:class:`Call`: one asyncio queue of events per HTTP request, text decoded as tokens
arrive, stop strings cut and cancel), and the response's pieces (usage, logprobs, depths)."""

from __future__ import annotations

import asyncio
import secrets
import time
from dataclasses import dataclass, field
from typing import Any

from looplm.decoding.batching import Request
from looplm.decoding.serve.metrics import Metrics
from looplm.decoding.serve.scheduler import Depth, Job, QueueFull, Scheduler
from looplm.decoding.serve.schemas import ApiError, ChatRequest, check_neutral, check_range
from looplm.decoding.serve.settings import ServeSettings
from looplm.model.halting_rules import RENAMED

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
    calls: set = field(default_factory=set)  # the calls in flight (cut at a second signal)
    loop: Any = None  # the event loop serving the app (set while it runs)
    created: int = field(default_factory=lambda: int(time.time()))

    @property
    def context(self) -> int:
        return self.model.config.context

    def cut_calls(self, why: str) -> None:
        """End every call in flight with an error event (safe from any thread or a signal
        handler: the work is scheduled on the event loop)."""

        def cut() -> None:
            for call in list(self.calls):
                call.cut(why)

        if self.loop is not None:
            try:
                self.loop.call_soon_threadsafe(cut)
            except RuntimeError:  # the loop is closed: nothing is in flight
                pass


# ====================================================================== request → sequences
@dataclass
class Choice:
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
    seed: int = 0  # the seed this sequence was sampled with
    fixed_ids: int = 0  # tokens whose text is settled (ends at a complete character) ...
    fixed_text: str = ""  # ... and that text


class Call:
    """One HTTP request's sequences in the scheduler, and their events."""

    def __init__(
        self,
        state: ServerState,
        choices: list[Choice],
        requests: list[Request],
        depth: Depth,
        echo_logprobs: int | None,
    ) -> None:
        self.state, self.choices = state, choices
        self.events: asyncio.Queue = asyncio.Queue()
        self.deadline = time.monotonic() + state.settings.request_timeout
        self.jobs = [
            Job(c.key, r, depth, self._sink(i), echo_logprobs)
            for i, (c, r) in enumerate(zip(choices, requests))
        ]
        self.eot = state.tokenizer.eot_id
        self.max_stop = max((len(s) for c in choices for s in c.stops), default=0)

    def _sink(self, i: int):
        def put(event: tuple) -> None:  # on the event loop (the app's deliver, below)
            self.events.put_nowait((i, event))

        return put

    def submit(self) -> None:
        try:
            self.state.scheduler.submit(self.jobs)
            self.state.calls.add(self)
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
        self.state.calls.discard(self)
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
                self._update_text(c)
        elif kind == "error":
            self.cancel_unfinished()
            raise ApiError(500, event[1], type_="server_error")
        elif kind == "cut":  # the server stops now (a second signal, or past drain_timeout)
            self.cancel_unfinished()
            raise ApiError(503, event[1], type_="unavailable")
        return i

    def cut(self, why: str) -> None:
        """End this call with an error now (on the event loop)."""
        self.events.put_nowait((0, ("cut", why)))

    def _update_text(self, c: Choice) -> None:
        """``c.text`` after a new token: only the tokens since the last complete character are
        decoded (a byte-level tokenizer's text splits there), so a token costs O(1), not O(n)."""
        ids = c.tokens[:-1] if c.tokens and c.tokens[-1] == self.eot else c.tokens
        tail = self.state.tokenizer.decode(ids[c.fixed_ids :])
        text = c.fixed_text + tail
        if not tail.endswith("\ufffd"):
            c.fixed_ids, c.fixed_text = len(ids), text
        for s in c.stops:
            at = text.find(s, max(0, len(c.text) - len(s) - 4))  # 4: a character completed
            if at >= 0:
                text = text[:at]
                if c.finish is None:
                    c.finish = "stop"
                    self.state.scheduler.cancel(c.key)  # the slot is freed at the next token
        c.text = text

    def stream_delta(self, c: Choice) -> str:
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
def request_depth(state: ServerState, req) -> Depth:
    s = state.settings
    loops = state.default_loops if req.loops is None else req.loops
    check_range("loops", loops, 1, s.max_loops)
    halt = s.halt if req.halt is None else req.halt
    rule = RENAMED.get(halt, halt)  # an old name of a rule: its new one
    threshold = s.threshold if req.threshold is None else req.threshold
    check_range("threshold", threshold, 0, float("inf"))
    prefill = s.prefill_halt if req.prefill_halt is None else req.prefill_halt
    gate = getattr(getattr(state.model, "recurrence", None), "exit_probability", None)
    allowed = ", ".join(["none", "kl", "maxtoken"] + ["gate"] * (gate is not None))
    if rule == "gate" and gate is None:
        raise ApiError(
            400, f"halt=gate needs a model with a learned exit gate (Ouro); allowed: {allowed}",
            "halt",
        )  # fmt: skip
    if rule == "gate" and threshold > 1:
        raise ApiError(400, f"threshold={threshold!r}: a gate threshold is in [0, 1]", "threshold")
    if rule == "none":
        threshold, prefill = 0.0, False
    return Depth(loops, rule, float(threshold), bool(prefill))


def request_sampling(state: ServerState, req) -> dict[str, Any]:
    s = state.settings
    check_neutral(req)
    name, max_tokens = "max_tokens", req.max_tokens
    if getattr(req, "max_completion_tokens", None) is not None:  # chat's newer name wins
        name, max_tokens = "max_completion_tokens", req.max_completion_tokens
    max_tokens = s.max_tokens if max_tokens is None else max_tokens
    check_range(name, max_tokens, 1, s.max_tokens_limit)
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
        # no seed: a fresh one, reported in the answer so that the sample can be repeated
        seed=secrets.randbelow(2**31) if req.seed is None else req.seed,
        stops=stops,
    )


def check_model(state: ServerState, name: str | None) -> None:
    if name is not None and name != state.model_name:
        raise ApiError(
            404,
            f"model {name!r} is not served here; allowed: {state.model_name}",
            "model",
            type_="invalid_request_error",
            code="model_not_found",
        )


def prompt_ids(state: ServerState, prompt) -> list[tuple[tuple[int, ...], str]]:
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


def chat_prompt(state: ServerState, req: ChatRequest) -> tuple[str, list[str]]:
    """(prompt text, extra stop strings) of a chat request."""
    messages = []
    for i, m in enumerate(req.messages):
        content = m.content
        if not isinstance(content, str):  # OpenAI's content parts: text only
            for j, part in enumerate(content):
                if part.get("type") != "text" or not isinstance(part.get("text"), str):
                    kind = part.get("type")
                    what = f"a {kind!r} part is not served" if kind != "text" else "bad part"
                    raise ApiError(
                        400,
                        f"messages.{i}.content.{j}: {what}; allowed: "
                        "{'type': 'text', 'text': ...}",
                        f"messages.{i}.content.{j}",
                    )
            content = "".join(part["text"] for part in content)
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


def depths_field(c: Choice) -> dict[str, Any]:
    mean = sum(c.loops) / len(c.loops) if c.loops else None
    return {"tokens": c.tokens, "loops": c.loops, "mean_loops": mean, "seed": c.seed}


def usage_field(call: Call, n_prompt: int, n_new: int) -> dict[str, Any]:
    loops = [d for c in call.choices for d in c.loops]
    return {
        "prompt_tokens": n_prompt,
        "completion_tokens": n_new,
        "total_tokens": n_prompt + n_new,
        "mean_loops": sum(loops) / len(loops) if loops else None,
    }


def logprobs_field(tok, c: Choice, echo: bool) -> dict[str, Any]:
    """OpenAI's completions ``logprobs`` object (tokens, token_logprobs, top_logprobs,
    text_offset); with ``echo`` the prompt's tokens come first (the first has no logprob)."""
    ids, lps, tops = [], [], []
    if echo:
        ids = list(c.prompt_ids)
        lps = [None] + [lp for lp, _ in c.prompt_logprobs or []]
        tops = [None] + [top_field(tok, alts) for _, alts in c.prompt_logprobs or []]
    ids += c.tokens
    lps += c.logprobs
    tops += [top_field(tok, alts) for alts in c.top] if c.top else [None] * len(c.tokens)
    strings = [tok.decode([i]) for i in ids]
    offsets, at = [], 0
    for s in strings:
        offsets.append(at)
        at += len(s)
    return {"tokens": strings, "token_logprobs": lps, "top_logprobs": tops, "text_offset": offsets}


def top_field(tok, alts: list[tuple[int, float]]) -> dict[str, float] | None:
    if not alts:
        return None
    out: dict[str, float] = {}
    for i, lp in alts:
        out.setdefault(tok.decode([i]), lp)
    return out
