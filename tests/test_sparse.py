"""Chunk-sparse attention: exactness at full budget, digests, exact top-k selection, errors."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.attention import page_scores, select_pages
from gemini_jax.attention.digests import page_digest
from gemini_jax.attention.select import MassCut, kept_pages, rank_pages, within_mass
from gemini_jax.attention.views import PageView, Selection
from gemini_jax.errors import ConfigError
from gemini_jax.testing import FAMILIES, contract_tolerance, float_tolerance, logits_tolerance, random_model, random_prompts, tiny_config


def _engine(model, sparse=None, block=8, **kw):
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=160, prefill_chunk=16, max_batch=4, cache=dict(block_size=block),
        sparse=sparse or {}, **kw)))


@pytest.mark.parametrize("every_variant", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["ci", "all"])
@pytest.mark.parametrize("family", FAMILIES)
def test_budget_covering_context_equals_dense_paged(family, every_variant):
    """Invariant 3: sparse with budget >= context is dense paged, token for token. CI runs one
    variant per family, taking turns so every variant meets some family; `make test-slow` runs
    every variant on every family."""
    seed = 1
    rng = np.random.default_rng(seed)
    cfg = tiny_config(family)
    model = random_model(cfg, int(rng.integers(1000)))
    prompts = random_prompts(rng, cfg.vocab_size, (9, 60, 101))
    params = gj.SamplingParams(max_new_tokens=10, stop_at_eos=False)
    dense = _engine(model).generate(prompts, params, return_logits=True)
    compact = dict(enabled=True, budget=160, positions="compact", sparse_prefill=True, score_queries=4)
    compact_scored = dict(compact, score_distance=48)
    variants = [dict(enabled=True, budget=160), dict(enabled=True, budget=160, digest="mean",
                                                     sparse_prefill=True, group_reduce="mean")]
    variants.append(dict(enabled=True, budget=160, rerank=3, sparse_prefill=True))  # every page a candidate
    if cfg.local_rope is None:  # compact positions re-rotate with the one rope a family has
        variants += [compact, compact_scored]  # every page selected: no page moves
    if not every_variant:  # one variant per family, in turn: the six families cover all five
        variants = [variants[FAMILIES.index(family) % len(variants)]]
    for sparse in variants:
        out = _engine(model, sparse).generate(prompts, params, return_logits=True)
        assert out.tokens == dense.tokens, f"seed={seed} {sparse}"
        for a, b in zip(out.logits, dense.logits):
            # The contract (README, exactness table): within 1e-5 × max(1, max|ref|) of dense. This float bound (the
            # attention's sums over the context reordered, per layer) caps it where it is tighter.
            tol = contract_tolerance(logits_tolerance(cfg, context=max(map(len, prompts)) + 10, reference=b), b, contract=1e-5)
            np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"seed={seed} {sparse}")
        assert out.stats["pages_selected"] > 0 and out.stats["digest_bytes_read"] > 0


def test_small_budget_reads_less_and_counts_it():
    rng = np.random.default_rng(2)
    cfg = tiny_config("llama")
    model = random_model(cfg, 3)
    prompt = random_prompts(rng, cfg.vocab_size, (150,))[0]
    params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
    dense = _engine(model).generate(prompt, params)
    sparse = _engine(model, dict(enabled=True, budget=32, sink_pages=1, local_pages=2)).generate(prompt, params)
    # 4 pages of 8 tokens per (layer, kv head) per step, vs every page for dense.
    assert sparse.stats["pages_selected"] == 5 * cfg.num_layers * cfg.num_kv_heads * 4
    assert sparse.stats["kv_bytes_read"] < dense.stats["kv_bytes_read"] / 3


@pytest.mark.parametrize("kind", ["minmax", "mean"])
def test_digests_match_pages_after_generate(kind):
    """Digests on device equal the brute-force digest of each page's valid keys (partial too)."""
    seed = 3
    rng = np.random.default_rng(seed)
    cfg = tiny_config("qwen3")
    eng = _engine(random_model(cfg, 4), dict(enabled=True, budget=64, digest=kind))
    prompt = random_prompts(rng, cfg.vocab_size, (45,))[0]
    sid_before = set(eng.pages.seqs)
    # Keep the sequence alive to inspect its pages: run the runner by hand.
    from gemini_jax.runtime import PooledRunner, new_stats

    runner = PooledRunner(eng.ctx, 1, new_stats())
    runner.prefill(0, np.asarray(prompt, np.int32))
    seq = eng.pages.seqs[runner.ids[0]]
    k = np.asarray(eng.store.device.k)
    dig = np.asarray(eng.store.device.digests)
    for i, page in enumerate(seq.pages):
        count = min(8, seq.num_tokens - i * 8)
        keys = k[:, :, page, :count]  # [L, K, count, D]
        if kind == "minmax":  # min and max round nothing: exact
            want = np.stack([keys.min(2), keys.max(2)], axis=2)
            np.testing.assert_array_equal(dig[:, :, page], want, err_msg=f"seed={seed} page {page}")
        else:  # a mean of `count` keys: one sum
            want = keys.mean(2)[:, :, None]
            tol = float_tolerance(depth=1, terms=count, magnitude=np.abs(keys).max())
            np.testing.assert_allclose(dig[:, :, page], want, atol=tol, rtol=0, err_msg=f"seed={seed} page {page}")
    runner.close()
    assert set(eng.pages.seqs) == sid_before


