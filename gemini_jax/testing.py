"""Builders for tests and notebooks: tiny random models with each family's quirks, seeded inputs,
and the float tolerance a comparison of two evaluations of one computation may allow.

    from gemini_jax.testing import FAMILIES, logits_tolerance, random_model, random_prompts, tiny_config
    model = random_model(tiny_config("gemma2"), seed=3)   # every weight random, none inert
    tol = logits_tolerance(model.cfg, context=96, reference=ref)   # engine vs forward, seeded inputs
"""

from __future__ import annotations

import math

import jax
import numpy as np
from flax import nnx

from gemini_jax.config import ModelConfig, RopeConfig
from gemini_jax.model import Decoder


def tiny_config(family: str = "llama", **over) -> ModelConfig:
    """A very small config with the family's quirks switched on."""
    base = dict(family=family, vocab_size=97, hidden_size=64, intermediate_size=96, num_layers=3,
                num_heads=4, num_kv_heads=2, head_dim=16, max_position=4096, norm_eps=1e-6)
    quirks = {
        "llama": dict(rope=RopeConfig(theta=500000.0, kind="llama3", factor=8.0,
                                          original_max_position=64)),
        "mistral": dict(layer_windows=(7, 7, 7)),
        "qwen2": dict(qkv_bias=True),
        "qwen3": dict(qk_norm=True),
        "gemma2": dict(norm_kind="rms_plus_one", activation="gelu_tanh", sandwich_norms=True,
                       embed_scale=True, attn_scale=0.2, attn_softcap=50.0, final_softcap=30.0,
                       tie_embeddings=True, layer_windows=(6, 0, 6)),
        "gemma3": dict(norm_kind="rms_plus_one", activation="gelu_tanh", sandwich_norms=True,
                       embed_scale=True, qk_norm=True, attn_scale=0.25, tie_embeddings=True,
                       rope=RopeConfig(theta=1e6, kind="linear", factor=8.0),
                       local_rope=RopeConfig(theta=1e4), layer_windows=(5, 5, 0)),
        "tiny": dict(),
    }[family]
    return ModelConfig(**{**base, **quirks, **over})


def random_model(cfg: ModelConfig, seed: int) -> Decoder:
    """A model whose every weight (norms and biases included) is random, so no tensor is inert."""
    model = Decoder(cfg, rngs=nnx.Rngs(seed))
    graphdef, state = nnx.split(model)
    leaves, treedef = jax.tree.flatten(state)
    keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
    noisy = [x + 0.1 * jax.random.normal(k, x.shape, x.dtype) for x, k in zip(leaves, keys)]
    return nnx.merge(graphdef, jax.tree.unflatten(treedef, noisy))


FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3")


def random_prompts(rng: np.random.Generator, vocab: int, lengths) -> list[list[int]]:
    """Token ids drawn from `rng` (seed it: the seed belongs in the failure message)."""
    return [[int(x) for x in rng.integers(0, vocab, n)] for n in lengths]


def float_tolerance(*, depth: int, magnitude: float, terms: int = 1, dtype="float32", slack: float = 2.0) -> float:
    """The largest |a - b| to allow between two evaluations of one computation that round differently
    (another summation order, chunking, page layout, kernel), derived from the computation:

        slack · eps(dtype) · depth · sqrt(terms) · magnitude

    Why it holds: each float operation rounds with relative error at most eps (2^-23 ≈ 1.2e-7 for
    float32, 2^-7 for bfloat16). A sum of n terms evaluated in another order differs by at most about
    n·eps·Σ|x| (every rounding the same way), and typically by about sqrt(n)·eps·Σ|x|, because
    independent roundings add like a random walk: `terms` is the longest reduction in the computation
    (the context length, or the widest matmul). Steps in sequence add their relative errors (a decoder
    layer passes its error on through the residual stream to the next), hence `depth` (layers, or
    chained reductions). `magnitude` turns relative into absolute: the largest |value| compared (max
    |reference|). `slack` covers the random walk's tail (2: a two-sigma excursion); counting every
    layer's longest reduction as reordered already overstates most comparisons: the tests' errors,
    measured over several seeds each, sit 3 to 70 times below this bound.

    A bug (a wrong mask, a missing scale, a stale page) moves values by a fraction of `magnitude`, far
    above this bound, so a comparison at this tolerance still fails on it.

    Args:
      depth: rounding steps in sequence (>= 1).
      magnitude: the scale of the compared values, usually max |reference| (> 0).
      terms: the longest reduction (>= 1).
      dtype: the dtype the computation rounds in (its eps is used).
      slack: a stated safety factor.
    Raises:
      ValueError: depth or terms below 1, or a magnitude that is not a positive finite number.
    """
    if depth < 1 or terms < 1:
        raise ValueError(f"{depth=} and {terms=} must be >= 1.")
    if not (math.isfinite(magnitude) and magnitude > 0):
        raise ValueError(f"{magnitude=} must be a positive finite number (max |reference|).")
    eps = float(jax.numpy.finfo(dtype).eps)
    return slack * eps * depth * math.sqrt(terms) * float(magnitude)


def logits_tolerance(cfg: ModelConfig, *, context: int, reference) -> float:
    """`float_tolerance` for a decoder's logits computed two ways (engine vs forward, paged vs
    contiguous, one program vs another): `cfg.num_layers` steps in sequence, each with its longest
    reduction the widest matmul or the attention over up to `context` tokens, at the magnitude of
    `reference` (an array, or a list of arrays: max |value| over all)."""
    parts = reference if isinstance(reference, (list, tuple)) else [reference]
    magnitude = max(float(np.abs(np.asarray(x)).max()) for x in parts if np.size(x))
    return float_tolerance(depth=cfg.num_layers, terms=max(cfg.hidden_size, cfg.intermediate_size, context),
                           magnitude=magnitude)


EXACT_CONTRACT = 1e-5


def contract_tolerance(bound: float, reference, contract: float = EXACT_CONTRACT) -> float:
    """The exactness contract (architecture.md §6: 1e-5 × max(1, max |reference|)) or the float
    bound `bound` (`logits_tolerance`, `float_tolerance`) where that is tighter.

    The contract is relative because the float error is: two compilations of one computation (another
    vectorisation, another fusion) round differently by a few eps of the values compared, and logits
    of magnitude 15 sit 6 ulps apart at 1e-5 absolute."""
    parts = reference if isinstance(reference, (list, tuple)) else [reference]
    magnitude = max(float(np.abs(np.asarray(x)).max()) for x in parts if np.size(x))
    return min(contract * max(1.0, magnitude), bound)
