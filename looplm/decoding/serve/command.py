"""`looplm serve CHECKPOINT`: an OpenAI-compatible HTTP server (completions, chat, streaming,
metrics) over continuous batching with per-token adaptive depth. All logic is in
:mod:`looplm.decoding.serve`; the options are made from :class:`~looplm.decoding.serve.settings.ServeSettings`."""

from __future__ import annotations

import argparse
import sys

from looplm.decoding.serve.settings import ServeSettings
from looplm.settings.options import add_options, from_args

SETTINGS = (ServeSettings,)


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a checkpoint over OpenAI's HTTP API (continuous batching, adaptive depth)",
        description="Serve CHECKPOINT at http://HOST:PORT/v1 (completions, chat completions, "
        "streaming, /v1/models, /health, /metrics). Request fields loops, halt, threshold and "
        "prefill_halt choose the depth per request; the options below are the defaults and "
        "limits. SIGTERM drains: in-flight requests finish, new ones get 503. See docs/serving.md.",
    )
    p.add_argument("serve_checkpoint", metavar="CHECKPOINT", help="checkpoint folder to serve")
    add_options(p, ServeSettings)
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from looplm.decoding.serve.app import Server, check_port_free, load_state, url_host

    settings = from_args(ServeSettings, args, checkpoint=args.serve_checkpoint)
    settings.validate()
    check_port_free(settings.host, settings.port)  # before the (slow) model load
    state = load_state(settings)
    server = Server(state)
    s = state.settings

    def ready(port: int) -> None:
        print(
            f"looplm serve: {state.model_name} at http://{url_host(s.host)}:{port}/v1 "
            f"(slots {s.slots}, {s.schedule} batching, queue {s.max_queue}, "
            f"loops {state.default_loops}, "
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