def test_quest_score_is_upper_bound():
    seed = 4
    rng = np.random.default_rng(seed)
    keys = jnp.asarray(rng.normal(size=(3, 8, 16)).astype(np.float32))  # 3 pages of 8 keys
    q = jnp.asarray(rng.normal(size=(1, 1, 1, 16)).astype(np.float32))
    dig = page_digest("minmax", keys, jnp.full((3,), 8))[None, None]  # [1, 1, 3, 2, 16]
    bound = np.asarray(page_scores("minmax", q, dig))[0, 0]
    exact = np.asarray(jnp.einsum("psd,d->ps", keys, q[0, 0, 0])).max(-1)
    # Both sides are sums of 16 products, each rounded its own way.
    tol = float_tolerance(depth=1, terms=16, magnitude=float(np.abs(q).sum() * np.abs(keys).max()))
    assert np.all(bound >= exact - tol), f"seed={seed}: exact exceeds the bound by {(exact - bound).max():.3g} > {tol:.3g}"


def test_selection_is_exact_top_k():
    """select_pages == brute force: forced sink/local pages plus the top-scoring others."""
    rng = np.random.default_rng(5)
    S = 8
    for _ in range(20):
        B, K, W = 3, 2, int(rng.integers(4, 40))
        scores = rng.normal(size=(B, K, W)).astype(np.float32)
        last = rng.integers(0, W * S, B)
        k, sink, local = int(rng.integers(3, 12)), int(rng.integers(0, 3)), int(rng.integers(1, 3))
        select = jax.jit(lambda s, f, l: select_pages(s, f, l, block_size=S, k=k, sink_pages=sink,
                                                      local_pages=local))  # one program, not op by op
        got = np.asarray(select(jnp.asarray(scores), jnp.asarray(last), jnp.asarray(last)))
        for b in range(B):
            lp = last[b] // S
            for h in range(K):
                valid = list(range(lp + 1))
                forced = [w for w in valid if w < sink or w >= lp - local + 1]
                rest = sorted((w for w in valid if w not in forced), key=lambda w: -scores[b, h, w])
                sel = [int(x) for x in got[b, h] if x >= 0]
                if len(forced) <= min(k, W):
                    assert sel == sorted(forced + rest[:min(k, W) - len(forced)]), (b, h)
                else:
                    assert set(sel) <= set(forced)


