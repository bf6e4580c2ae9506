"""Paged cache: allocator properties (hypothesis), prefix reuse, fork copy-on-write, windows."""

import numpy as np
import pytest
from hypothesis import given, settings, strategies as st

import gemini_jax as gj
from gemini_jax.cache.block_pool import NULL_PAGE, BlockPool
from gemini_jax.cache.manager import KVCacheManager
from gemini_jax.errors import CacheExhausted
from gemini_jax.testing import logits_tolerance, random_model, random_prompts, tiny_config


def _owners(mgr: KVCacheManager) -> dict[int, int]:
    count: dict[int, int] = {}
    for s in mgr.seqs.values():
        for p in s.pages:
            if p != NULL_PAGE:
                count[p] = count.get(p, 0) + 1
    return count


ops = st.lists(st.tuples(st.sampled_from(["add", "append", "fork", "free", "window"]),
                         st.integers(0, 7), st.integers(1, 40)), max_size=60)


@settings(max_examples=150, deadline=None)
@given(ops=ops, num_pages=st.integers(2, 24), block=st.sampled_from([8, 16]))
def test_allocator_never_double_owns_or_leaks(ops, num_pages, block):
    """Random add / append / fork / free / window-drop sequences keep the pool consistent."""
    mgr = KVCacheManager(num_pages, block)
    vocab = 3  # a tiny vocabulary makes identical prefixes (and so prefix sharing) common
    rng = np.random.default_rng(0)
    next_id = 0
    for op, which, n in ops:
        live = sorted(mgr.seqs)
        snapshot = {s: (list(mgr.seqs[s].pages), mgr.seqs[s].num_tokens) for s in live}
        try:
            if op == "add":
                prompt = [int(x) for x in rng.integers(0, vocab, n)]
                reused = mgr.add_sequence(next_id, prompt)
                try:
                    mgr.reserve(next_id, len(prompt))
                except CacheExhausted:
                    mgr.free(next_id)
                    raise
                mgr.commit(next_id, prompt[reused:])
                next_id += 1
            elif live and op == "append":
                s = live[which % len(live)]
                mgr.reserve(s, mgr.seqs[s].num_tokens + n)
                mgr.commit(s, [int(x) for x in rng.integers(0, vocab, n)])
            elif live and op == "fork":
                mgr.fork(live[which % len(live)], next_id)
                next_id += 1
            elif live and op == "free":
                mgr.free(live[which % len(live)])
            elif live and op == "window":
                mgr.drop_outside_window(live[which % len(live)], n)
        except CacheExhausted:
            # Refused: no live sequence changed (the refused one was rolled back or never added).
            for s, (pages, ntok) in snapshot.items():
                assert mgr.seqs[s].pages == pages and mgr.seqs[s].num_tokens == ntok
        mgr.pool.check()
        owners = _owners(mgr)
        for p, c in owners.items():
            assert mgr.pool.refcount[p] == c, "refcount must equal the number of owning sequences"
        # Every page is either owned or free: nothing leaks, nothing is in both states.
        assert set(owners) | set(mgr.pool.free_queue) == set(range(1, num_pages))
        assert not set(owners) & set(mgr.pool.free_queue)
    for s in list(mgr.seqs):
        mgr.free(s)
    assert mgr.pool.num_free == num_pages - 1


def test_exhaustion_raises_and_keeps_live_sequences():
    mgr = KVCacheManager(5, 8)
    mgr.add_sequence(0, list(range(20)))
    mgr.reserve(0, 20)  # 3 pages
    mgr.commit(0, list(range(20)))
    before = list(mgr.seqs[0].pages)
    mgr.add_sequence(1, [7] * 30)
    with pytest.raises(CacheExhausted, match="num_pages"):
        mgr.reserve(1, 30)  # needs 4, one left
    assert mgr.seqs[0].pages == before and mgr.seqs[1].pages == []
    assert mgr.pool.num_free == 1


