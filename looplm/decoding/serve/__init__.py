"""``looplm serve``: an OpenAI-compatible HTTP server over continuous batching with per-token
adaptive depth (docs/serving.md).

:mod:`~looplm.decoding.serve.settings` (ServeSettings), :mod:`~looplm.decoding.serve.schemas` (request checks),
:mod:`~looplm.decoding.serve.scheduler` (the batch driven by arrivals), :mod:`~looplm.decoding.serve.metrics`
(Prometheus text), :mod:`~looplm.decoding.serve.app` (routes, uvicorn, draining)."""

from looplm.decoding.serve.settings import ServeSettings

__all__ = ["ServeSettings"]