# Each trial draws its own shapes and budgets, so each compiles: CI draws 12, `make test-slow` 30.
@pytest.mark.parametrize("trials", [12, pytest.param(30, marks=pytest.mark.slow)])
def test_top_p_selection_is_the_brute_force_mass_cut(trials):
    """budget_mode=topp: of the top k, the forced pages, the first min_k, and each page preceded by
    less than top_p of the free pages' softmax mass (all free pages' mass, at `scale`)."""
    rng = np.random.default_rng(6)
    S = 8
    for trial in range(trials):
        B, K, W = 2, 2, int(rng.integers(6, 40))
        # Peaked rows (a few large scores) and flat ones, so both ends of the cut are exercised.
        scores = (rng.normal(size=(B, K, W)) * rng.choice([0.1, 1.0, 8.0], size=(B, K, 1))).astype(np.float32)
        last = rng.integers(W * S // 2, W * S, B)
        k, sink, local = int(rng.integers(3, 16)), int(rng.integers(0, 2)), int(rng.integers(1, 3))
        p, min_k, scale = float(rng.choice([0.3, 0.7, 0.9])), int(rng.integers(0, 3)), float(rng.choice([0.5, 2.0]))
        def cut(scores, last):  # one program per trial: op by op, each new shape compiles its own ops
            s, top_s, top_i = rank_pages(scores, last, last, block_size=S, k=k, sink_pages=sink, local_pages=local)
            return kept_pages(top_i, within_mass(s, top_s, MassCut(p, min_k, scale)), W)

        got = np.asarray(jax.jit(cut)(jnp.asarray(scores), jnp.asarray(last)))
        for b in range(B):
            lp = last[b] // S
            for h in range(K):
                valid = list(range(lp + 1))
                forced = [w for w in valid if w < sink or w >= lp - local + 1]
                free = sorted((w for w in valid if w not in forced), key=lambda w: -scores[b, h, w])
                e = np.exp(scale * (scores[b, h, free] - scores[b, h, free].max())) if free else np.zeros(0)
                ranked = (forced + free)[:min(k, W)]
                keep = []
                for col, w in enumerate(ranked):
                    before = e[:free.index(w)].sum() if w in free else 0.0
                    if w in forced or col < min_k or before < p * e.sum():
                        keep.append(w)
                sel = [int(x) for x in got[b, h] if x >= 0]
                assert sel == sorted(keep), (trial, b, h, p, min_k, sel, sorted(keep))


def test_top_p_one_is_the_fixed_budget_and_a_lower_p_reads_less():
    """top_p=1 selects exactly what the fixed budget selects (the same tokens and logits); a low p
    on the same prompt reads fewer pages, counted in pages_selected and kv_bytes_read."""
    seed = 9
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    model = random_model(cfg, seed)
    prompt = random_prompts(rng, cfg.vocab_size, (150,))[0]
    params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
    base = dict(enabled=True, budget=64, sink_pages=1, local_pages=2)
    fixed = _engine(model, base).generate(prompt, params, return_logits=True)
    one = _engine(model, dict(base, budget_mode="topp", top_p=1.0)).generate(prompt, params, return_logits=True)
    assert one.tokens == fixed.tokens, f"seed={seed}"
    # The same pages, read by another program (the top-p one): its sums may round in another order.
    tol = logits_tolerance(cfg, context=150 + 6, reference=fixed.logits[0])
    np.testing.assert_allclose(one.logits[0], fixed.logits[0], atol=tol, rtol=0, err_msg=f"seed={seed}")
    assert one.stats["pages_selected"] == fixed.stats["pages_selected"]
    low = _engine(model, dict(base, budget_mode="topp", top_p=0.3)).generate(prompt, params)
    assert low.stats["pages_selected"] < fixed.stats["pages_selected"], (seed, low.stats, fixed.stats)
    assert low.stats["kv_bytes_read"] < fixed.stats["kv_bytes_read"]
    # Sink and local pages are always read: 3 of them per (step, layer, kv head) at the least.
    assert low.stats["pages_selected"] >= 6 * cfg.num_layers * cfg.num_kv_heads * 3


@pytest.mark.parametrize("sparse,match", [
    (dict(enabled=True, budget_mode="topk"), "budget_mode"),
    (dict(enabled=True, budget_mode="topp", top_p=0.0), "top_p"),
    (dict(enabled=True, budget_mode="topp", top_p=1.5), "top_p"),
    (dict(enabled=True, budget_mode="topp", top_p=True), "top_p"),
    (dict(enabled=True, budget=256, budget_mode="topp", min_budget=512), "min_budget"),
    (dict(enabled=True, budget=8), "sparse.budget"),
    (dict(enabled=True, digest="pca"), "sparse.digest"),
    (dict(enabled=True, budget=100_000), "top-k"),
    (dict(enabled=True, group_reduce="sum"), "group_reduce"),
    (dict(enabled=True, score_distance=64), "needs sparse.positions='compact'"),
    (dict(enabled=True, positions="compact", score_distance=-1), "score_distance"),
    (dict(enabled=True, last_token_alone="yes"), "last_token_alone"),
])
def test_bad_sparse_config(sparse, match):
    with pytest.raises(ConfigError, match=match):
        gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=1024, max_batch=1, sparse=sparse))


