"""The server's settings: one dataclass; ``looplm serve``'s options are made from it
(:mod:`looplm.settings.options`), its ranges checked by the settings machinery, each field
documented by the comment on its line."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from looplm.errors import LoopLMError
from looplm.model.halting_rules import RENAMED, RuleNames
from looplm.settings import check_fields, setting

# halt values a request may send: none and the decoding rules of looplm.model.halting_rules (kl,
# update, gate), plus maxtoken, update's old name (accepted for one release)
HALT_NAMES = RuleNames(extra=("none",), suffix=tuple(RENAMED), decoding=True)
CHAT_TEMPLATES = ("none", "plain")


@dataclass
class ServeSettings:
    """``looplm serve CHECKPOINT``: where it listens, its defaults and its limits."""

    # checkpoint folder to serve (e.g. runs/x/ckpt; the command line's positional argument)
    checkpoint: str = setting("", cli=False)
    host: str = "127.0.0.1"  # address to listen on (loopback by default; 0.0.0.0 exposes it)
    port: int = setting(8000, lo=0, hi=65535)  # TCP port (0: any free port, printed at start)
    model_name: str = ""  # the model id in /v1/models and responses (default: the folder name)
    # sequences decoded together; memory is bounded by slots x context
    slots: int = setting(8, lo=1, hi=4096)
    # continuous (token-level: one decoding pass per token boundary) | loop (loop-level: every
    # sequence at its own loop step, see docs/serving.md)
    schedule: str = setting("continuous", choices=("continuous", "loop"))
    # --schedule loop: prompt tokens prefilled per chunk beside decoding
    prefill_chunk: int = setting(32, lo=1, hi=1_000_000)
    # requests waiting for a slot; one more is answered 429 with Retry-After
    max_queue: int = setting(64, lo=0, hi=1_000_000)
    # default loop depth T of a request (0: the checkpoint's training depth)
    loops: int = setting(0, lo=0, hi=10_000)
    # the largest loop depth accepted (a request asking for more is answered 400)
    max_loops: int = setting(64, lo=1, hi=10_000)
    # default halting rule: none | kl | update | gate (Ouro's); maxtoken: the old name of update
    halt: str = setting("none", choices=HALT_NAMES)
    threshold: float = setting(0.0, lo=0)  # default halting threshold (0 never halts)
    prefill_halt: bool = False  # default: prompt tokens halt by the same rule too
    # default number of tokens to generate when a request gives none
    max_tokens: int = setting(256, lo=1, hi=1_000_000)
    # largest max_tokens a request may ask for
    max_tokens_limit: int = setting(2048, lo=1, hi=1_000_000)
    max_n: int = setting(4, lo=1, hi=128)  # largest n (completions per request)
    max_logprobs: int = setting(5, lo=0, hi=100)  # largest logprobs (alternatives per token)
    # tokens the window advances when generation passes the context
    slide: int = setting(1, lo=1, hi=1_000_000)
    # seconds a request may take, queue wait included (then 504)
    request_timeout: float = setting(120.0, lo=0)
    drain_timeout: float = setting(
        30.0, lo=0
    )  # on SIGTERM, seconds in-flight requests get to finish
    # chat prompt format: none (chat answers 400) | plain (documented User:/Assistant: turns)
    chat_template: str = setting("none", choices=CHAT_TEMPLATES)
    threads: int = setting(0, lo=0, hi=1024)  # torch CPU threads (0: torch's default)

    def validate(self) -> None:
        """Ranges and choices (the settings machinery's checks, for an instance built directly
        in Python too), then what relates two fields; a :class:`LoopLMError` naming the setting."""
        check_fields(self)
        try:
            ipaddress.ip_address(self.host)
        except ValueError:
            if self.host != "localhost":
                raise LoopLMError(f"host={self.host!r} is not an IP address") from None
        if self.max_tokens > self.max_tokens_limit:
            raise LoopLMError(
                f"max_tokens={self.max_tokens} is above max_tokens_limit={self.max_tokens_limit}"
            )
        if self.request_timeout <= 0:
            raise LoopLMError(f"request_timeout={self.request_timeout!r} must be > 0")
