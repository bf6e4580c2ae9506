"""The counters every runner reports (docs/architecture.md §5), and the byte accounting they share."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields

from gemini_jax.attention import digests
from gemini_jax.config import EngineConfig, ModelConfig

# Zero where a mechanism is not in use; `stall_seconds` is a float, the rest integers.
COUNTERS = (
    "prefill_tokens_computed", "prefill_tokens_reused", "decode_steps", "kv_bytes_read",
    "digest_bytes_read", "pages_selected", "pages_fetched_host", "pages_fetched_disk",
    "prefetch_hits", "prefetch_misses", "stall_seconds", "compute_units", "pages_recomputed",
)


@dataclass(kw_only=True)
class Counters(Mapping):
    """The counters a runner adds to: typed fields (a misspelt counter is an AttributeError, not
    a new key), read like a mapping (`c["kv_bytes_read"]`, `dict(c)`, `set(c) == set(COUNTERS)`)."""

    prefill_tokens_computed: int = 0
    prefill_tokens_reused: int = 0
    decode_steps: int = 0
    kv_bytes_read: int = 0
    digest_bytes_read: int = 0
    pages_selected: int = 0
    pages_fetched_host: int = 0
    pages_fetched_disk: int = 0
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    stall_seconds: float = 0.0
    compute_units: int = 0
    pages_recomputed: int = 0  # (layer, page) units below the device that failed verification and were rebuilt

    def __getitem__(self, name: str):
        if name not in COUNTERS:
            raise KeyError(name)
        return getattr(self, name)

    def __iter__(self):
        return iter(COUNTERS)

    def __len__(self) -> int:
        return len(COUNTERS)

    def add(self, other: Mapping) -> None:
        """Add another set of counters (a `Counters` or a mapping of the same names) to these."""
        for name in COUNTERS:
            setattr(self, name, getattr(self, name) + other[name])

    def as_dict(self) -> dict:
        return {name: getattr(self, name) for name in COUNTERS}


def new_stats() -> Counters:
    return Counters()


def page_bytes(block_size: int, vector_bytes: int) -> int:
    """Bytes of one (page, kv head) pair of K (or of V): `vector_bytes` per token, scales included
    (`kvquant.vector_bytes`)."""
    return block_size * vector_bytes


def count_decode_reads(stats: Counters, config: EngineConfig, model_cfg: ModelConfig, reads: DecodeReads) -> None:
    """Add one decode step's reads to `stats`: KV bytes (K and V of every (page, kv head) pair
    attended, keys alone of reranked candidates), pages selected, and the digest bytes that
    selection scored (every page of the block table in every sparse layer)."""
    per_pair = page_bytes(config.cache.block_size, reads.kv_vector_bytes)  # reads: summed over steps
    stats.kv_bytes_read += (2 * reads.page_reads + reads.key_reads) * per_pair
    sp = config.sparse
    if sp.enabled:
        stats.pages_selected += reads.page_reads
        sparse_layers = max(model_cfg.num_layers - sp.dense_layers, 0)
        stats.digest_bytes_read += (reads.steps * sparse_layers * reads.batch * reads.table_width * model_cfg.num_kv_heads
                                       * digests.ROWS[sp.digest] * model_cfg.head_dim * reads.digest_itemsize)


def count_prefill(stats: Counters, model_cfg: ModelConfig, tokens: int) -> None:
    stats.prefill_tokens_computed += tokens
    stats.compute_units += tokens * model_cfg.num_layers


@dataclass(frozen=True, kw_only=True)
class DecodeReads:
    """What one decode step read, as the runner counted it: (page, kv head) pairs attended
    (`page_reads`) and whose keys alone were read to rerank (`key_reads`), over all layers."""

    page_reads: int
    key_reads: int
    batch: int
    table_width: int
    kv_vector_bytes: int   # one token's K (or V) in one kv head, scale included
    digest_itemsize: int
    steps: int = 1


assert tuple(f.name for f in fields(Counters)) == COUNTERS  # NOTE: the two lists move together