def test_sparse_needs_paged_cache():
    with pytest.raises(ConfigError, match="paged"):
        gj.config.from_dict(gj.EngineConfig, dict(cache=dict(kind="contiguous"), sparse=dict(enabled=True)))


@pytest.mark.parametrize("platform", [None, "gpu"])
def test_engine_pallas_sparse_matches_xla_sparse(platform):
    """The sparse Pallas kernel (interpret mode; the TPU kernel, the CPU default, and the GPU
    one) and the XLA sparse path agree inside the engine."""
    seed = 6
    rng = np.random.default_rng(seed)
    cfg = tiny_config("gemma2")
    model = random_model(cfg, int(rng.integers(100)))
    prompts = random_prompts(rng, cfg.vocab_size, (50, 23))
    params = gj.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    sparse = dict(enabled=True, budget=32, sink_pages=1, local_pages=2)
    outs = [_engine(model, sparse, attention_impl=impl, kernel_platform=platform).generate(
        prompts, params, return_logits=True) for impl in ("xla", "pallas")]
    assert outs[0].tokens == outs[1].tokens, f"seed={seed}"
    for a, b in zip(outs[0].logits, outs[1].logits):  # the kernel's softmax sums in its own order, per layer
        tol = logits_tolerance(cfg, context=50 + 4, reference=b)
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"seed={seed}")
    assert outs[0].stats["pages_selected"] == outs[1].stats["pages_selected"]


def test_compact_shift_lays_selected_pages_side_by_side():
    from gemini_jax.attention.select import compact_shift

    rng = np.random.default_rng(7)
    S, W = 8, 40
    for _ in range(20):
        last = int(rng.integers(6, W))
        local = 2
        picked = rng.choice(np.arange(1, last - local + 1), size=int(rng.integers(1, 5)), replace=False)
        pages = np.unique(np.concatenate([[0], picked, np.arange(last - local + 1, last + 1)]))
        sel = np.full((1, 1, len(pages) + 3), -1, np.int32)
        sel[0, 0, :len(pages)] = pages
        shift = compact_shift(sel, S)[0, 0, :len(pages)]
        new_start = pages * S + shift
        # Side by side, in order, and the local run (ending at the query's page) does not move.
        np.testing.assert_array_equal(new_start, (np.arange(len(pages)) - len(pages) + 1 + last) * S)
        assert (shift[-local:] == 0).all()
        np.testing.assert_array_equal(np.asarray(compact_shift(jnp.asarray(sel), S))[0, 0, :len(pages)], shift)


def test_page_shift_equals_keys_roped_at_the_new_position():
    """Rotating a stored (roped) key by s is the key roped at p + s: attention sees the new distance."""
    from gemini_jax.attention.sparse import sparse_attention
    from gemini_jax.model import layers as L

    seed = 8
    rng = np.random.default_rng(seed)
    B, K, G, D, S, P = 1, 2, 2, 16, 4, 9
    inv = L.inv_frequencies(gj.RopeConfig(theta=10000.0), D)
    k0 = rng.standard_normal((K, P, S, D)).astype(np.float32)  # un-roped keys, page p at positions p*S..
    v = rng.standard_normal((K, P, S, D)).astype(np.float32)
    q0 = rng.standard_normal((B, 1, K * G, D)).astype(np.float32)

    def rope_keys(pos_of_page):
        out = np.empty_like(k0)
        for p in range(P):
            pos = jnp.asarray(pos_of_page[p] * S + np.arange(S))[None]
            cos, sin = L.rope_angles(pos, inv)
            out[:, p] = np.asarray(L.apply_rope(jnp.asarray(k0[:, p].transpose(1, 0, 2))[None], cos, sin))[0].transpose(1, 0, 2)
        return out

    qpos = np.array([[P * S - 1]])
    cos, sin = L.rope_angles(jnp.asarray(qpos), inv)
    q = L.apply_rope(jnp.asarray(q0), cos, sin)
    sel = np.array([[[1, 5, 8]] * K], np.int32)
    shift = np.array([[[6, 2, 0]] * K], np.int32)  # pages 1, 5 move to 7, 7 (as a layout would not, but any s works)
    bt = np.arange(P, dtype=np.int32)[None]
    lengths = np.array([P * S])
    kw = dict(scale=D ** -0.5)
    got = sparse_attention((q, jnp.asarray(qpos)), (jnp.asarray(rope_keys(np.arange(P))), jnp.asarray(v)),
                           PageView(bt, lengths), Selection(jnp.asarray(sel), jnp.asarray(shift * S), inv), **kw)
    moved = np.arange(P).copy()
    moved[1], moved[5] = 7, 7
    want = sparse_attention((q, jnp.asarray(qpos)), (jnp.asarray(rope_keys(moved)), jnp.asarray(v)),
                            PageView(bt, lengths), Selection(jnp.asarray(sel)), **kw)
    # Two rotations against one (an angle p * f rounds in proportion to p: up to P * S), then attention.
    tol = float_tolerance(depth=3, terms=P * S, magnitude=np.abs(np.asarray(want)).max())
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=tol, rtol=0, err_msg=f"seed={seed}")
    plain = sparse_attention((q, jnp.asarray(qpos)), (jnp.asarray(rope_keys(np.arange(P))), jnp.asarray(v)),
                             PageView(bt, lengths), Selection(jnp.asarray(sel)), **kw)
    moved_by = np.max(np.abs(np.asarray(plain) - np.asarray(want)))
    assert moved_by > 100 * tol, f"seed={seed}: the shift moved the output by {moved_by:.3g} only"  # it matters


