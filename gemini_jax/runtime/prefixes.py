"""Prompts' full pages in and out of the persistent prefix store (`tier.persistent`).

    load(ctx, sid, prompt, start)  before a prefill: the prompt's next full blocks found in the
                                   store become pages of the sequence (no compute)
    persist(ctx, sid, counters)    after it: the sequence's full pages not yet stored go down,
                                   every layer with its digests

A page's key is the cache's chained block hash; the store itself is keyed by the engine's
fingerprint (model, weights, layout, sparse setting), so a hit is the same KV a prefill would
write, up to the rounding of the call that wrote it. Blocks from the first soft token on
(gemini_jax.runtime.soft) are neither stored nor loaded: their ids name rows of one engine's table,
which another process numbers differently.
"""

from __future__ import annotations

import numpy as np

from gemini_jax.attention import kvquant
from gemini_jax.cache.block_pool import NULL_PAGE
from gemini_jax.cache.manager import block_hash
from gemini_jax.errors import IntegrityError
from gemini_jax.runtime.context import RunContext
from gemini_jax.tiers.errors import TierError


def load(ctx: RunContext, sid: int, prompt, start: int) -> int:
    """Extend sequence `sid` (holding `prompt[:start]`, on a page boundary) by the stored pages of
    the prompt's following full blocks, up to a prefill-chunk boundary; at least the prompt's
    last token is left to compute.
    Returns the tokens loaded. A page failing its checksum ends the run of loaded pages there
    (the rest is prefilled): nothing wrong is served, nothing is lost."""
    store, kv = ctx.prefixes, ctx.pages
    if store is None:
        return 0
    S = kv.block_size
    seq = kv.seqs[sid]
    prev = seq.hashes[-1] if seq.hashes else 0
    hashes = []
    text_only = _text_blocks(ctx, prompt)
    for i in range(start // S, min((len(prompt) - 1) // S, text_only)):
        prev = block_hash(prev, prompt[i * S:(i + 1) * S])
        if prev not in store:
            break
        hashes.append(prev)
    # End the loaded prefix on a prefill-chunk boundary: the rest is then prefilled in the chunks a
    # cold prefill makes, so a sparse prefill selects what it would have (and dense rounds alike).
    chunk = ctx.config.prefill_chunk
    hashes = hashes[:max(0, ((start + len(hashes) * S) // chunk * chunk - start) // S)]
    while hashes:
        try:
            data, dig = store.get_many(hashes)
            break
        except IntegrityError as err:  # keep the pages before the bad one, up to a chunk boundary
            bad = next(i for i, h in enumerate(hashes) if f"{h:016x}" in str(err))
            hashes = hashes[:max(0, ((start + bad * S) // chunk * chunk - start) // S)]
    if not hashes:
        return 0
    n = len(hashes)
    pages = kv.extend_cached(sid, prompt[start:start + n * S], hashes)
    ctx.store.scatter_rows(pages, data, dig)  # [n, 2, L, K, S, row] as stored (packed when quantized)
    return n * S


def persist(ctx: RunContext, sid: int) -> int:
    """Store the full pages of sequence `sid` that the store lacks; returns how many. A failing
    disk stops persisting (TierError is kept on the store as `failure`), never the run."""
    store, kv = ctx.prefixes, ctx.pages
    if store is None or store.failure is not None:
        return 0
    seq = kv.seqs[sid]
    text_only = _text_blocks(ctx, seq.tokens)
    todo = [(i, h) for i, h in enumerate(seq.hashes[:text_only]) if h not in store and seq.pages[i] != NULL_PAGE]
    if not todo:
        return 0
    k, v, dig = ctx.store.gather([seq.pages[i] for i, _ in todo])
    if isinstance(k, kvquant.QuantPages):  # one byte array a page, scales included
        k, v = kvquant.pack(k), kvquant.pack(v)
    # One write of every page, then one index append: a shard or file is written once, not per page.
    pages = np.stack([k, v]).transpose(3, 0, 1, 2, 4, 5)  # [2, L, K, n, S, row] -> [n, 2, L, K, S, row]
    try:
        return store.put_many([h for _, h in todo], pages, None if dig is None else np.moveaxis(dig, 2, 0))
    except TierError as err:
        store.failure = err
        return 0


def _text_blocks(ctx: RunContext, tokens) -> int:
    """How many leading full blocks of `tokens` come before its first soft token."""
    soft = np.flatnonzero(np.asarray(tokens) >= ctx.model_cfg.vocab_size)
    return (int(soft[0]) if len(soft) else len(tokens)) // ctx.pages.block_size
