"""Several decode tokens per device program (`decode_steps_per_call` k > 1) against one jitted
step per token (k = 1): the same tokens, the same logits (to float rounding), the same stops and counters,
for every cache kind and family; a session interrupted inside a k-step call resumes exactly as
the k = 1 session does."""

import dataclasses

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.testing import FAMILIES, float_tolerance, logits_tolerance, random_model, random_prompts, tiny_config

K = 5  # not a divisor of the token counts below: calls end inside the loop and at its end

KINDS = {
    "contiguous": dict(cache=dict(kind="contiguous")),
    "paged": dict(cache=dict(kind="paged", block_size=8)),
    "sparse": dict(cache=dict(kind="paged", block_size=8),
                   sparse=dict(enabled=True, budget=24, sink_pages=1, local_pages=1)),
    "sparse_compact": dict(cache=dict(kind="paged", block_size=8),
                           sparse=dict(enabled=True, budget=24, sink_pages=1, local_pages=1, positions="compact",
                                       score_distance=16)),
}


def _engine(model, k, kind, **over):
    cfg = dict(max_seq_len=160, prefill_chunk=32, max_batch=4, decode_steps_per_call=k, **KINDS[kind])
    cfg.update(over)
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, cfg))


def _same(a, b, what, cfg):
    assert a.tokens == b.tokens, f"{what}: tokens differ"
    tol = logits_tolerance(cfg, context=160, reference=a.logits)  # contexts stay within max_seq_len
    for x, y in zip(a.logits, b.logits):
        assert x.shape == y.shape, f"{what}: {x.shape} vs {y.shape} logits"
        np.testing.assert_allclose(x, y, rtol=0, atol=tol, err_msg=f"{what}: logits differ")
    for c in ("decode_steps", "compute_units", "prefill_tokens_computed"):
        assert a.stats[c] == b.stats[c], f"{what}: {c} {a.stats[c]} vs {b.stats[c]}"


# CI leaves out plain sparse: sparse_compact runs the sparse step too, and the interrupt test below
# runs k-step sparse calls.
@pytest.mark.parametrize("kind", [pytest.param(k, marks=pytest.mark.slow) if k == "sparse" else k for k in KINDS])
def test_k_steps_equal_one_step_per_cache_kind(kind):
    """Greedy and sampled (temperature, top-k, top-p), a batch of unequal prompts: k = 5 == k = 1."""
    seed = 101
    rng = np.random.default_rng(seed)
    model = random_model(tiny_config("llama"), seed)
    prompts = random_prompts(rng, model.cfg.vocab_size, (37, 9, 70))
    one, many = _engine(model, 1, kind), _engine(model, K, kind)
    for params in (gj.SamplingParams(max_new_tokens=23, temperature=0.0, stop_at_eos=False),
                   gj.SamplingParams(max_new_tokens=12, temperature=1.3, top_k=30, top_p=0.9, seed=7,
                                     stop_at_eos=False)):
        a = one.generate(prompts, params, return_logits=True)
        b = many.generate(prompts, params, return_logits=True)
        _same(a, b, f"{kind} seed={seed} {params}", model.cfg)
        assert b.stats["decode_steps"] == params.max_new_tokens - 1


@pytest.mark.parametrize("family", FAMILIES)
def test_k_steps_equal_one_step_per_family(family):
    seed = 202 + FAMILIES.index(family)
    rng = np.random.default_rng(seed)
    model = random_model(tiny_config(family), seed)
    prompts = random_prompts(rng, model.cfg.vocab_size, (30, 51))
    params = gj.SamplingParams(max_new_tokens=17, temperature=0.8, seed=3, stop_at_eos=False)
    a = _engine(model, 1, "paged").generate(prompts, params, return_logits=True)
    b = _engine(model, 4, "paged").generate(prompts, params, return_logits=True)
    _same(a, b, f"{family} seed={seed}", model.cfg)


def test_eos_stops_rows_on_device_as_one_step_does():
    """EOS chosen so that one row stops early, inside a call: kept tokens, steps and counters agree."""
    seed = 303
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    prompts = random_prompts(rng, cfg.vocab_size, (21, 44))
    free = _engine(random_model(cfg, seed), 1, "paged").generate(
        prompts, gj.SamplingParams(max_new_tokens=20, stop_at_eos=False)).tokens
    eos = free[0][7]  # row 0 stops at (or before) its 8th token
    model = random_model(dataclasses.replace(cfg, eos_id=int(eos)), seed)
    params = gj.SamplingParams(max_new_tokens=20)
    a = _engine(model, 1, "paged").generate(prompts, params, return_logits=True)
    b = _engine(model, K, "paged").generate(prompts, params, return_logits=True)
    _same(a, b, f"eos seed={seed}", model.cfg)
    assert a.tokens[0][-1] == eos and len(a.tokens[0]) <= 8, "the planted EOS did not stop row 0"
    # Both rows done -> the loop stops: no step past the last row's end.
    want = max(len(t) for t in a.tokens) - 1
    assert b.stats["decode_steps"] == want


def test_scoring_equal():
    """Teacher-forced scoring (the bits-per-byte path) through k-step programs."""
    seed = 404
    rng = np.random.default_rng(seed)
    model = random_model(tiny_config("qwen3"), seed)
    prompts = random_prompts(rng, model.cfg.vocab_size, (25, 25, 40))
    conts = random_prompts(rng, model.cfg.vocab_size, (13, 13, 6))
    a = _engine(model, 1, "sparse").score(prompts, conts)
    b = _engine(model, K, "sparse").score(prompts, conts)
    # Log-probabilities: the logits' bound, and the log-sum-exp over the vocabulary on top.
    cfg = model.cfg
    tol = float_tolerance(depth=cfg.num_layers + 1, terms=max(cfg.intermediate_size, cfg.vocab_size, 160),
                          magnitude=max(float(np.abs(x).max()) for x in a.tokens))
    for x, y in zip(a.tokens, b.tokens):
        np.testing.assert_allclose(x, y, rtol=0, atol=tol, err_msg=f"seed={seed}")


