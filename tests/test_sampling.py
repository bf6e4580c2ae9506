"""Sampling: greedy is argmax, top-k / top-p restrict the support, keys are per (seed, seq, pos)."""

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.sampling import sample, token_keys


def _logits(rng, B=4, V=50):
    return jnp.asarray(rng.normal(size=(B, V)).astype(np.float32) * 3)


def test_greedy_is_argmax():
    rng = np.random.default_rng(1)
    lg = _logits(rng)
    keys = token_keys(0, jnp.arange(4, dtype=jnp.uint32), jnp.zeros(4, jnp.uint32))
    assert np.array_equal(sample(lg, keys, temperature=0.0), np.argmax(lg, -1))


def test_top_k_support():
    rng = np.random.default_rng(2)
    lg = _logits(rng, B=1)
    allowed = set(np.argsort(-np.asarray(lg[0]))[:3].tolist())
    seen = set()
    for pos in range(300):
        keys = token_keys(7, jnp.zeros(1, jnp.uint32), jnp.full(1, pos, jnp.uint32))
        seen.add(int(sample(lg, keys, temperature=5.0, top_k=3)[0]))
    assert seen == allowed  # at T=5 every allowed token shows up in 300 draws


def test_top_p_support():
    lg = jnp.log(jnp.asarray([[0.5, 0.3, 0.15, 0.05]], jnp.float32))
    seen = set()
    for pos in range(400):
        keys = token_keys(3, jnp.zeros(1, jnp.uint32), jnp.full(1, pos, jnp.uint32))
        seen.add(int(sample(lg, keys, temperature=1.0, top_p=0.7)[0]))
    assert seen == {0, 1}  # 0.5 < 0.7 needs token 1 too; 0.8 >= 0.7 stops there


def test_keys_depend_on_seed_sequence_and_position():
    k = lambda s, q, p: jax.random.key_data(token_keys(s, jnp.asarray([q], jnp.uint32), jnp.asarray([p], jnp.uint32)))
    assert np.array_equal(k(1, 2, 3), k(1, 2, 3))
    assert not np.array_equal(k(1, 2, 3), k(2, 2, 3))
    assert not np.array_equal(k(1, 2, 3), k(1, 3, 3))
    assert not np.array_equal(k(1, 2, 3), k(1, 2, 4))
