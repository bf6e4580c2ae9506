"""Attention over pages: digests, page selection, sparse attention (XLA path)."""

from gemini_jax.attention import digests
from gemini_jax.attention.select import page_scores, select_pages
from gemini_jax.attention.sparse import sparse_attention

__all__ = ["digests", "page_scores", "select_pages", "sparse_attention"]