def test_compact_positions_refused_for_two_rope_families():
    cfg = tiny_config("gemma3")
    with pytest.raises(ConfigError, match="compact"):
        _engine(random_model(cfg, 1), dict(enabled=True, budget=32, positions="compact"))


def test_padding_queries_do_not_score_pages():
    """A chunk padded to a power of two: whatever the padding queries hold, the selection is the
    one its real queries make (the last `score_queries` real ones, or all of them)."""
    from gemini_jax.attention.select import scoring_queries, select_step

    rng = np.random.default_rng(9)
    B, T, H, K, D, S, W = 3, 16, 4, 2, 8, 8, 12
    n_real = np.array([16, 5, 1])
    start = rng.integers(0, 4, B) * S
    q_pos = jnp.asarray(start[:, None] + np.arange(T), jnp.int32)
    lengths = jnp.asarray(start + n_real, jnp.int32)
    dig = jnp.asarray(rng.normal(size=(K, 64, 2, D)).astype(np.float32))
    tables = jnp.asarray(rng.permutation(64)[:B * W].reshape(B, W), jnp.int32)
    q = rng.normal(size=(B, T, H, D)).astype(np.float32)
    for sq in (0, 3, 64):
        sp = gj.config.SparseConfig(enabled=True, budget=32, score_queries=sq, sparse_prefill=True)
        want = None
        for trial in range(2):  # two different paddings
            qq = q.copy()
            for b in range(B):
                qq[b, n_real[b]:] = rng.normal(scale=50.0, size=(T - n_real[b], H, D))
            got = np.asarray(select_step(sp, dig, (jnp.asarray(qq), q_pos), PageView(tables, lengths), block_size=S))
            want = got if want is None else want
            np.testing.assert_array_equal(got, want)
            picked = np.asarray(scoring_queries(jnp.asarray(qq), q_pos, lengths, sq)[0])
            for b in range(B):
                m = sq if 0 < sq < T else T
                real = qq[b, max(n_real[b] - m, 0):n_real[b]]
                assert {r.tobytes() for r in picked[b]} == {r.tobytes() for r in real}, (sq, b)


