"""The engine: chunked prefill, batched decode, `generate`, counters.

Host code here decides what goes into each jitted call (which rows, which positions); the
jitted functions are pure over (weights, cache, tokens, positions) and donate the cache.
"""

from __future__ import annotations

import functools
import time
from dataclasses import dataclass, field
from typing import Optional, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.cache import ContiguousKV, contiguous_backend
from gemini_jax.config import EngineConfig, SamplingParams
from gemini_jax.errors import ContextLengthError
from gemini_jax.model import Decoder, validate_tokens
from gemini_jax.sampling import sample_with

# The counters every engine reports (DESIGN.md §4); zero where a mechanism is not in use.
COUNTERS = (
    "prefill_tokens_computed", "prefill_tokens_reused", "decode_steps", "kv_bytes_read",
    "digest_bytes_read", "pages_selected", "pages_fetched_host", "pages_fetched_disk",
    "prefetch_hits", "prefetch_misses", "stall_seconds", "compute_units",
)


def new_stats() -> dict:
    return {k: (0.0 if k == "stall_seconds" else 0) for k in COUNTERS}


@dataclass
class GenerateOutput:
    """`tokens`: generated ids (a list per prompt when a list of prompts was given).
    `logits`: per prompt f32[num_generated, vocab], the logits each token was chosen from
    (only with return_logits=True). `stats`: this call's counters. `seconds`: wall times."""

    tokens: list
    stats: dict
    logits: Optional[list] = None
    seconds: dict = field(default_factory=dict)


def _bucket(n: int, cap: int) -> int:
    """Pad prefill chunks to powers of two (capped) so few shapes are compiled."""
    b = 16
    while b < n:
        b *= 2
    return min(b, max(cap, n))


class Engine:
    """Runs a `Decoder` with a KV cache. `generate` takes one prompt or a list of prompts."""

    def __init__(self, model: Decoder, config: EngineConfig | None = None):
        self.model = model
        self.model_cfg = model.cfg
        self.config = config or EngineConfig()
        self.graphdef, self.params = nnx.split(model)
        self.cache_dtype = jnp.dtype(self.config.cache_dtype or model.cfg.dtype)
        self.stats = new_stats()  # cumulative over the engine's life
        self._step = jax.jit(functools.partial(_run, self.graphdef), donate_argnums=(1,))

    # ---- validation -----------------------------------------------------------------------
    def _check_request(self, prompt, params: SamplingParams, what: str) -> np.ndarray:
        toks = validate_tokens(prompt, self.model_cfg.vocab_size, what)
        need = len(toks) + params.max_new_tokens
        if need > self.config.max_seq_len:
            raise ContextLengthError(
                f"{what} has {len(toks)} tokens + max_new_tokens={params.max_new_tokens} = {need} > "
                f"EngineConfig.max_seq_len={self.config.max_seq_len}; shorten the prompt, lower "
                f"max_new_tokens or raise max_seq_len.")
        return toks

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | None = None, *,
                 return_logits: bool = False) -> GenerateOutput:
        params = params or SamplingParams()
        single = _is_single(prompts)
        plist = [prompts] if single else list(prompts)
        checked = [self._check_request(p, params, "prompt" if single else f"prompts[{i}]")
                   for i, p in enumerate(plist)]
        stats = new_stats()
        tokens, logits, secs = [], [], {"prefill": 0.0, "decode": 0.0}
        mb = self.config.max_batch
        for g in range(0, len(checked), mb):
            t, lg = self._generate_group(checked[g:g + mb], params, g, stats, secs, return_logits)
            tokens += t
            logits += lg
        for k, v in stats.items():
            self.stats[k] += v
        return GenerateOutput(tokens[0] if single else tokens, stats,
                              (logits[0] if single else logits) if return_logits else None, secs)

    def _generate_group(self, prompts, params, first_seq_id, stats, secs, return_logits):
        cfg, ecfg = self.model_cfg, self.config
        B = len(prompts)
        cache = ContiguousKV.create(cfg, B, ecfg.max_seq_len, self.cache_dtype)
        t0 = time.perf_counter()
        last_logits = []
        for row, toks in enumerate(prompts):
            cache, lg = self._prefill(cache, row, toks, stats)
            last_logits.append(lg)
        logits = jnp.concatenate(last_logits, axis=0)
        jax.block_until_ready(logits)
        secs["prefill"] += time.perf_counter() - t0

        t0 = time.perf_counter()
        seq_ids = np.arange(first_seq_id, first_seq_id + B)
        lengths = np.array([len(p) for p in prompts], np.int32)
        out = [[] for _ in range(B)]
        out_logits = [[] for _ in range(B)]
        done = np.zeros(B, bool)
        for i in range(params.max_new_tokens):
            nxt = np.asarray(sample_with(params, logits, seq_ids, lengths))
            host_logits = np.asarray(logits) if return_logits else None
            for b in range(B):
                if not done[b]:
                    out[b].append(int(nxt[b]))
                    if return_logits:
                        out_logits[b].append(host_logits[b])
                    if params.stop_at_eos and cfg.eos_id is not None and nxt[b] == cfg.eos_id:
                        done[b] = True
            if done.all() or i == params.max_new_tokens - 1:
                break
            logits, cache = self._step(self.params, cache._replace(rows=jnp.arange(B, dtype=jnp.int32)), jnp.asarray(nxt[:, None]),
                                       jnp.asarray(lengths[:, None]), jnp.zeros(B, jnp.int32))
            lengths += 1
            stats["decode_steps"] += 1
            stats["kv_bytes_read"] += cache.bytes_per_read(B)
            stats["compute_units"] += B * cfg.num_layers
        jax.block_until_ready(logits)
        secs["decode"] += time.perf_counter() - t0
        lg = [np.stack(x) if x else np.zeros((0, cfg.vocab_size), np.float32) for x in out_logits]
        return out, lg

    def _prefill(self, cache: ContiguousKV, row: int, toks: np.ndarray, stats):
        """Write one prompt's KV into cache row `row`, chunk by chunk; return last-token logits."""
        chunk = self.config.prefill_chunk
        logits = None
        for start in range(0, len(toks), chunk):
            piece = toks[start:start + chunk]
            n = len(piece)
            width = _bucket(n, chunk)
            padded = np.zeros(width, np.int32)
            padded[:n] = piece
            pos = np.arange(start, start + width, dtype=np.int32)
            logits, cache = self._step(self.params, cache._replace(rows=jnp.asarray([row], jnp.int32)),
                                       jnp.asarray(padded[None]), jnp.asarray(pos[None]),
                                       jnp.asarray([n - 1], jnp.int32))
            stats["prefill_tokens_computed"] += n
            stats["compute_units"] += n * self.model_cfg.num_layers
        return cache, logits


def _run(graphdef, params, cache, tokens, positions, select):
    """One jitted model call: tokens/positions [B, T] -> logits f32[B, V] at `select`, new cache."""
    model = nnx.merge(graphdef, params)
    logits, cache = model(tokens, positions, contiguous_backend(model.cfg), cache, select=select)
    return logits[:, 0], cache


def _is_single(prompts) -> bool:
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)):
        # NOTE: [] counts as one (empty) prompt, so it is refused as such.
        return len(prompts) == 0 or isinstance(prompts[0], (int, np.integer))
    return False