def test_free_unreferenced_cached_pages_are_evicted_lru():
    pool = BlockPool(4)
    a, b, _ = pool.allocate(), pool.allocate(), pool.allocate()
    pool.register(a, 111)
    pool.register(b, 222)
    pool.release(a)
    pool.release(b)  # free queue: a (older) then b; both still cached
    assert pool.cached(111) == a and pool.cached(222) == b
    assert pool.allocate() == a  # least recently freed goes first
    assert pool.cached(111) is None and pool.cached(222) == b and pool.evictions == 1


def _engine(model, **cache):
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=4200, prefill_chunk=512, max_batch=2, cache=dict(block_size=64, **cache))))


def test_prefix_reuse_4k_computes_only_suffix():
    """A second request sharing a 4K-token prefix computes only its suffix, same logits as cold."""
    seed = 1
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    model = random_model(cfg, int(rng.integers(1000)))
    prefix = random_prompts(rng, cfg.vocab_size, (4096,))[0]
    first = prefix + random_prompts(rng, cfg.vocab_size, (37,))[0]
    second = prefix + random_prompts(rng, cfg.vocab_size, (21,))[0]
    params = gj.SamplingParams(max_new_tokens=4, stop_at_eos=False)
    warm = _engine(model)
    warm.generate(first, params)
    out = warm.generate(second, params, return_logits=True)
    assert out.stats["prefill_tokens_reused"] == 4096
    assert out.stats["prefill_tokens_computed"] == 21
    cold = _engine(model, prefix_caching=False).generate(second, params, return_logits=True)
    assert cold.stats["prefill_tokens_reused"] == 0 and cold.stats["prefill_tokens_computed"] == 4117
    # The suffix attends over 4K cached keys in other chunks than the cold prefill did.
    tol = logits_tolerance(cfg, context=4117 + 4, reference=cold.logits)
    np.testing.assert_allclose(out.logits, cold.logits, atol=tol, rtol=0, err_msg=f"seed={seed}")
    assert out.tokens == cold.tokens, f"seed={seed}"


def test_fork_shares_full_pages_and_copies_the_partial_one():
    mgr = KVCacheManager(8, 8)
    mgr.add_sequence(0, [1] * 20)
    mgr.reserve(0, 20)
    mgr.commit(0, [1] * 20)
    copies = mgr.fork(0, 1)
    assert mgr.seqs[1].pages[:2] == mgr.seqs[0].pages[:2]  # full pages shared
    assert [(c.src, c.dst) for c in copies] == [(mgr.seqs[0].pages[2], mgr.seqs[1].pages[2])]
    assert mgr.seqs[1].pages[2] != mgr.seqs[0].pages[2]
    assert mgr.pool.refcount[mgr.seqs[0].pages[0]] == 2 and mgr.pool.refcount[mgr.seqs[0].pages[2]] == 1


def test_rewind_copies_partial_page_in_the_engine_pool():
    """A rewind to mid-page gives the sequence a private copy of its partial page (copy-on-write):
    the engine's pool holds the source page's bytes at the copy, and decoding on from there gives
    the logits of a fresh forward over the kept tokens."""
    seed = 4
    rng = np.random.default_rng(seed)
    cfg = tiny_config("tiny")
    eng = _engine(random_model(cfg, seed))
    S = eng.config.cache.block_size
    prompt = random_prompts(rng, cfg.vocab_size, (100,))[0]
    sess = eng.start(prompt, gj.SamplingParams(max_new_tokens=4, temperature=0.0, stop_at_eos=False))
    sess.run()
    tokens = sess.tokens
    keep = 80  # the rewind keeps 79 tokens' KV (page 1 holds 15 of them) and recomputes the 80th
    page = (keep - 1) // S
    src = eng.pages.seqs[sess.seq_id].pages[page]
    k_src, v_src, _ = eng.store.gather([src])  # [L, K, 1, S, D] from the engine's device pool
    assert np.abs(k_src[:, :, 0, :(keep - 1) % S]).max() > 0, "the source page holds no KV"
    sess.rewind(keep)
    dst = eng.pages.seqs[sess.seq_id].pages[page]
    assert dst != src
    n = (keep - 1) % S
    k_dst, v_dst, _ = eng.store.gather([dst])
    np.testing.assert_array_equal(k_dst[:, :, 0, :n], k_src[:, :, 0, :n], err_msg=f"seed={seed}")
    np.testing.assert_array_equal(v_dst[:, :, 0, :n], v_src[:, :, 0, :n], err_msg=f"seed={seed}")
    logits = [np.asarray(sess.logits)[0]]
    cont = []
    for tok in sess:
        cont.append(tok)
        logits.append(np.asarray(sess.logits)[0])
    assert len(cont) == 4
    ref = np.asarray(gj.forward(eng.model, tokens[:keep] + cont))[keep - 1:]
    tol = logits_tolerance(cfg, context=keep + 4, reference=ref)
    np.testing.assert_allclose(np.stack(logits), ref, atol=tol, rtol=0, err_msg=f"seed={seed}")
    sess.close()
    assert eng.pages.pool.num_used == 0


