"""Things several rows share."""

from __future__ import annotations

from benchlib.models import BenchModel, build_llama
from benchlib.registry import Context


def llama(ctx: Context) -> BenchModel:
    """The benchmark Llama (built once per run, shared by every row)."""
    return ctx.shared("llama", lambda: build_llama(ctx.seed))
