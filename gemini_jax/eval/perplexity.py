"""Bits per byte on held-out text at a given context length, through any engine configuration.

Each window of `context` bytes is split into a prompt and a scored tail; the tail's log-probs
come from `engine.score`, i.e. from the decode path the engine really uses (paged, sparse,
tiered), not from a separate full-sequence forward.
"""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

from gemini_jax.data import corpus, tasks
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.tokenizer import ByteTokenizer


def perplexity(engine, context: int, *, windows: int = 4, scored: int = 128, text: np.ndarray | None = None,
               seed: int = 0) -> dict:
    """Mean bits per byte over the last `scored` bytes of `windows` random windows of `context`."""
    if text is None:
        text = heldout_text()
    if scored >= context:
        raise ValueError(f"scored={scored} must be < context={context}.")
    nll = []
    for w in tqdm(range(windows), desc=f"bpb@{context}", disable=None):  # a bar on a terminal only
        rng = np.random.default_rng([seed, context, w])
        window = tasks.text_window(text, context - 1, rng).astype(np.int32)
        toks = np.concatenate([[ByteTokenizer.BOS], window])
        out = engine.score(list(map(int, toks[:-scored])), list(map(int, toks[-scored:])))
        nll.append(-np.asarray(out.tokens))
    nll = np.concatenate(nll)
    return {"context": context, "windows": windows, "scored_per_window": scored,
            "bits_per_byte": float(nll.mean() / np.log(2))}


def unigram_bits_per_byte(train: np.ndarray | None = None, heldout: np.ndarray | None = None) -> float:
    """Cross-entropy of held-out bytes under train byte frequencies (add-one smoothed)."""
    if train is None:
        _, train = corpus.load_split("train")
    if heldout is None:
        _, heldout = corpus.load_split("heldout")
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1
    p = counts / counts.sum()
    return float(-np.mean(np.log2(p[heldout])))
