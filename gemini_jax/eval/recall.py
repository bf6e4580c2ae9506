"""Digest recall: how many of the pages that really carry attention mass does selection find?

For a context of real text, the model runs once over it while a probe backend records every
layer's queries and keys. For each of the last `queries` positions, each layer and kv head:
the true page mass is the exact softmax attention (summed over the group's query heads) per
page; the true top-k are the k heaviest pages; the selection scores pages from their digests
(the same `page_scores` the engine uses) and takes its top-k. Recall = |selected ∩ true| / k.
Sink and local pages are excluded on both sides: they are kept regardless of digests.
"""

from __future__ import annotations

from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.attention.digests import page_digest
from gemini_jax.attention.select import page_scores
from gemini_jax.model import self_attention_backend


def _probe_backend(cfg):
    """The no-cache backend, also recording each layer's q and k into the carried cache."""
    attend_self = self_attention_backend(cfg)

    def attend(layer, q, k, v, q_pos, window, cache):
        cache = {"q": cache["q"].at[layer].set(q), "k": cache["k"].at[layer].set(k)}
        return attend_self(layer, q, k, v, q_pos, window, cache)

    return attend


def record_qk(model, tokens):
    """Post-rope q [L, T, H, D] and k [L, T, K, D] of every layer for one sequence."""
    cfg = model.cfg
    T = len(tokens)
    cache = {"q": jnp.zeros((cfg.num_layers, 1, T, cfg.num_heads, cfg.head_dim), jnp.float32),
             "k": jnp.zeros((cfg.num_layers, 1, T, cfg.num_kv_heads, cfg.head_dim), jnp.float32)}
    toks = jnp.asarray(tokens, jnp.int32)[None]
    pos = jnp.arange(T, dtype=jnp.int32)[None]
    _, cache = jax.jit(lambda t, p, c: model(t, p, _probe_backend(cfg), c))(toks, pos, cache)
    return np.asarray(cache["q"][:, 0]), np.asarray(cache["k"][:, 0])


@dataclass(frozen=True, kw_only=True)
class RecallSetting:
    """The selection a recall figure is about: `k_pages` of `block_size` tokens chosen among the
    pages outside `sink_pages` + `local_pages` (always read), heads of a group reduced by
    `group_reduce`; `rerank` >= 2: top rerank*k by digest, then the k with the largest exact q.k."""

    block_size: int
    k_pages: int
    sink_pages: int = 1
    local_pages: int = 2
    group_reduce: str = "max"
    rerank: int = 0


def digest_recall(model, tokens, setting: RecallSetting, *, kinds=("minmax", "mean"), queries: int = 16,
                  slots=None) -> dict:
    """Mean recall per digest kind over the last `queries` positions, all layers and kv heads.

    With `setting.rerank` >= 2 each kind also gets "<kind>+rerank<n>": the digest scores' top n*k
    candidates, reranked by their exact largest q.k (as `SparseConfig.rerank` selects).

    `slots` i32[T]: the KV slot of each token when pages are not fixed spans (syntax-aligned pages:
    `gemini_jax.runtime.aligned`; slots increase, a page's tokens come first and its padding after);
    None: token t sits in slot t."""
    block_size, k_pages, rerank = setting.block_size, setting.k_pages, setting.rerank
    sink_pages, local_pages, group_reduce = setting.sink_pages, setting.local_pages, setting.group_reduce
    cfg = model.cfg
    q_all, k_all = record_qk(model, tokens)
    T = len(tokens)
    G = cfg.num_heads // cfg.num_kv_heads
    S = block_size
    slot = np.arange(T) if slots is None else np.asarray(slots)
    out = {kind: [] for kind in kinds}
    if rerank:
        out.update({f"{kind}+rerank{rerank}": [] for kind in kinds})
    for pos in range(T - queries, T):
        n_pages = int(slot[pos]) // S + 1
        page_of = slot[:pos + 1] // S
        counts = np.bincount(page_of, minlength=n_pages)  # a page's tokens fill its first slots
        candidates = np.arange(sink_pages, max(sink_pages, n_pages - local_pages))
        if len(candidates) <= k_pages:
            continue  # everything fits the budget: recall is trivially 1
        for layer in range(cfg.num_layers):
            keys = k_all[layer, :pos + 1]  # [t, K, D]
            q = q_all[layer, pos]  # [H, D]
            qg = q.reshape(cfg.num_kv_heads, G, -1)
            logits = np.einsum("kgd,tkd->kgt", qg, keys) * cfg.scale
            if cfg.attn_softcap:
                logits = np.tanh(logits / cfg.attn_softcap) * cfg.attn_softcap
            p = np.exp(logits - logits.max(-1, keepdims=True))
            p /= p.sum(-1, keepdims=True)
            mass = np.zeros((cfg.num_kv_heads, n_pages))
            np.add.at(mass, (slice(None), page_of), p.sum(1))
            padded = np.zeros((n_pages * S, cfg.num_kv_heads, keys.shape[-1]), np.float32)
            padded[slot[:pos + 1]] = keys
            pages = padded.reshape(n_pages, S, cfg.num_kv_heads, -1).transpose(2, 0, 1, 3)  # [K, n, S, D]
            if rerank:  # exact page score: the largest q.k over the page's keys and the group's heads
                qk = np.einsum("kgd,tkd->kt", qg, keys) if G == 1 else np.einsum("kgd,tkd->kgt", qg, keys).max(1)
                exact = np.full((cfg.num_kv_heads, n_pages * S), -np.inf)
                exact[:, slot[:pos + 1]] = qk
                exact = exact.reshape(cfg.num_kv_heads, n_pages, S).max(-1)
            for kind in kinds:
                dig = page_digest(kind, jnp.asarray(pages), jnp.broadcast_to(jnp.asarray(counts), pages.shape[:2]))
                scores = np.asarray(page_scores(kind, jnp.asarray(q)[None, None], dig[None], group_reduce))[0]
                for h in range(cfg.num_kv_heads):
                    true = set(candidates[np.argsort(-mass[h, candidates])[:k_pages]].tolist())
                    sel = set(candidates[np.argsort(-scores[h, candidates])[:k_pages]].tolist())
                    out[kind].append(len(true & sel) / k_pages)
                    if rerank:
                        cand = candidates[np.argsort(-scores[h, candidates])[:rerank * k_pages]]
                        sel = set(cand[np.argsort(-exact[h, cand])[:k_pages]].tolist())
                        out[f"{kind}+rerank{rerank}"].append(len(true & sel) / k_pages)
    return {kind: (float(np.mean(v)) if v else 1.0) for kind, v in out.items()}
