"""Decode-step harness: one engine holding one sequence of `context` tokens of random KV, stepped
through the engine's own decode path.

Prefilling 64K tokens on a CPU takes far longer than the decode steps we want to time, and the
values in the cache do not change the work of dense attention, so the harness fills the cache with
random K/V instead of running prefill:

* contiguous: `_ContiguousRunner` (the runner `Engine.generate` uses) with positions
  [0, context) of its [max_seq_len] buffer filled;
* paged: `PooledRunner`, with the sequence written through `engine.sequences.write` (pages
  reserved and tokens committed, as prefill would leave them, and those pages of the pool filled).
  With a `SparseConfig` (enabled), that call computes the pages' digests from the filled keys by
  the engine's own digest maintenance, `digests.update`, per layer with positions [0, context)
  (the call a prefill of the whole context would make); a spot check compares a few pages with
  `digests.page_digest`. So selection scores the cache that is really there, as after a real prefill.

`step()` then calls `runner.decode` — the exact per-token work of `generate`'s loop: host
bookkeeping (reserve/commit/block table for paged), the jitted step, and a greedy argmax on the
host (which synchronises, as sampling does) — or, with `steps_per_call` k > 1, `runner.decode_many`:
the engine's k-step program (greedy on device), one call per k tokens. The harness uses the
engine's public runner and sequence API (`engine.runner`, `engine.sequences`) only.
"""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
import numpy as np

import gemini_jax as gj
from gemini_jax.attention import digests as D
from gemini_jax.attention import kvquant
from gemini_jax.config import CacheConfig, SparseConfig
from gemini_jax.runtime import new_stats
from gemini_jax.runtime.multistep import LoopInputs, LoopSpec


