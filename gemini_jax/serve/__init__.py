"""Serving: continuous batching over the paged cache (`Scheduler`), the thread that runs it for
the HTTP server (`Worker`), the OpenAI-compatible app (`gemini_jax.serve.http`), quotas and
metrics. `python -m gemini_jax.serve` starts the server."""

from gemini_jax.serve.request import FINISH_REASONS, Phase, Request
from gemini_jax.serve.scheduler import Scheduler

__all__ = ["FINISH_REASONS", "Phase", "Request", "Scheduler"]
