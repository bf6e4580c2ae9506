"""Dense engine vs the full-sequence reference forward; counters; bad requests."""

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.errors import ConfigError, ContextLengthError, SamplingError, TokenError
from gemini_jax.testing import FAMILIES, logits_tolerance, random_model, random_prompts, tiny_config


CACHES = {"contiguous": dict(kind="contiguous"), "paged8": dict(block_size=8),
          "paged16": dict(block_size=16), "paged64": dict(block_size=64)}


@pytest.mark.parametrize("cache", list(CACHES))
@pytest.mark.parametrize("family", FAMILIES)
def test_engine_matches_forward(family, cache):
    """Invariant 2: engine (contiguous or paged, sparsity off) == full-sequence forward."""
    seed = 1000 + FAMILIES.index(family)  # per family, fixed: a failure replays
    rng = np.random.default_rng(seed)
    cfg = tiny_config(family)
    model = random_model(cfg, seed % 1000)
    eng = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=96, prefill_chunk=16, max_batch=4, cache=CACHES[cache])))
    prompts = random_prompts(rng, cfg.vocab_size, (5, 23, 40))  # longer than the windows
    out = eng.generate(prompts, gj.SamplingParams(max_new_tokens=12, stop_at_eos=False),
                       return_logits=True)
    for p, toks, lg in zip(prompts, out.tokens, out.logits):
        assert len(toks) == 12
        ref = np.asarray(gj.forward(model, p + toks))[len(p) - 1: len(p) - 1 + len(toks)]
        # The contract (README, exactness table): within 1e-5 * max(1, max|ref|). The float bound of
        # this computation (its layers, its longest reduction) must sit below it, and the logits below that.
        contract = 1e-5 * max(1.0, np.abs(ref).max())
        tol = logits_tolerance(cfg, context=len(p) + 12, reference=ref)
        assert tol <= contract, f"seed={seed}: the float bound {tol:.3g} exceeds the contract {contract:.3g}"
        np.testing.assert_allclose(lg, ref, rtol=0, atol=tol, err_msg=f"seed={seed}")
        # Teacher-forced greedy check: each token is the reference argmax up to near-ties, which the
        # engine's logits (each within tol of the reference) may order either way: a gap of 2 tol.
        top = ref.max(-1)
        chosen = np.take_along_axis(ref, np.asarray(toks)[:, None], -1)[:, 0]
        assert np.all(top - chosen <= 2 * tol), f"seed={seed}: chosen token {(top - chosen).max():.3g} below the top"
    assert out.stats["prefill_tokens_computed"] == sum(map(len, prompts))
    assert out.stats["decode_steps"] == 11
    assert out.stats["compute_units"] == (sum(map(len, prompts)) + 3 * 11) * cfg.num_layers
    assert set(out.stats) == set(gj.COUNTERS)


def test_single_prompt_and_batch_agree():
    rng = np.random.default_rng(1)
    cfg = tiny_config("tiny")
    model = random_model(cfg, 3)
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=64, prefill_chunk=8, max_batch=2))
    prompts = random_prompts(rng, cfg.vocab_size, (9, 3, 17))  # 3 prompts, max_batch 2
    params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
    batched = eng.generate(prompts, params).tokens
    singles = [eng.generate(p, params).tokens for p in prompts]
    assert batched == singles


def test_sampling_seeded_and_reproducible():
    cfg = tiny_config("tiny")
    eng = gj.Engine(random_model(cfg, 5), gj.EngineConfig(max_seq_len=64))
    prompt = random_prompts(np.random.default_rng(2), cfg.vocab_size, (7,))[0]
    p = gj.SamplingParams(max_new_tokens=20, temperature=1.3, top_k=30, top_p=0.95, seed=11,
                          stop_at_eos=False)
    a, b = eng.generate(prompt, p).tokens, eng.generate(prompt, p).tokens
    c = eng.generate(prompt, gj.config.replace(p, seed=12)).tokens
    assert a == b
    assert a != c


