"""`looplm serve CHECKPOINT`: an OpenAI-compatible HTTP server (completions, chat, streaming,
metrics) over continuous batching with per-token adaptive depth. All logic is in
:mod:`looplm.serve`; the options are :class:`~looplm.serve.settings.ServeSettings`' fields."""

from __future__ import annotations

import argparse
import dataclasses
import sys


def register(sub: argparse._SubParsersAction) -> None:
    from looplm.serve.settings import ServeSettings
    from looplm.settings import field_comments

    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over OpenAI's HTTP API (continuous batching, adaptive depth)",
        description="Serve CHECKPOINT at http://HOST:PORT/v1 (completions, chat completions, "
        "streaming, /v1/models, /health, /metrics). Request fields loops, halt, threshold and "
        "prefill_halt choose the depth per request; the options below are the defaults and "
        "limits. SIGTERM drains: in-flight requests finish, new ones get 503. See docs/serving.md.",
    )
    help_ = field_comments(ServeSettings)
    for f in dataclasses.fields(ServeSettings):
        if f.name == "checkpoint":
            p.add_argument("checkpoint", help=help_[f.name])
        elif f.type in ("bool", bool):
            p.add_argument(f"--{f.name.replace('_', '-')}", action="store_true", help=help_[f.name])
        else:
            kind = {"int": int, "float": float}.get(str(f.type), str)
            p.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=kind,
                default=f.default,
                help=f"{help_[f.name]} (default: {f.default})",
            )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.serve.app import Server, load_state
    from looplm.serve.settings import ServeSettings

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)}
    state = load_state(ServeSettings(**values))
    server = Server(state)
    s = state.settings

    def ready(port: int) -> None:
        print(
            f"looplm serve: {state.model_name} at http://{s.host}:{port}/v1 "
            f"(slots {s.slots}, {s.schedule} batching, queue {s.max_queue}, "
            f"loops {state.default_loops}, "
            f"halt {s.halt})",
            file=sys.stderr,
            flush=True,
        )

    server.run(on_ready=ready)
    print("looplm serve: stopped", file=sys.stderr, flush=True)
    return 0