@pytest.mark.parametrize("sparse,alone", [
    (dict(enabled=True, sparse_prefill=True), True),
    (dict(enabled=True, sparse_prefill=True, last_token_alone=False), False),
    (dict(enabled=True), False),  # dense prefill: chunks as configured
    ({}, False),
])
def test_last_prompt_token_runs_alone_under_sparse_prefill(sparse, alone):
    rng = np.random.default_rng(10)
    eng = _engine(random_model(tiny_config("llama"), 5), dict(sparse, budget=32) if sparse else None)
    n = int(rng.integers(20, 60))
    from gemini_jax.runtime.chunking import prefill_pieces

    pieces = [k for _, _, k in prefill_pieces(eng.config, np.arange(n, dtype=np.int32), 0)]
    assert sum(pieces) == n
    chunk = eng.config.prefill_chunk
    want = [chunk] * ((n - 1) // chunk) + [(n - 1) % chunk + 1]
    if alone:
        want = want[:-1] + ([want[-1] - 1] if want[-1] > 1 else []) + [1]
    assert pieces == want


def test_score_distance_digests_hold_unroped_keys_and_bound_scores_at_that_distance():
    """sparse.score_distance: the digests bound the keys before rope, and a page's score bounds
    q . k for each of its keys re-roped at `score_distance` tokens before the query."""
    from gemini_jax.attention.select import page_scores, select_step
    from gemini_jax.model import layers as L
    from gemini_jax.runtime import PooledRunner, new_stats

    seed = 11
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    d = int(rng.integers(8, 60))
    sparse = dict(enabled=True, budget=32, positions="compact", score_distance=d, sparse_prefill=True)
    eng = _engine(random_model(cfg, int(rng.integers(100))), sparse)
    runner = PooledRunner(eng.ctx, 1, new_stats())
    runner.prefill(0, np.asarray(random_prompts(rng, cfg.vocab_size, (70,))[0], np.int32))
    seq = eng.pages.seqs[runner.ids[0]]
    inv = L.inv_frequencies(cfg.rope, cfg.head_dim)
    k = np.asarray(eng.store.device.k)  # [L, K, P, S, D], roped at true positions
    dig = np.asarray(eng.store.device.digests)
    raw = []
    for i, page in enumerate(seq.pages):
        count = min(8, seq.num_tokens - i * 8)
        cos, sin = L.rope_angles(-jnp.arange(i * 8, i * 8 + count)[None], inv)  # [1, count, D]
        keys = np.asarray(L.rotate(jnp.asarray(k[:, :, page, :count]), cos[0], sin[0]))  # [L, K, count, D]
        raw.append(keys)
        # Keys turned back by rope here and in the engine: one rotation (two products and a sum) each.
        tol = float_tolerance(depth=2, terms=2, magnitude=np.abs(keys).max())
        np.testing.assert_allclose(dig[:, :, page, 0], keys.min(2), atol=tol, rtol=0, err_msg=f"seed={seed} page {page}")
        np.testing.assert_allclose(dig[:, :, page, 1], keys.max(2), atol=tol, rtol=0, err_msg=f"seed={seed} page {page}")
    # Scores: an upper bound of q . (key roped at p - d), per page, for a random query at p.
    p = seq.num_tokens - 1
    q = rng.normal(size=(1, 1, cfg.num_heads, cfg.head_dim)).astype(np.float32)
    sp = eng.config.sparse
    table = jnp.asarray([seq.pages], jnp.int32)
    cos, sin = L.rope_angles(-(jnp.asarray([[p]]) - d), inv)
    q_turned = L.rotate(jnp.asarray(q), cos[:, :, None], sin[:, :, None])
    bound = np.asarray(page_scores("minmax", q_turned, jnp.asarray(dig[0][:, table[0]])[None], sp.group_reduce))[0]
    G = cfg.num_heads // cfg.num_kv_heads
    cq, sq_ = L.rope_angles(jnp.asarray([[p]]), inv)
    q_roped = np.asarray(L.rotate(jnp.asarray(q), cq[:, :, None], sq_[:, :, None]))[0, 0]  # [H, D]
    for i, keys in enumerate(raw):
        ck, sk = L.rope_angles(jnp.full((1, keys.shape[2]), p - d), inv)
        k_at = np.asarray(L.rotate(jnp.asarray(keys[0]), ck, sk))  # [K, count, D] roped at p - d
        # Either side: rotations of q and of the keys (rounding in turn), then a sum of head_dim products.
        tol = float_tolerance(depth=4, terms=cfg.head_dim,
                              magnitude=float(np.abs(q_roped).sum(-1).max() * np.abs(k_at).max()))
        for h in range(cfg.num_kv_heads):
            exact = max(float((k_at[h] @ q_roped[h * G + g]).max()) for g in range(G))
            assert bound[h, i] >= exact - tol, f"seed={seed} head {h} page {i}: {exact - bound[h, i]:.3g} > {tol:.3g}"
    # select_step turns the query the same way: its top page is the top-bound page (after the forced ones).
    sel = np.asarray(select_step(sp, jnp.asarray(dig[0]), (jnp.asarray(q), jnp.asarray([[p]], jnp.int32)),
                                 PageView(table, jnp.asarray([p + 1])), block_size=8, inv_freq=inv))[0]
    W = len(raw)
    for h in range(cfg.num_kv_heads):
        free = range(1, W - 2)  # not sink (0), not local (last two)
        best = max(free, key=lambda w: bound[h, w])
        assert best in sel[h].tolist(), h
    runner.close()


def _brute_rerank(scores, keys, q, lengths, first, last, *, S, k, factor, sink, local):
    """Reference two-stage selection in numpy: the digest scores' candidates (forced pages + the
    best others, factor x k in all), then their exact max q.k (over the queries, the group's heads
    and the page's real keys) picks k."""
    B, K, W = scores.shape
    G = q.shape[2] // K
    out = np.full((B, K, k), -1, np.int64)
    for b in range(B):
        valid = list(range(last[b] // S + 1))
        forced = [w for w in valid if w < sink or w >= first[b] // S - local + 1]
        for h in range(K):
            rest = sorted((w for w in valid if w not in forced), key=lambda w: -scores[b, h, w])
            cand = forced + rest[:min(factor * k, W) - len(forced)]
            exact = {}
            for w in cand:
                n = min(S, lengths[b] - w * S)
                logits = np.einsum("tgd,sd->tgs", q[b][:, h * G:(h + 1) * G], keys[b, h, w, :n])
                exact[w] = logits.max()
            others = sorted((w for w in cand if w not in forced), key=lambda w: -exact[w])
            sel = sorted(forced + others[:k - len(forced)])
            out[b, h, :len(sel)] = sel
    return out


@pytest.mark.parametrize("distance", [0, 24])
def test_rerank_picks_exact_top_k_among_digest_candidates(distance):
    """select_step with rerank == brute force: digest candidates, then exact scores over their keys
    (with score_distance: un-roped keys meet queries turned to that distance)."""
    from gemini_jax.attention.digests import page_digest
    from gemini_jax.attention.select import select_step
    from gemini_jax.model import layers as L

    rng = np.random.default_rng(12)
    B, K, G, D, S, W, m = 2, 2, 2, 16, 8, 24, 3
    P = B * W + 1
    inv = L.inv_frequencies(gj.RopeConfig(theta=10000.0), D)
    lengths = rng.integers(10 * S, W * S, B)
    tables = rng.permutation(np.arange(1, P))[:B * W].reshape(B, W).astype(np.int32)
    raw = rng.normal(size=(B, K, W, S, D)).astype(np.float32)  # keys before rope, logical order
    pos = np.arange(W * S).reshape(W, S)
    cos, sin = L.rope_angles(jnp.asarray(pos), inv)
    roped = np.asarray(L.rotate(jnp.asarray(raw), cos, sin))
    pool = rng.normal(size=(K, P, S, D)).astype(np.float32) * 50  # pages no table holds: noise
    for b in range(B):
        pool[:, tables[b]] = roped[b]
    held = raw if distance else roped  # what the digests bound
    dig = np.zeros((K, P, 2, D), np.float32)
    for b in range(B):
        for h in range(K):
            for w in range(W):
                n = int(np.clip(lengths[b] - w * S, 0, S))
                if n:
                    dig[h, tables[b, w]] = np.asarray(page_digest("minmax", jnp.asarray(held[b, h, w:w + 1]),
                                                                  jnp.asarray([n])))[0]
    q_pos = (lengths - m)[:, None] + np.arange(m)
    q = rng.normal(size=(B, m, K * G, D)).astype(np.float32)
    sp = gj.config.SparseConfig(enabled=True, budget=6 * S, sink_pages=1, local_pages=2, rerank=2, score_queries=0,
                         positions="compact" if distance else "true", score_distance=distance)
    got, _ = select_step(sp, jnp.asarray(dig), (jnp.asarray(q), jnp.asarray(q_pos)),
                         PageView(jnp.asarray(tables), jnp.asarray(lengths)), block_size=S, inv_freq=inv,
                         k_layer=jnp.asarray(pool))
    # The reference scores with what select_step's queries meet: turned by -(p - d) against
    # un-roped keys, or as they are against the roped keys.
    if distance:
        c, s = L.rope_angles(jnp.asarray(-(q_pos - distance)), inv)
        q_ref = np.asarray(L.rotate(jnp.asarray(q), c[:, :, None], s[:, :, None]))
    else:
        q_ref = q
    qp = np.concatenate([np.minimum(q_ref, 0), np.maximum(q_ref, 0)], -1).reshape(B, m, K, G, 2 * D)
    bounds = np.einsum("btkgd,kbwd->bkgtw", qp, dig[:, tables].reshape(K, B, W, 2 * D)).max(axis=(2, 3))
    # k: 6 budget pages + the call's own (a 3-query call: T // S + 1 = 1 more).
    want = _brute_rerank(bounds, held, q_ref, lengths, q_pos[:, 0], q_pos[:, -1], S=S, k=7, factor=2, sink=1, local=2)
    np.testing.assert_array_equal(np.asarray(got), want)


def test_rerank_counts_the_candidates_keys():
    rng = np.random.default_rng(13)
    cfg = tiny_config("llama")
    model = random_model(cfg, int(rng.integers(1000)))
    prompts = random_prompts(rng, cfg.vocab_size, (60, 101))
    params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
    small = dict(enabled=True, budget=32, sink_pages=1, local_pages=2)  # 4 pages of 8 tokens
    plain = _engine(model, small).generate(prompts, params)
    rr = _engine(model, dict(small, rerank=2)).generate(prompts, params)
    # Both contexts hold >= 8 pages at every step: 8 candidates' keys read on top of 4 pages' K and V.
    assert rr.stats["pages_selected"] == plain.stats["pages_selected"]
    assert rr.stats["kv_bytes_read"] == 2 * plain.stats["kv_bytes_read"]


@pytest.mark.parametrize("extra,match", [
    (dict(sparse=dict(enabled=True, budget=256, rerank=1)), "sparse.rerank"),
    (dict(sparse=dict(enabled=True, budget=256, rerank=2), tier=dict(enabled=True)), "sparse.rerank"),
])
def test_bad_rerank_config(extra, match):
    with pytest.raises(ConfigError, match=match):
        gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=1024, max_batch=1, **extra))


@pytest.mark.parametrize("seed,m", [(3, 1), (4, 1), (5, 8)])
def test_unroped_exact_scores_split_into_slot_and_page_rotations_equal_per_key_unrope(seed, m):
    """exact_page_scores with the rope's inv_freq (numpy) turns keys by their slot, then by their
    page either the few queries (m = 1, a decode step) or, when the queries outnumber a page's
    keys (m = 8 of a group of 4 > 16 slots, a prefill chunk), the keys; with the same frequencies
    as a jax array it un-ropes each key by its position. All are R(-(pS + s)): they differ by
    rounding only (a few rotations and a D-term dot)."""
    from gemini_jax.attention.select import exact_page_scores
    from gemini_jax.model import layers as L

    rng = np.random.default_rng(seed)
    B, K, G, D, S, W, P, n = 2, 2, 4, 64, 16, 40, 90, 12
    inv = L.inv_frequencies(gj.RopeConfig(theta=100000.0), D)
    q = jnp.asarray(rng.normal(size=(B, m, K * G, D)).astype(np.float32))
    pool = jnp.asarray(rng.normal(size=(K, P, S, D)).astype(np.float32))
    tables = jnp.asarray(rng.permutation(P)[:B * W].reshape(B, W).astype(np.int32))
    lengths = jnp.asarray(rng.integers(20 * S, W * S, B).astype(np.int32))
    pages = jnp.asarray(np.stack([np.stack([np.sort(rng.choice(20, n, replace=False)) for _ in range(K)])
                                  for _ in range(B)]).astype(np.int32))
    split = exact_page_scores(q, pool, tables, lengths, pages, group_reduce="max", unrope=inv)
    per_key = exact_page_scores(q, pool, tables, lengths, pages, group_reduce="max", unrope=jnp.asarray(inv))
    ref = np.asarray(per_key)
    tol = float_tolerance(depth=3, magnitude=float(np.abs(ref).max()), terms=D)  # 2 rotations, then q.k
    assert np.abs(np.asarray(split) - ref).max() <= tol, f"seed={seed} m={m}: {np.abs(np.asarray(split) - ref).max()} > {tol}"
