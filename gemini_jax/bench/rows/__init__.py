"""Benchmark rows, one module each; importing this package registers them (report order = import order)."""

from gemini_jax.bench.rows import (dense_vs_hf, paged_vs_contiguous, prefix_ttft, kv_bytes,  # noqa: F401
                           sparse_vs_dense, sparse_select_share, resume_vs_reprefill, tiers, tiers_link, tier_layout,
                           decode_steps, decode_profile, kv_quant)
