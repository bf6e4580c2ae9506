"""KV caches: the contiguous dense reference (and, beside it, the paged cache)."""

from gemini_jax.cache.contiguous import ContiguousKV, contiguous_backend

__all__ = ["ContiguousKV", "contiguous_backend"]