class DecodeHarness:
    def __init__(self, model, *, kind: str, context: int, new_tokens: int, block_size: int = 16,
                 seed: int = 0, batch: int = 1, sparse: SparseConfig | None = None, steps_per_call: int = 1,
                 cache_dtype: str | None = None, layer_weights: str = "per_layer"):
        cfg = model.cfg
        # NOTE: max_seq_len = context + new_tokens for every variant, and a pool sized for the
        # batch (max_batch=batch), so no variant pays for a bigger buffer than it needs.
        self.eng = gj.Engine(model, gj.EngineConfig(
            max_seq_len=context + new_tokens, max_batch=batch, decode_steps_per_call=steps_per_call,
            cache=CacheConfig(kind=kind, block_size=block_size, prefix_caching=False, dtype=cache_dtype),
            sparse=sparse or SparseConfig(), layer_weights=layer_weights))
        self.batch, self.k = batch, steps_per_call
        self.kind, self.context, self.capacity = kind, context, context + new_tokens
        self.stats = new_stats()
        key = jax.random.key(seed)
        kk, kv = jax.random.split(key)
        # Random K/V drawn in float (the model's dtype); a quantized cache quantizes them as it stores them.
        dt = self.eng.model_cfg.dtype
        if kind == "paged":
            self.runner = self.eng.runner(batch, self.stats)
            rng = np.random.default_rng(seed)
            seqs = self.eng.sequences
            n_pages = -(-context // block_size)
            shape = (cfg.num_layers, cfg.num_kv_heads, n_pages, block_size, cfg.head_dim)
            for row, sid in enumerate(self.runner.ids):
                toks = rng.integers(0, cfg.vocab_size, context).astype(np.int32)
                kk, kv, key = jax.random.split(key, 3)
                seqs.write(sid, toks, jax.random.normal(kk, shape, dt), jax.random.normal(kv, shape, dt))
                if seqs.device_digests is not None:
                    self._check_digests(sid, context, seed + row)
        else:
            self.runner = self.eng.runner(batch, self.stats)
            c = self.runner.cache
            shape = (cfg.num_layers, batch, context, cfg.num_kv_heads, cfg.head_dim)
            at = (slice(None), slice(None), slice(0, context))
            self.runner.cache = c._replace(k=kvquant.write(c.k, at, jax.random.normal(kk, shape, dt)),
                                           v=kvquant.write(c.v, at, jax.random.normal(kv, shape, dt)))
            jax.block_until_ready(self.runner.cache)
        self.lengths = np.full(batch, context, np.int32)
        self.next_tok = np.ones(batch, np.int32)
        self.steps = 0
        self._loop = LoopSpec(k=steps_per_call)  # greedy, no EOS: every call runs k steps
        self._key = jax.random.key(seed)

    def _check_digests(self, sid: int, context: int, seed: int):
        """Spot check of the digests `sequences.write` computed: the first, a random and the last
        (maybe partial) page against `digests.page_digest` of its keys."""
        e = self.eng
        kind, S = e.config.sparse.digest, e.config.cache.block_size
        n = -(-context // S)
        rng = np.random.default_rng(seed)
        pages = sorted({0, int(rng.integers(n)), n - 1})
        got = e.sequences.gather_pages(sid, pages)
        for i, j in enumerate(pages):
            count = min(S, context - j * S)
            layer = int(rng.integers(e.model_cfg.num_layers))
            k_page = kvquant.read(jax.tree.map(jnp.asarray, got.k[layer, :, i]), jnp.float32)
            want = D.page_digest(kind, k_page, jnp.full((k_page.shape[0],), count))
            if not np.allclose(np.asarray(got.digests[layer, :, i], np.float32), np.asarray(want, np.float32),
                               atol=1e-6):
                raise AssertionError(f"digest of page {j} (layer {layer}) does not match its keys.")

    def step(self):
        """One decode step per row (k = 1), or one call of k steps (the engine's k-step program,
        greedy on device); returns the steps taken."""
        k = self.k
        if self.lengths[0] + k > self.capacity:
            raise RuntimeError(f"harness ran past its capacity of {self.capacity} tokens; "
                               f"raise new_tokens.")
        if k == 1:
            logits = self.runner.decode(self.next_tok, self.lengths)
            self.next_tok = np.asarray(np.argmax(np.asarray(logits), axis=-1), np.int32)  # syncs
        else:
            B = self.batch
            out = self.runner.decode_many(LoopInputs(self.next_tok, self.lengths, np.arange(B, dtype=np.uint32),
                                                     self._key, np.zeros(B, bool), np.int32(k)), self._loop)
            assert out.steps == k, out.steps
            self.next_tok = out.tokens[:, -1]  # fetched to the host (the call has finished)
        self.lengths = self.lengths + k
        self.steps += k
        return k

    def rewind(self):
        """Back to `context` tokens and the first input token, so every timed run decodes the same
        positions and tokens (and the same block-table widths, compiled by a first run)."""
        if self.kind == "paged":
            for sid in self.runner.ids:
                if self.eng.sequences.truncate(sid, self.context):
                    raise RuntimeError("rewind needs a context that is a multiple of the block size.")
        self.lengths = np.full(self.batch, self.context, np.int32)
        self.next_tok = np.ones(self.batch, np.int32)

    def timed(self, n: int) -> float:
        """Seconds per decode step, averaged over n consecutive steps (n / k calls) from `context`
        tokens (rewound first)."""
        self.rewind()
        calls = max(1, n // self.k)
        t0 = time.perf_counter()
        for _ in range(calls):
            self.step()
        return (time.perf_counter() - t0) / (calls * self.k)

    @property
    def kv_bytes_per_step(self) -> float:
        """The engine's own `kv_bytes_read` counter over the steps taken."""
        return self.stats["kv_bytes_read"] / max(self.steps, 1)

    @property
    def digest_bytes_per_step(self) -> float:
        """The engine's own `digest_bytes_read` counter over the steps taken (0 when dense)."""
        return self.stats["digest_bytes_read"] / max(self.steps, 1)

    def close(self):
        """Free the sequence and drop the cache arrays (idempotent)."""
        if self.runner is not None:
            self.runner.close()
        self.runner = self.eng = None
