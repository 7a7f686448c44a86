"""The server's settings: one dataclass, read by ``looplm serve``'s options and documented from
the comment on each field (:func:`looplm.settings.field_comments`)."""

from __future__ import annotations

import ipaddress
import math
from dataclasses import dataclass

from looplm.errors import LoopLMError

# halt values a request may send: none, kl (KL between successive loops' predictions), update
# (relative hidden update; looplm generate calls it maxtoken, also accepted), gate (a learned exit
# gate's cumulative exit probability: Ouro's)
HALT_NAMES = ("none", "kl", "update", "gate", "maxtoken")
CHAT_TEMPLATES = ("none", "plain")


@dataclass
class ServeSettings:
    """``looplm serve CHECKPOINT``: where it listens, its defaults and its limits."""

    checkpoint: str = ""  # checkpoint folder to serve (e.g. runs/x/ckpt)
    host: str = "127.0.0.1"  # address to listen on (loopback by default; 0.0.0.0 exposes it)
    port: int = 8000  # TCP port (0: any free port, printed at start)
    model_name: str = ""  # the model id in /v1/models and responses (default: the folder name)
    slots: int = 8  # sequences decoded together; memory is bounded by slots x context
    # continuous (token-level: one decoding pass per token boundary) | loop (loop-level: every
    # sequence at its own loop step, see docs/serving.md)
    schedule: str = "continuous"
    prefill_chunk: int = 32  # --schedule loop: prompt tokens prefilled per chunk beside decoding
    max_queue: int = 64  # requests waiting for a slot; one more is answered 429 with Retry-After
    loops: int = 0  # default loop depth T of a request (0: the checkpoint's training depth)
    max_loops: int = 64  # largest loop depth a request may ask for
    halt: str = "none"  # default halting rule: none | kl | update (= maxtoken) | gate (Ouro's)
    threshold: float = 0.0  # default halting threshold (0 never halts)
    prefill_halt: bool = False  # default: prompt tokens halt by the same rule too
    max_tokens: int = 256  # default number of tokens to generate when a request gives none
    max_tokens_limit: int = 2048  # largest max_tokens a request may ask for
    max_n: int = 4  # largest n (completions per request)
    max_logprobs: int = 5  # largest logprobs (alternatives per token)
    slide: int = 1  # tokens the window advances when generation passes the context
    request_timeout: float = 120.0  # seconds a request may take, queue wait included (then 504)
    drain_timeout: float = 30.0  # on SIGTERM, seconds in-flight requests get to finish
    # chat prompt format: none (chat answers 400) | plain (documented User:/Assistant: turns)
    chat_template: str = "none"
    threads: int = 0  # torch CPU threads (0: torch's default)

    def validate(self) -> None:
        """Ranges and choices; a :class:`LoopLMError` naming the setting otherwise."""
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                raise LoopLMError(f"host={self.host!r} is not an IP address") from None
        ints = {
            "port": (self.port, 0, 65535),
            "slots": (self.slots, 1, 4096),
            "max_queue": (self.max_queue, 0, 1_000_000),
            "loops": (self.loops, 0, 10_000),
            "max_loops": (self.max_loops, 1, 10_000),
            "max_tokens": (self.max_tokens, 1, 1_000_000),
            "max_tokens_limit": (self.max_tokens_limit, 1, 1_000_000),
            "max_n": (self.max_n, 1, 128),
            "max_logprobs": (self.max_logprobs, 0, 100),
            "slide": (self.slide, 1, 1_000_000),
            "prefill_chunk": (self.prefill_chunk, 1, 1_000_000),
            "threads": (self.threads, 0, 1024),
        }
        for name, (value, lo, hi) in ints.items():
            if isinstance(value, bool) or not isinstance(value, int) or not lo <= value <= hi:
                raise LoopLMError(f"{name}={value!r} must be an integer in [{lo}, {hi}]")
        if self.max_tokens > self.max_tokens_limit:
            raise LoopLMError(
                f"max_tokens={self.max_tokens} is above max_tokens_limit={self.max_tokens_limit}"
            )
        if self.schedule not in ("continuous", "loop"):
            raise LoopLMError(f"schedule={self.schedule!r}; allowed: continuous, loop")
        if self.halt not in HALT_NAMES:
            raise LoopLMError(f"halt={self.halt!r}; allowed: {', '.join(HALT_NAMES)}")
        if self.chat_template not in CHAT_TEMPLATES:
            raise LoopLMError(
                f"chat_template={self.chat_template!r}; allowed: {', '.join(CHAT_TEMPLATES)}"
            )
        for name in ("threshold", "request_timeout", "drain_timeout"):
            value = getattr(self, name)
            if not (isinstance(value, (int, float)) and math.isfinite(value) and value >= 0):
                raise LoopLMError(f"{name}={value!r} must be a finite number >= 0")
        if self.request_timeout <= 0:
            raise LoopLMError(f"request_timeout={self.request_timeout!r} must be > 0")
