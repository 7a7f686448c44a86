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
            text = help_[f.name]
            # the default once: not when the comment already says what 0 or "" means
            said = "default:" in text or f.default == "" or (f.default == 0 and "(0:" in text)
            p.add_argument(
                f"--{f.name.replace('_', '-')}",
                type=kind,
                default=f.default,
                help=text if said else f"{text} (default: {f.default})",
            )
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.serve.app import Server, check_port_free, load_state, url_host
    from looplm.serve.settings import ServeSettings

    values = {f.name: getattr(args, f.name) for f in dataclasses.fields(ServeSettings)}
    settings = ServeSettings(**values)
    settings.validate()
    check_port_free(settings.host, settings.port)  # before the (slow) model load
    state = load_state(settings)
    server = Server(state)
    s = state.settings

    def ready(port: int) -> None:
        print(
            f"looplm serve: {state.model_name} at http://{url_host(s.host)}:{port}/v1 "
            f"(slots {s.slots}, queue {s.max_queue}, loops {state.default_loops}, "
            f"halt {s.halt})",
            file=sys.stderr,
            flush=True,
        )

    server.run(on_ready=ready)
    if server.interrupted:  # Ctrl-C: drained (or cut) as SIGTERM is, exit status 130
        print("looplm serve: stopped (interrupted)", file=sys.stderr, flush=True)
        return 130
    print("looplm serve: stopped", file=sys.stderr, flush=True)
    return 0
