"""``looplm serve``: an OpenAI-compatible HTTP server over continuous batching with per-token
adaptive depth (docs/serving.md).

:mod:`~looplm.serve.settings` (ServeSettings), :mod:`~looplm.serve.schemas` (request checks),
:mod:`~looplm.serve.scheduler` (the batch driven by arrivals), :mod:`~looplm.serve.metrics`
(Prometheus text), :mod:`~looplm.serve.app` (routes, uvicorn, draining)."""

from looplm.serve.settings import ServeSettings

__all__ = ["ServeSettings"]
