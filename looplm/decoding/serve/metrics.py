"""What the server counts, in the Prometheus text format (``GET /metrics``).

Counters only grow; gauges are read when scraped. The scheduler thread writes the token counters
and the event loop the request counters — each counter has one writer, so no lock is needed."""

from __future__ import annotations

import collections
import time
from dataclasses import dataclass, field

RATE_WINDOW = 10.0  # seconds over which tokens/s is measured


@dataclass
class Metrics:
    """The server's counters (see :func:`render` for their Prometheus names)."""

    requests: collections.Counter = field(default_factory=collections.Counter)  # (route, status)
    prompt_tokens: int = 0
    generated_tokens: int = 0
    loop_steps: int = 0  # sum over generated tokens of the loop depth that chose each
    halted_tokens: collections.Counter = field(default_factory=collections.Counter)  # rule -> n
    cancelled: int = 0  # sequences ended early (stop string, disconnect, timeout)
    rejected_full: int = 0  # requests answered 429 (queue full)
    _recent: collections.deque = field(default_factory=collections.deque)  # (time, tokens)

    def request(self, route: str, status: int) -> None:
        self.requests[(route, status)] += 1

    def token(self, depth: int, loops: int, rule: str) -> None:
        """One generated token chosen at loop ``depth`` of the ceiling ``loops``."""
        self.generated_tokens += 1
        self.loop_steps += depth
        if depth < loops:
            self.halted_tokens[rule] += 1
        now = time.monotonic()
        self._recent.append(now)
        while self._recent and self._recent[0] < now - RATE_WINDOW:
            self._recent.popleft()

    def tokens_per_second(self) -> float:
        """Generated tokens per second over the last ``RATE_WINDOW`` seconds."""
        now = time.monotonic()
        recent = [t for t in list(self._recent) if t >= now - RATE_WINDOW]
        return len(recent) / RATE_WINDOW

    # long: one row per exported metric (name, type, help, samples), formatted one field a line
    def render(self, *, queued: int, running: int, slots: int, draining: bool) -> str:
        """The Prometheus exposition text: ``# HELP``, ``# TYPE`` and the samples of each."""
        mean = self.loop_steps / self.generated_tokens if self.generated_tokens else 0.0
        reqs = sorted(self.requests.items())
        halted = sorted(self.halted_tokens.items())
        table = [  # (name, type, help, [(labels, value)])
            (
                "requests_total",
                "counter",
                "HTTP requests answered, by route and status code.",
                [(f'{{route="{r}",status="{s}"}}', n) for (r, s), n in reqs] or [("", 0)],
            ),
            ("queue_depth", "gauge", "Sequences waiting for a slot.", [("", queued)]),
            ("running", "gauge", "Sequences in the running batch.", [("", running)]),
            ("slots", "gauge", "Sequences the batch may hold.", [("", slots)]),
            ("draining", "gauge", "1 after SIGTERM: new requests refused.", [("", int(draining))]),
            (
                "prompt_tokens_total",
                "counter",
                "Prompt tokens admitted.",
                [("", self.prompt_tokens)],
            ),
            (
                "generated_tokens_total",
                "counter",
                "Tokens generated.",
                [("", self.generated_tokens)],
            ),
            (
                "tokens_per_second",
                "gauge",
                f"Tokens generated per second over the last {RATE_WINDOW:g} s.",
                [("", round(self.tokens_per_second(), 3))],
            ),
            (
                "loop_steps_total",
                "counter",
                "Loop steps that chose the generated tokens (sum of per-token depths).",
                [("", self.loop_steps)],
            ),
            (
                "mean_loops_per_token",
                "gauge",
                "Mean loop depth per generated token since the start.",
                [("", round(mean, 4))],
            ),
            (
                "halted_tokens_total",
                "counter",
                "Generated tokens a halting rule stopped before the loop ceiling, by rule.",
                [(f'{{rule="{r}"}}', n) for r, n in halted] or [('{rule="none"}', 0)],
            ),
            (
                "cancelled_total",
                "counter",
                "Sequences ended early (stop string, client gone, timeout).",
                [("", self.cancelled)],
            ),
            (
                "rejected_total",
                "counter",
                "Requests refused with 429 (queue full).",
                [("", self.rejected_full)],
            ),
        ]
        out: list[str] = []
        for name, kind, help_, samples in table:
            out += [f"# HELP looplm_{name} {help_}", f"# TYPE looplm_{name} {kind}"]
            out += [f"looplm_{name}{labels} {value:g}" for labels, value in samples]
        return "\n".join(out) + "\n"