def test_tiered_runs_one_step_per_token():
    """Over tiers the runner has no k-step program: k > 1 takes the one-step path, same tokens."""
    seed = 505
    model = random_model(tiny_config("llama"), seed)
    prompt = random_prompts(np.random.default_rng(seed), model.cfg.vocab_size, (60,))[0]
    tier = dict(enabled=True, device_fraction=0.5)
    params = gj.SamplingParams(max_new_tokens=9, stop_at_eos=False)
    a = _engine(model, 1, "paged").generate(prompt, params)
    b = _engine(model, K, "paged", tier=tier).generate(prompt, params)
    assert a.tokens == b.tokens and b.stats["decode_steps"] == 8, f"seed={seed}"


# CI interrupts the sparse case (paged k-step calls are the per-kind and per-family tests').
@pytest.mark.parametrize("kind", [pytest.param("paged", marks=pytest.mark.slow), "sparse"])
def test_interrupt_inside_a_call_snapshot_resume_equals_one_step(kind, tmp_path):
    """Stop after a random number of yielded tokens (inside a k-step call), snapshot, resume
    with an instruction: tokens and logits equal the k = 1 session's, and the state at the stop
    holds exactly the yielded tokens."""
    seed = 606
    rng = np.random.default_rng(seed)
    model = random_model(tiny_config("llama"), seed)
    vocab = model.cfg.vocab_size
    engines = {k: _engine(model, k, kind) for k in (1, 8)}
    for case in range(4):
        prompt = random_prompts(rng, vocab, (int(rng.integers(5, 50)),))[0]
        stop = int(rng.integers(1, 20))
        assert stop % 8 or case, "the first case must stop inside a call"
        instr = random_prompts(rng, vocab, (int(rng.integers(1, 6)),))[0]
        params = gj.SamplingParams(max_new_tokens=30, temperature=0.9, seed=case, stop_at_eos=False)
        got = {}
        for k, eng in engines.items():
            sess = eng.start(prompt, params)
            toks = []
            for t in sess:
                toks.append(t)
                if len(toks) == stop:
                    sess.interrupt()
            assert sess.position == len(prompt) + stop and sess.tokens == prompt + toks, f"seed={seed} case={case}"
            assert len(eng.pages.seqs[sess.seq_id].pages) == -(-sess.position // 8), "pages past the state kept"
            sess.snapshot(str(tmp_path / f"{kind}{case}k{k}"))
            last = np.asarray(sess.logits)
            sess.close()
            r = eng.resume(str(tmp_path / f"{kind}{case}k{k}"), instr,
                           params=dataclasses.replace(params, max_new_tokens=11))
            more = r.run()
            got[k] = (toks, more, last, np.asarray(r.logits))
            r.close()
            assert not eng.pages.seqs and eng.pages.pool.num_used == 0, "sessions leaked pages"
        (t1, m1, l1, e1), (t8, m8, l8, e8) = got[1], got[8]
        assert t1 == t8 and m1 == m8, f"seed={seed} case={case} stop={stop}"
        tol = logits_tolerance(model.cfg, context=160, reference=[l1, e1])
        np.testing.assert_allclose(l8, l1, rtol=0, atol=tol, err_msg=f"seed={seed} case={case}: logits at the stop")
        np.testing.assert_allclose(e8, e1, rtol=0, atol=tol, err_msg=f"seed={seed} case={case}: logits at the end")


def test_budget_cuts_the_call_short():
    """A budget that allows 5 tokens: the k-step session computes no more than it may yield."""
    model = random_model(tiny_config("llama"), 707)
    eng = _engine(model, 8, "paged")
    L = model.cfg.num_layers
    sess = eng.start([1, 2, 3, 4], gj.SamplingParams(max_new_tokens=50, stop_at_eos=False), budget=9 * L)
    got = []
    with pytest.raises(gj.errors.BudgetExceeded):
        for t in sess:
            got.append(t)
    assert len(got) == 5 and sess.stats["decode_steps"] == 5
    sess.close()


def test_bad_steps_per_call_refused():
    for bad in (0, -3, 2.5, "4"):
        with pytest.raises(gj.errors.ConfigError, match="decode_steps_per_call"):
            gj.EngineConfig(decode_steps_per_call=bad)


def test_bench_harness_k_steps_decode_the_same_tokens():
    """The decode harness the bandwidth row times: a k-step call decodes the tokens k single
    steps decode (greedy on device vs on the host), and `rewind` returns to the same state."""
    from gemini_jax.bench.decode import DecodeHarness

    model = random_model(tiny_config("llama"), 808)
    runs = {}
    for k in (1, 4):
        h = DecodeHarness(model, kind="paged", context=64, new_tokens=8, block_size=16, batch=2, steps_per_call=k,
                          seed=9)
        toks = []
        for _ in range(2):  # twice from the same state: rewind works
            h.rewind()
            got = []
            for _ in range(8 // k):
                h.step()
                got.append(h.next_tok.copy())
            toks.append(np.stack(got[-1:]))
        assert np.array_equal(toks[0], toks[1]), f"k={k}: rewind did not restore the state"
        runs[k] = toks[0]
        h.close()
    assert np.array_equal(runs[1], runs[4]), "seed=808: k-step harness decodes other tokens"