def _run_counting_pages(cfg, seed, prompt_len=120):
    """Generate 2 tokens with a spy on commit: (output, prompt, [(tokens committed, live pages)])."""
    params = gj.SamplingParams(max_new_tokens=2, stop_at_eos=False)
    eng = gj.Engine(random_model(cfg, seed), gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=256, prefill_chunk=16, cache=dict(block_size=8, prefix_caching=False))))
    prompt = random_prompts(np.random.default_rng(seed), cfg.vocab_size, (prompt_len,))[0]
    held = []
    orig_commit = eng.pages.commit

    def spy(sid, toks):
        orig_commit(sid, toks)
        held.append((eng.pages.seqs[sid].num_tokens, len(eng.pages.live_pages())))

    eng.pages.commit = spy
    out = eng.generate(prompt, params, return_logits=True)
    ref = np.asarray(gj.forward(eng.model, prompt + out.tokens))[len(prompt) - 1:len(prompt) + 1]
    tol = logits_tolerance(cfg, context=prompt_len + 2, reference=ref)
    np.testing.assert_allclose(out.logits, ref, atol=tol, rtol=0, err_msg=f"{cfg.family} seed={seed}")
    return out, prompt, held


def test_sliding_window_frees_pages_only_when_no_layer_needs_them():
    # Every layer slides (Mistral-like): pages behind the window are released during prefill.
    cfg = tiny_config("mistral", layer_windows=(20, 20, 20))
    _, _, held = _run_counting_pages(cfg, seed=2)
    assert max(live for _, live in held) <= 20 // 8 + 3  # window pages + one chunk's worth, never the whole prompt
    # One global layer (Gemma-2-like): nothing may be dropped, every page of every token stays live.
    cfg2 = tiny_config("gemma2")
    assert cfg2.max_window == 0
    _, prompt, held2 = _run_counting_pages(cfg2, seed=3)
    assert held2[-1][0] == len(prompt) + 1  # the prompt and the first generated token were written
    for n_tokens, live in held2:
        assert live == -(-n_tokens // 8), f"{live} pages live for {n_tokens} tokens: a page was dropped"


@pytest.mark.parametrize("family,platform", [("llama", None), ("gemma2", None), ("gemma2", "gpu")])
def test_engine_pallas_decode_matches_xla(family, platform):
    """attention_impl='pallas' (interpret mode on CPU) gives the XLA path's logits and tokens, with
    the TPU kernels (the CPU default) and with the GPU (Triton) kernels."""
    seed = 2
    rng = np.random.default_rng(seed)
    cfg = tiny_config(family)
    model = random_model(cfg, int(rng.integers(100)))
    prompts = random_prompts(rng, cfg.vocab_size, (5, 19, 11))
    params = gj.SamplingParams(max_new_tokens=5, stop_at_eos=False)
    outs = {}
    for impl in ("xla", "pallas"):
        eng = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
            max_seq_len=48, prefill_chunk=16, attention_impl=impl, kernel_platform=platform,
            cache=dict(block_size=8))))
        outs[impl] = eng.generate(prompts, params, return_logits=True)
    assert outs["xla"].tokens == outs["pallas"].tokens, f"seed={seed}"
    for a, b in zip(outs["xla"].logits, outs["pallas"].logits):  # the kernel's softmax sums in its own order
        np.testing.assert_allclose(a, b, atol=logits_tolerance(cfg, context=19 + 5, reference=a), rtol=0,
                                   err_msg=f"seed={seed}")