def test_eos_stops_generation():
    cfg = tiny_config("tiny", eos_id=5)
    model = random_model(cfg, 9)
    eng = gj.Engine(model, gj.EngineConfig(max_seq_len=64))
    prompt = [1, 2, 3]
    free = eng.generate(prompt, gj.SamplingParams(max_new_tokens=40, stop_at_eos=False, temperature=2.0,
                                                   seed=1)).tokens
    # Make EOS the greedy choice after the prompt by finding the argmax and relabelling EOS to it.
    first = free[0]
    eng2 = gj.Engine(model, gj.EngineConfig(max_seq_len=64))
    eng2.model_cfg = gj.config.replace(cfg, eos_id=first)
    out = eng2.generate(prompt, gj.SamplingParams(max_new_tokens=40, temperature=2.0, seed=1)).tokens
    assert out == [first]


@pytest.mark.parametrize("prompt", [[], [1, 2, 97], [-1], [[1, 2], [3, 200]], [0.5, 1.0]])
def test_bad_tokens(prompt):
    eng = gj.Engine(random_model(tiny_config("tiny"), 1), gj.EngineConfig(max_seq_len=64))
    with pytest.raises(TokenError):
        eng.generate(prompt, gj.SamplingParams(max_new_tokens=2))


def test_context_too_long():
    eng = gj.Engine(random_model(tiny_config("tiny"), 1), gj.EngineConfig(max_seq_len=32))
    with pytest.raises(ContextLengthError, match="max_seq_len=32"):
        eng.generate(list(range(30)), gj.SamplingParams(max_new_tokens=3))


@pytest.mark.parametrize("kw", [dict(temperature=-1.0), dict(top_p=0.0), dict(top_p=1.5),
                                dict(top_k=-2), dict(max_new_tokens=-1), dict(max_new_tokens=2.5)])
def test_bad_sampling_params(kw):
    with pytest.raises(SamplingError):
        gj.SamplingParams(**kw)


PER_LAYER_CASES = [(f, dict(decode_steps_per_call=4)) for f in FAMILIES] + [
    ("llama", dict(decode_steps_per_call=1)), ("llama", dict(tier=dict(enabled=True, device_fraction=0.5)))]


@pytest.mark.parametrize("family,extra", PER_LAYER_CASES, ids=lambda x: x if isinstance(x, str) else "-".join(x))
def test_per_layer_weights_give_the_stacked_numbers(family, extra):
    """EngineConfig.layer_weights: the unrolled program over per-layer buffers computes what the
    scan over stacked arrays does (the same ops; XLA may fuse them differently, so to the float
    bound of the computation), through prefill, k-step and one-token decode and the tiered
    runner's per-layer programs (a traced layer index); the engine's weight hash and the Decoder
    passed in are unchanged."""
    seed = 2000 + FAMILIES.index(family)
    rng = np.random.default_rng(seed)
    cfg = tiny_config(family)
    model = random_model(cfg, seed % 1000)
    stacked_wq = np.asarray(model.layers.wq[...]).copy()
    prompts = random_prompts(rng, cfg.vocab_size, (7, 30))
    params = gj.SamplingParams(max_new_tokens=9, stop_at_eos=False)
    outs, hashes = {}, {}
    for lw in ("stacked", "per_layer"):
        eng = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
            max_seq_len=64, prefill_chunk=16, max_batch=2, layer_weights=lw, **extra)))
        outs[lw], hashes[lw] = eng.generate(prompts, params, return_logits=True), eng.weights_sha256
    a, b = outs["stacked"], outs["per_layer"]
    assert a.tokens == b.tokens, f"seed={seed}"
    for p, x, y in zip(prompts, a.logits, b.logits):
        tol = logits_tolerance(cfg, context=len(p) + 9, reference=x)
        np.testing.assert_allclose(y, x, rtol=0, atol=tol, err_msg=f"seed={seed}")
    assert hashes["stacked"] == hashes["per_layer"], f"seed={seed}"
    assert not model.layers.per_layer
    np.testing.assert_array_equal(np.asarray(model.layers.wq[...]), stacked_wq)


def test_layer_weights_is_checked():
    with pytest.raises(ConfigError, match="layer_weights"):
        gj.EngineConfig(layer_weights="rows")
