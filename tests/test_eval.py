"""The evaluation harness scores a scripted oracle 100%, a random engine ~0%, and exact match only."""

import re
from types import SimpleNamespace

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.eval import is_correct, needle, perplexity, unigram_bits_per_byte, write_needle
from gemini_jax.testing import random_model, tiny_config


class OracleEngine:
    """Reads the asked-for key out of the prompt, as a perfect retriever would."""

    def generate(self, prompts, params):
        outs = []
        for p in prompts:
            text = bytes(t for t in p if t < 256).decode("utf-8", "replace")
            name = re.search(r"What is the pass key( of \w+)?\?", text).group(1) or ""
            key = re.search(rf"The pass key{re.escape(name)} is \x1e(\d+)\. Remember", text).group(1)
            outs.append(list(key.encode()) + [ord(".")])
        return SimpleNamespace(tokens=outs)


class RandomEngine:
    def __init__(self, seed: int):
        self.rng = np.random.default_rng(seed)

    def generate(self, prompts, params):
        return SimpleNamespace(tokens=[list(self.rng.integers(48, 58, params.max_new_tokens)) for _ in prompts])


def test_oracle_scores_100_and_random_scores_near_0(tmp_path):
    lengths, depths = [300, 1200], [0.0, 0.5, 1.0]
    res = needle(OracleEngine(), lengths, depths, trials=4, seed=33)
    assert res.overall == 1.0
    kv = needle(OracleEngine(), [1500], [0.3], trials=4, distractors=3)
    assert kv.overall == 1.0
    rnd = needle(RandomEngine(seed=9), lengths, depths, trials=20)
    assert rnd.overall <= 0.05  # chance of guessing 5 digits (and no 6th) is ~1e-5
    write_needle(res, str(tmp_path), "oracle", "oracle")
    assert all((tmp_path / f"oracle.{e}").exists() for e in ("json", "md", "png"))


def test_exact_match_only():
    assert is_correct("12345.", "12345")
    assert is_correct("12345", "12345")
    assert not is_correct("123456", "12345")
    assert not is_correct("1234", "12345")
    assert not is_correct(" 12345", "12345")
    assert not is_correct("12346", "12345")


def test_score_matches_forward_and_perplexity_runs():
    rng = np.random.default_rng(1)
    cfg = tiny_config("tiny", vocab_size=259)
    model = random_model(cfg, int(rng.integers(100)))
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=256, prefill_chunk=32))
    toks = [int(x) for x in rng.integers(0, 256, 60)]
    logp = eng.score(toks[:40], toks[40:]).tokens
    full = np.asarray(gj.forward(model, toks))
    ref = full - np.log(np.exp(full - full.max(-1, keepdims=True)).sum(-1, keepdims=True)) - full.max(-1, keepdims=True)
    want = ref[np.arange(39, 59), toks[40:60]]
    np.testing.assert_allclose(logp, want, atol=1e-4)
    out = perplexity(eng, 128, windows=2, scored=32)
    assert 7.0 < out["bits_per_byte"] < 12  # a random model is near log2(259) bits
    assert 4.0 < unigram_bits_per_byte() < 6.0


def test_digest_recall_is_exact_for_single_token_pages():
    """With one key per page and one query head per kv head, a digest *is* the key, so the
    digest ranking is the attention-mass ranking: recall must be 1. Coarser pages recall less."""
    from gemini_jax.eval import RecallSetting, digest_recall

    seed = 21
    rng = np.random.default_rng(seed)
    cfg = tiny_config("tiny", num_heads=2, num_kv_heads=2, head_dim=32)
    model = random_model(cfg, seed)
    toks = [int(x) for x in rng.integers(0, cfg.vocab_size, 120)]
    exact = digest_recall(model, toks, RecallSetting(block_size=1, k_pages=8, sink_pages=1, local_pages=1), queries=3)
    assert exact == {"minmax": 1.0, "mean": 1.0}
    # Reranking by the exact largest q.k of a one-key page is the logit ranking too.
    reranked = digest_recall(model, toks, RecallSetting(block_size=1, k_pages=8, sink_pages=1, local_pages=1, rerank=2),
                             queries=3)
    assert reranked == {"minmax": 1.0, "mean": 1.0, "minmax+rerank2": 1.0, "mean+rerank2": 1.0}
    coarse = digest_recall(model, toks, RecallSetting(block_size=8, k_pages=3), queries=3)
    assert all(0.0 <= v <= 1.0 for v in coarse.values())
    assert coarse == pytest.approx(_brute_force_recall(model, toks, block_size=8, k_pages=3, queries=3)), seed
    assert min(coarse.values()) < 1.0, (seed, coarse)  # eight keys per page: the digests miss some


def _brute_force_recall(model, toks, *, block_size, k_pages, queries, sink_pages=1, local_pages=2):
    """Recall spelled out one page at a time: the exact attention mass a page holds against the
    score its digest gives (minmax: sum_d max(q_d lo_d, q_d hi_d); mean: q . mean key), both
    reduced over the kv head's group by sum (mass) and max (score)."""
    from gemini_jax.eval.recall import record_qk

    cfg = model.cfg
    q_all, k_all = record_qk(model, toks)
    q_all, k_all = q_all.astype(np.float64), k_all.astype(np.float64)
    G, S, T = cfg.num_heads // cfg.num_kv_heads, block_size, len(toks)
    hits = {"minmax": [], "mean": []}
    for pos in range(T - queries, T):
        n_pages = pos // S + 1
        candidates = list(range(sink_pages, n_pages - local_pages))
        if len(candidates) <= k_pages:
            continue
        for layer in range(cfg.num_layers):
            for h in range(cfg.num_kv_heads):
                qs = q_all[layer, pos, h * G:(h + 1) * G]  # [G, D]
                keys = k_all[layer, :pos + 1, h]  # [t, D]
                logits = qs @ keys.T * cfg.scale
                probs = np.exp(logits - logits.max(-1, keepdims=True))
                probs /= probs.sum(-1, keepdims=True)
                mass, score = {}, {"minmax": {}, "mean": {}}
                for page in candidates:
                    page_keys = keys[page * S:min(pos + 1, (page + 1) * S)]
                    mass[page] = probs[:, page * S:page * S + len(page_keys)].sum()
                    lo, hi = page_keys.min(0), page_keys.max(0)
                    score["minmax"][page] = max(np.maximum(q * lo, q * hi).sum() for q in qs)
                    score["mean"][page] = max(q @ page_keys.mean(0) for q in qs)
                true = set(sorted(candidates, key=lambda p: -mass[p])[:k_pages])
                for kind in hits:
                    sel = set(sorted(candidates, key=lambda p: -score[kind][p])[:k_pages])
                    hits[kind].append(len(true & sel) / k_pages)
    return {kind: float(np.mean(v)) for kind, v in hits.items()}
