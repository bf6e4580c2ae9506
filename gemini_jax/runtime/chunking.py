"""Shapes of the calls a runner makes: prefill chunks and block-table widths, chosen so few
distinct shapes compile (each compiles once) with little padding."""

from __future__ import annotations

from typing import Iterator

import numpy as np

try:  # a progress bar when tqdm is there; the engine runs without it (a bare jax + flax machine)
    from tqdm import tqdm
except ImportError:
    tqdm = None

from gemini_jax.cache.shapes import pow2_at_least, table_width
from gemini_jax.config import EngineConfig

PREFILL_PROGRESS_CHUNKS = 64  # prompts of at least this many prefill chunks show a progress bar


def call_width(config: EngineConfig, kv, ids, tokens_per_row: int) -> int:
    """Block-table width of a call over sequences `ids` of the page manager `kv`. Sparse prefill
    chunks all take the longest sequence's width: they read only the selected pages (and score
    every page from its small digest), so one compiled shape serves the whole prompt instead of
    one per width step."""
    if tokens_per_row > 1 and config.sparse.enabled and config.sparse.sparse_prefill:
        return config.pages_per_seq
    return table_width(max(len(kv.seqs[s].pages) for s in ids), config.pages_per_seq)


def prefill_pieces(config: EngineConfig, toks: np.ndarray, start: int) -> Iterator[tuple]:
    """(padded chunk, positions, real length) pieces of toks[start:], padded to powers of two."""
    chunk = config.prefill_chunk
    bounds = [(s, min(s + chunk, len(toks))) for s in range(start, len(toks), chunk)]
    sp = config.sparse
    alone = sp.enabled and sp.sparse_prefill and sp.last_token_alone
    if alone and bounds and bounds[-1][1] - bounds[-1][0] > 1:
        # The last token's logits give the first generated token: it selects pages for itself
        # rather than sharing the selection of a whole chunk's queries.
        s, e = bounds.pop()
        bounds += [(s, e - 1), (e - 1, e)]
    # Long prompts (minutes on a CPU) show a progress bar on stderr; short ones stay quiet.
    if tqdm is not None:
        bounds = tqdm(bounds, desc="prefill", unit="chunk", disable=len(bounds) < PREFILL_PROGRESS_CHUNKS,
                      leave=False)
    for s, e in bounds:
        piece = toks[s:e]
        n = len(piece)
        width = min(pow2_at_least(n, 16), max(chunk, n))
        padded = np.zeros(width, np.int32)
        padded[:n] = piece
        yield padded, np.arange(s, s + width, dtype=np.int32), n
