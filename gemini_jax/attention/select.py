"""Page selection: score every page from its digest, keep sink + local pages, take the top-k.

Selection is in *logical* page space (index into a sequence's block table), per (sequence, kv
head); all query heads of a GQA group share it. Output is ascending logical ids padded with -1,
the format `pallas_kernels.sparse_decode` takes.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import numpy as np
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.attention.views import PageView, slot_valid
from gemini_jax.model.layers import rope_angles, rotate

NEG = -jnp.inf


def page_scores(kind: str, q, dig, group_reduce: str = "max"):
    """q [B, T, Hq, D], dig [B, K, W, R, D] (digests of the block table's pages) -> f32[B, K, W].

    minmax: sum_d max(q_d lo_d, q_d hi_d) = q+ . hi + q- . lo (two matmuls, no [.., D] temp).
    mean:   q . mean. Scores are reduced over the chunk's queries (max) and the group's heads.
    """
    B, T, H, D = q.shape
    K, W, R = dig.shape[1], dig.shape[2], dig.shape[3]
    qg = q.reshape(B, T, K, H // K, D).astype(jnp.float32)
    if kind == "minmax":
        # [q-, q+] against the flattened [lo, hi] rows: one contraction, no copies of the digests.
        qg = jnp.concatenate([jnp.minimum(qg, 0), jnp.maximum(qg, 0)], axis=-1)
    flat = dig.reshape(B, K, W, R * D)
    s = jnp.einsum("btkgd,bkwd->bkgtw", qg, flat, preferred_element_type=jnp.float32)
    s = jnp.max(s, axis=3)  # over the chunk's queries
    return jnp.max(s, axis=2) if group_reduce == "max" else jnp.mean(s, axis=2)


def rank_pages(scores, first_pos, last_pos, *, block_size: int, k: int, sink_pages: int,
               local_pages: int, window=0):
    """The top-k ranking `select_pages` cuts: (s f32[B, K, W], the scores with forced pages at inf
    and unselectable ones at -inf; top_s, top_i [B, K, min(k, W)], descending)."""
    B, K, W = scores.shape
    w = jnp.arange(W)[None, None, :]
    last_page = (last_pos // block_size)[:, None, None]
    first_page = (first_pos // block_size)[:, None, None]
    valid = w <= last_page
    # A page is outside the window for every query of the call if its last key is <= first - W.
    outside = (window > 0) & ((w + 1) * block_size - 1 <= first_pos[:, None, None] - window)
    valid = valid & ~outside
    # Local: the `local_pages` ending at the first query's page, and every page of the call itself.
    forced = (w < sink_pages) | (w >= first_page - local_pages + 1)
    s = jnp.where(forced, jnp.inf, scores)
    s = jnp.where(valid, s, NEG)
    top_s, top_i = jax.lax.top_k(s, min(k, W))
    return s, top_s, top_i


def kept_pages(top_i, keep, W: int):
    """The kept columns of a ranking as ascending logical ids, -1 padded -> i32[B, K, k]."""
    chosen = jnp.sort(jnp.where(keep, top_i, W + 1), axis=-1)  # dropped ones sort last
    return jnp.where(chosen > W, -1, chosen).astype(jnp.int32)


def select_pages(scores, first_pos, last_pos, *, block_size: int, k: int, sink_pages: int,
                 local_pages: int, window=0):
    """Top-k logical pages per (b, kv head) -> i32[B, K, k] ascending, -1 padded.

    scores f32[B, K, W]; first_pos/last_pos i32[B]: positions of the call's first and last query.
    Pages past the last query are never chosen; pages wholly outside a sliding `window` are
    never chosen; sink pages, the `local_pages` ending at the first query's page and the pages
    of the call's own queries are forced.
    """
    _, top_s, top_i = rank_pages(scores, first_pos, last_pos, block_size=block_size, k=k, sink_pages=sink_pages,
                                 local_pages=local_pages, window=window)
    return kept_pages(top_i, top_s > NEG, scores.shape[-1])


@dataclasses.dataclass(frozen=True)
class MassCut:
    """The adaptive budget (`sparse.budget_mode="topp"`): keep ranked pages until `top_p` of the
    softmax (at `scale`) of the free pages' scores is covered, the first `min_k` in any case."""

    top_p: float
    min_k: int = 0
    scale: float = 1.0


def within_mass(s, top_s, cut: MassCut):
    """bool[B, K, k] over a ranking's columns (descending): forced (score inf), among the first
    `cut.min_k`, or preceded by less than `cut.top_p` of the free pages' softmax mass. The mass is
    over every free page of the row (s [B, K, W]), not just the top k, so a flat distribution
    keeps the whole k while a peaked one keeps a few. top_p = 1 keeps the whole k (pages whose
    mass underflows included)."""
    if cut.top_p >= 1:
        return top_s > NEG
    free_all = jnp.isfinite(s)
    z = jnp.where(free_all, s * cut.scale, NEG)
    m = jnp.max(z, axis=-1, keepdims=True)
    m = jnp.where(jnp.isfinite(m), m, 0.0)
    total = jnp.sum(jnp.where(free_all, jnp.exp(z - m), 0.0), axis=-1, keepdims=True)
    free = jnp.isfinite(top_s)
    e = jnp.where(free, jnp.exp(top_s * cut.scale - m), 0.0)
    before = jnp.cumsum(e, axis=-1) - e  # mass of the free pages ranked above each column
    col = jnp.arange(top_s.shape[-1])
    kept = (top_s == jnp.inf) | (col < cut.min_k) | (before < cut.top_p * total)
    return kept & (top_s > NEG)


def scoring_queries(q, q_pos, lengths, score_queries: int):
    """The queries that score pages: the last `score_queries` *real* queries of each row (0 = all).

    q [B, T, H, D], q_pos [B, T], lengths i32[B] (end of the real tokens; None: every query is
    real) -> ([B, m, H, D], their positions [B, m]). A chunk padded to a power of two has padding
    queries at its end; they must not score, or a short last chunk would be scored by padding.
    Rows with fewer real queries than m repeat their first one (harmless under the max over queries).
    """
    T = q.shape[1]
    if T == 1:  # a decode step: its one query is real
        return q, q_pos
    m = score_queries if 0 < score_queries < T else T
    if lengths is None:
        return q[:, T - m:], q_pos[:, T - m:]
    n_real = jnp.clip(lengths - q_pos[:, 0], 1, T)  # [B]
    idx = jnp.clip(n_real[:, None] - m + jnp.arange(m), 0, n_real[:, None] - 1)  # [B, m]
    return jnp.take_along_axis(q, idx[:, :, None, None], axis=1), jnp.take_along_axis(q_pos, idx, axis=1)


def exact_page_scores(q, k_layer, block_tables, lengths, pages, *, group_reduce: str, unrope=None, fill=None):
    """The largest q.k over each listed page's real keys: q [B, m, H, D] (the scoring queries),
    k_layer [K, P, S, D] (one layer's key pool), pages i32[B, K, n] logical (-1: none)
    -> f32[B, K, n] (-inf for -1). Reduced like `page_scores`: max over the queries, then over
    the group's heads by `group_reduce`. With `unrope` (the rope's inv_freq) keys are turned back
    to position 0 first, to meet queries already turned for `score_distance`. `fill`: see
    `PageView.fill` (padding slots of syntax-aligned pages are not keys)."""
    B, m, H, D = q.shape
    K, _, S, _ = k_layer.shape
    logical = jnp.maximum(pages, 0)
    phys = jnp.take_along_axis(block_tables[:, None, :], logical, axis=2)  # [B, K, n]
    kk = kvquant.read(k_layer[jnp.arange(K)[None, :, None], phys], jnp.float32)  # [B, K, n, S, D]
    k_pos = logical[..., None] * S + jnp.arange(S)  # [B, K, n, S]
    qg = q.reshape(B, m, K, H // K, D).astype(jnp.float32)
    if isinstance(unrope, np.ndarray):
        # R(-(pS + s)) = R(-pS) R(-s): the slot part from constant tables, the page part turned onto
        # the queries (q.R(-pS)x = R(pS)q.x). Angles per key would cost a cos and a sin per key
        # element: XLA fuses them into the rotation and recomputes them per element it writes.
        ang = np.arange(S, dtype=np.float64)[:, None] * unrope.astype(np.float64)[None, :]
        ang = np.concatenate([ang, ang], axis=-1)  # [S, D], the half-rotation layout
        kk = rotate(kk, jnp.asarray(np.cos(ang), jnp.float32), jnp.asarray(-np.sin(ang), jnp.float32))
        if m * (H // K) <= S:
            # Few queries (a decode step): turn them per page, [B, K, G, m, n, D] is the smaller side.
            cos, sin = rope_angles(logical * S, unrope)  # [B, K, n, D]
            qp = rotate(jnp.moveaxis(qg, 1, 3)[:, :, :, :, None], cos[:, :, None, None], sin[:, :, None, None])
            s = jnp.einsum("bkgtnd,bknsd->bkgtns", qp, kk, preferred_element_type=jnp.float32)
        else:
            # A prefill chunk's scoring queries outnumber a page's keys: turn the keys by their
            # page's angle instead (one cos / sin per page, broadcast over its slots).
            cos, sin = rope_angles(-logical * S, unrope)  # [B, K, n, D]
            kk = rotate(kk, cos[:, :, :, None], sin[:, :, :, None])
            s = jnp.einsum("btkgd,bknsd->bkgtns", qg, kk, preferred_element_type=jnp.float32)
    else:
        if unrope is not None:
            cos, sin = rope_angles(-k_pos, unrope)
            kk = rotate(kk, cos, sin)
        s = jnp.einsum("btkgd,bknsd->bkgtns", qg, kk, preferred_element_type=jnp.float32)
    real = (pages >= 0)[..., None] & (k_pos < lengths[:, None, None, None])  # [B, K, n, S]
    held = slot_valid(fill, logical, S)
    if held is not None:
        real = real & held
    s = jnp.where(real[:, :, None, None], s, NEG)
    s = jnp.max(s, axis=(3, 5))  # over the queries and the page's keys -> [B, K, G, n]
    return jnp.max(s, axis=2) if group_reduce == "max" else jnp.mean(s, axis=2)


def select_step(sp, digests_layer, queries, view: PageView, *, block_size: int, window=0, inv_freq=None,
                k_layer=None):
    """The pages a call's queries read under `SparseConfig` sp: digests_layer [K, P, R, D] (one
    layer, indexed by page id), queries = (q [B, T, H, D], q_pos [B, T]), view.tables i32[B, W]
    (page ids), view.lengths i32[B] (end of each row's real tokens: padding queries do not score)
    -> i32[B, K, k] logical pages. A prefill chunk's own pages come on top of the budget.

    With `sp.score_distance` > 0 the digests hold keys before rope and `inv_freq` (the rope's)
    turns each query to score every page as if it sat that many tokens before the query.
    With `sp.rerank` the digests choose `rerank` x k candidates and their keys, read from
    `k_layer` [K, P, S, D], choose the k. Given `k_layer` (whether or not rerank is on), the
    result is (selected, candidates): the candidates' keys were read (= selected without rerank)."""
    q, q_pos = queries
    block_tables, lengths = view.tables, view.lengths
    with_candidates = k_layer is not None
    T = q.shape[1]
    dig = digests_layer[:, block_tables]  # [K, B, W, R, D]
    q_score, pos_score = scoring_queries(q, q_pos, lengths, sp.score_queries)
    if sp.score_distance > 0:
        # q roped at p, rotated by -(p - d), meets an un-roped key as if the key were roped at p - d.
        cos, sin = rope_angles(-(pos_score - sp.score_distance), inv_freq)  # [B, m, D]
        q_score = rotate(q_score.astype(jnp.float32), cos[:, :, None], sin[:, :, None])
    scores = page_scores(sp.digest, q_score, jnp.swapaxes(dig, 0, 1), sp.group_reduce)
    k = sp.budget // block_size + (0 if T == 1 else T // block_size + 1)
    rank = functools.partial(rank_pages, first_pos=q_pos[:, 0], last_pos=q_pos[:, -1], block_size=block_size,
                             sink_pages=sp.sink_pages, local_pages=sp.local_pages, window=window)
    # Adaptive budget: the final pick stops at top_p of the score mass (attention's 1/sqrt(D) scale).
    cut = MassCut(sp.top_p, sp.min_budget // block_size, q.shape[-1] ** -0.5) if sp.budget_mode == "topp" else None

    def pick(page_scores, k, cut=None):
        s, top_s, top_i = rank(page_scores, k=k)
        return kept_pages(top_i, within_mass(s, top_s, cut) if cut else top_s > NEG, page_scores.shape[-1])

    if not sp.rerank:
        selected = pick(scores, k, cut)
        return (selected, selected) if with_candidates else selected
    if k_layer is None:
        raise ValueError("sparse.rerank needs the layer's key pool (k_layer)")  # a caller's bug
    cand = pick(scores, k * sp.rerank)  # forced pages (score inf) are always among them
    exact = exact_page_scores(q_score, k_layer, block_tables, lengths, cand, group_reduce=sp.group_reduce,
                              unrope=inv_freq if sp.score_distance > 0 else None, fill=view.fill)
    # Back to [B, K, W]: pages that are not candidates can no longer be chosen.
    B, K, W = scores.shape
    at = jnp.where(cand >= 0, cand, W)  # W is out of range -> dropped
    full = jnp.full((B, K, W), NEG, jnp.float32)
    full = full.at[jnp.arange(B)[:, None, None], jnp.arange(K)[None, :, None], at].set(exact, mode="drop")
    selected = pick(full, k, cut)
    return (selected, cand) if with_candidates else selected


def compact_shift(selected, block_size: int):
    """Position change per selected page [B, K, n] (tokens) for `positions="compact"`: the
    selected pages, in order, are laid side by side ending at the query's page, whose position
    (and that of every page contiguous with it at the end, the local window) is unchanged.

    Column c holding logical page p moves by ((c - p) - (n_valid - 1 - last)) pages, where `last`
    is the highest selected page. All pages selected -> all zeros. Works for numpy and jax arrays.
    """
    xp = jnp if isinstance(selected, jax.Array) else __import__("numpy")
    n = selected.shape[-1]
    col = xp.arange(n, dtype=xp.int32)
    valid = selected >= 0
    n_valid = xp.sum(valid, axis=-1, keepdims=True).astype(xp.int32)
    last = xp.max(xp.where(valid, selected, -1), axis=-1, keepdims=True).astype(xp.int32)
    shift = (col - selected) - (n_valid - 1 - last)
    return (xp.where(valid, shift, 0) * block_size).astype(xp.int32)
