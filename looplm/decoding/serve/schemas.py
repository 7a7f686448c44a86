"""Request bodies of the OpenAI-compatible routes, and their checks.

A body is parsed strictly (:mod:`pydantic`, ``extra="forbid"``): an unknown field or a value of
the wrong type is a 400 naming the field. Ranges are then checked against the server's limits
(:class:`~looplm.decoding.serve.settings.ServeSettings`) before the request is admitted, each with a 400
naming the field and the allowed range. Every error has OpenAI's shape::

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens", "code": null}}

OpenAI fields looplm does not implement are accepted only at their neutral value (``top_p`` 1,
penalties 0, no ``logit_bias``, no ``suffix``, ``best_of`` equal to ``n``), so a client that sends
the defaults works and one that relies on them hears so.
"""

from __future__ import annotations

import json
import math
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, ValidationError

from looplm.decoding.serve.settings import HALT_NAMES

Prompt = str | list[str] | list[int] | list[list[int]]


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(
        self,
        status: int,
        message: str,
        param: str | None = None,
        type_: str = "invalid_request_error",
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ) -> None:
        super().__init__(message)
        self.status, self.message, self.param = status, message, param
        self.type, self.code, self.headers = type_, code, headers or {}

    def body(self) -> dict[str, Any]:
        return {
            "error": {
                "message": self.message,
                "type": self.type,
                "param": self.param,
                "code": self.code,
            }
        }


class StreamOptions(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    include_usage: bool = False


class _Common(BaseModel):
    """Fields both routes share, with looplm's depth knobs."""

    model_config = ConfigDict(extra="forbid", strict=True)

    model: str | None = None
    max_tokens: int | None = None
    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    n: int = 1
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: str | list[str] | None = None
    seed: int | None = None
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    user: str | None = None
    # looplm: loop depth, halting rule and threshold, prefill halting
    loops: int | None = None
    halt: str | None = None
    threshold: float | None = None
    prefill_halt: bool | None = None


class CompletionRequest(_Common):
    """``POST /v1/completions``."""

    prompt: Prompt
    logprobs: int | None = None
    echo: bool = False
    best_of: int | None = None
    suffix: str | None = None


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[dict[str, Any]]
    name: str | None = None


class ChatRequest(_Common):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessage]
    max_completion_tokens: int | None = None
    logprobs: bool = False
    top_logprobs: int | None = None


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (the vLLM-style route lm-eval's remote tokenizer calls)."""

    model_config = ConfigDict(extra="forbid", strict=True)
    prompt: str
    add_special_tokens: bool = False
    model: str | None = None


class DetokenizeRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)
    tokens: list[int]
    model: str | None = None


_DESCRIBE = {
    "prompt": "a string, a list of strings, a list of token ids or a list of lists of token ids",
    "stop": "a string or a list of strings",
    "content": "a string or a list of text parts",
}


def parse_body(raw: bytes, cls: type[BaseModel]) -> Any:
    """``cls`` from a request body: UTF-8 JSON holding an object with ``cls``'s fields."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise ApiError(
            400, f"the body is not UTF-8 (byte {raw[exc.start]:#04x} at {exc.start})"
        ) from None
    if not text.strip():
        raise ApiError(400, "the body is empty; send a JSON object")
    try:
        data = json.loads(text)
    except json.JSONDecodeError as exc:
        raise ApiError(
            400, f"the body is not JSON ({exc.msg} at line {exc.lineno} column {exc.colno})"
        ) from None
    except RecursionError:
        raise ApiError(400, "the body is not JSON (nested too deeply)") from None
    if not isinstance(data, dict):
        raise ApiError(400, f"the body must be a JSON object, not {type(data).__name__}")
    where = _lone_surrogate(data)
    if where is not None:
        raise ApiError(
            400,
            f"{where} holds a lone UTF-16 surrogate (an unpaired \\ud800-\\udfff escape), which "
            "is not text; send valid Unicode",
            where,
        )
    try:
        return cls.model_validate(data)
    except ValidationError as exc:
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"] if not isinstance(x, str) or x in _field_names(cls, err)]
        field = ".".join(loc) or None
        name = str(err["loc"][0]) if err["loc"] else None
        if err["type"] == "extra_forbidden":
            field = ".".join(str(x) for x in err["loc"])
            allowed = ", ".join(sorted(cls.model_fields))
            raise ApiError(400, f"unknown field {field!r}; allowed: {allowed}", field) from None
        if err["type"] == "missing":
            raise ApiError(400, f"{field} is required", field) from None
        last = str(err["loc"][-1]) if err["loc"] else ""
        what = _DESCRIBE.get(last) or _DESCRIBE.get(name or "")
        if what:
            raise ApiError(400, f"{field} must be {what}", field) from None
        raise ApiError(400, f"{field}: {err['msg']}", field) from None


def _lone_surrogate(value: Any, path: str = "") -> str | None:
    """The field path (``messages.0.content``) of the first string holding a lone surrogate
    (a valid JSON escape that no UTF-8 text can hold), else None."""
    if isinstance(value, str):
        try:
            value.encode("utf-8")
        except UnicodeEncodeError:
            return path or "the body"
        return None
    items = (
        value.items()
        if isinstance(value, dict)
        else enumerate(value)
        if isinstance(value, list)
        else ()
    )
    for key, item in items:
        if isinstance(key, str) and _lone_surrogate(key) is not None:
            return f"{path}.{key!r}".lstrip(".")
        found = _lone_surrogate(item, f"{path}.{key}".lstrip("."))
        if found is not None:
            return found
    return None


def _field_names(cls: type[BaseModel], err: dict) -> set[str]:
    """Names in an error location that are fields (not pydantic's union-branch labels)."""
    names = set(cls.model_fields) | set(ChatMessage.model_fields) | set(StreamOptions.model_fields)
    return names


def check_range(name: str, value: Any, lo: float, hi: float) -> None:
    """A 400 naming ``name`` unless ``lo <= value <= hi``."""
    if isinstance(value, float) and not math.isfinite(value) or not lo <= value <= hi:
        raise ApiError(400, f"{name}={value!r} is out of range; allowed: [{lo:g}, {hi:g}]", name)


def check_neutral(req: _Common | CompletionRequest) -> None:
    """OpenAI fields looplm does not implement must be left at their neutral values."""
    if req.top_p is not None and req.top_p != 1:
        raise ApiError(
            400,
            f"top_p={req.top_p!r}: nucleus sampling is not served; allowed: 1 (use top_k)",
            "top_p",
        )
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(req, name)
        if v not in (None, 0):
            raise ApiError(400, f"{name}={v!r}: penalties are not served; allowed: 0", name)
    if req.logit_bias:
        raise ApiError(400, "logit_bias is not served; allowed: null or {}", "logit_bias")
    if isinstance(req, CompletionRequest):
        if req.suffix:
            raise ApiError(400, "suffix (insertion) is not served; allowed: null", "suffix")
        if req.best_of not in (None, req.n):
            raise ApiError(
                400, f"best_of={req.best_of!r} is not served; allowed: null or n", "best_of"
            )
    if req.halt is not None and req.halt not in HALT_NAMES:
        raise ApiError(400, f"halt={req.halt!r}; allowed: {', '.join(HALT_NAMES[:4])}", "halt")
