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
from gemini_jax.eval.intervals import mean_t95
from gemini_jax.eval.trials import Draw
from gemini_jax.tokenizer import ByteTokenizer


def perplexity(engine, context: int, *, windows: int = 4, scored: int = 128, text: np.ndarray | None = None,
               draw: Draw = Draw()) -> dict:
    """Mean bits per byte over the last `scored` bytes of `windows` random windows of `context`,
    with a 95% interval over windows (a t interval on the per-window means: bytes within one
    window are not independent). Window w is drawn from `draw.rng(context, w)`; the engine scores
    up to its `max_batch` windows per decode step."""
    if text is None:
        text = heldout_text()
    if scored >= context:
        raise ValueError(f"scored={scored} must be < context={context}.")
    pairs = [window_pair(text, context, scored, draw, w) for w in range(windows)]
    step = max(1, int(getattr(getattr(engine, "config", None), "max_batch", 1)))
    per_window = []
    for g in tqdm(range(0, windows, step), desc=f"bpb@{context}", disable=None):  # a bar on a terminal only
        per_window += window_bits(engine, pairs[g:g + step])
    mean, lo, hi = mean_t95(per_window)
    return {"context": context, "windows": windows, "scored_per_window": scored, "split": draw.split,
            "seed": draw.seed, "bits_per_byte": mean, "ci95": [lo, hi], "per_window": per_window}


def window_pair(text: np.ndarray, context: int, scored: int, draw: Draw, w: int) -> tuple[list, list]:
    """Window w of a context: (prompt tokens, scored tail tokens), BOS first, drawn from
    `draw.rng(context, w)`, the same for every engine and run."""
    window = tasks.text_window(text, context - 1, draw.rng(context, w)).astype(np.int32)
    toks = np.concatenate([[ByteTokenizer.BOS], window])
    return list(map(int, toks[:-scored])), list(map(int, toks[-scored:]))


def window_bits(engine, pairs) -> list[float]:
    """Mean bits per byte of each (prompt, tail)'s tail under `engine.score`, in one call."""
    out = engine.score([p for p, _ in pairs], [t for _, t in pairs])
    return [float(-np.mean(np.asarray(lp)) / np.log(2)) for lp in out.tokens]


def unigram_bits_per_byte(train: np.ndarray | None = None, heldout: np.ndarray | None = None) -> float:
    """Cross-entropy of held-out bytes under train byte frequencies (add-one smoothed)."""
    if train is None:
        _, train = corpus.load_split("train")
    if heldout is None:
        _, heldout = corpus.load_split("heldout")
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1
    p = counts / counts.sum()
    return float(-np.mean(np.log2(p[heldout])))
