"""Bits per byte on held-out text at a given context length, through any engine configuration.

Each window of `context` tokens is split into a prompt and a scored tail; the tail's log-probs
come from `engine.score`, i.e. from the decode path the engine really uses (paged, sparse,
tiered), not from a separate full-sequence forward. For the byte-level model a token is a byte
(and the window starts with BOS); for a model with another tokenizer (`tokenizer=`, e.g. a GGUF
BPE) the window is the first `context` tokens of a random stretch of text, and a window's bits
per byte are its tail's nats / ln 2 over the UTF-8 bytes the tail's tokens decode to, so models
with different vocabularies compare on the same unit.
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
               draw: Draw = Draw(), tokenizer=None) -> dict:  # noqa: PLR0913
    """Mean bits per byte over the last `scored` tokens of `windows` random windows of `context`
    tokens, with a 95% interval over windows (a t interval on the per-window means: tokens within
    one window are not independent). Window w is drawn from `draw.rng(context, w)`; the engine
    scores up to its `max_batch` windows per decode step. `tokenizer` None (or the byte tokenizer):
    tokens are bytes."""
    if text is None:
        text = heldout_text()
    if scored >= context:
        raise ValueError(f"scored={scored} must be < context={context}.")
    bytewise = tokenizer is None or isinstance(tokenizer, ByteTokenizer)
    pairs = [window_pair(text, context, scored, draw, w) if bytewise else
             token_window_pair(tokenizer, text, context, scored, draw, w) for w in range(windows)]
    tail_bytes = [len(t) if bytewise else tail_byte_count(tokenizer, p, t) for p, t in pairs]
    step = max(1, int(getattr(getattr(engine, "config", None), "max_batch", 1)))
    per_window = []
    for g in tqdm(range(0, windows, step), desc=f"bpb@{context}", disable=None):  # a bar on a terminal only
        per_window += window_bits(engine, pairs[g:g + step], tail_bytes[g:g + step])
    mean, lo, hi = mean_t95(per_window)
    return {"context": context, "windows": windows, "scored_per_window": scored, "split": draw.split,
            "seed": draw.seed, "bits_per_byte": mean, "ci95": [lo, hi], "per_window": per_window,
            "unit": "byte" if bytewise else "token", "scored_bytes_mean": float(np.mean(tail_bytes))}


def window_pair(text: np.ndarray, context: int, scored: int, draw: Draw, w: int) -> tuple[list, list]:
    """Window w of a context: (prompt tokens, scored tail tokens), BOS first, drawn from
    `draw.rng(context, w)`, the same for every engine and run."""
    window = tasks.text_window(text, context - 1, draw.rng(context, w)).astype(np.int32)
    toks = np.concatenate([[ByteTokenizer.BOS], window])
    return list(map(int, toks[:-scored])), list(map(int, toks[-scored:]))


# A token of a BPE vocabulary spans at most this many bytes of source text on average (Python
# sources run at about 3-4 bytes a token); a window draws this many bytes per token it needs.
_BYTES_DRAWN_PER_TOKEN = 8


def token_window_pair(tokenizer, text: np.ndarray, context: int, scored: int, draw: Draw, w: int):
    """Window w for a non-byte tokenizer: the first `context` tokens of a random stretch of text
    (drawn from `draw.rng(context, w)`, the same for every engine and run) -> (prompt, tail)."""
    raw = tasks.text_window(text, _BYTES_DRAWN_PER_TOKEN * context, draw.rng(context, w))
    ids = tokenizer.encode(bytes(raw.astype(np.uint8)).decode("utf-8", errors="ignore"), bos=False)
    if len(ids) < context:
        raise ValueError(f"{_BYTES_DRAWN_PER_TOKEN * context} bytes of text gave {len(ids)} tokens, fewer than "
                         f"context={context}: the text is too dense for this tokenizer.")
    ids = [int(i) for i in ids[:context]]
    return ids[:-scored], ids[-scored:]


def tail_byte_count(tokenizer, prompt, tail) -> int:
    """UTF-8 bytes the tail's tokens add to the decoded text (decoded whole, so a character split
    across the prompt / tail boundary is counted once)."""
    return len(tokenizer.decode(prompt + tail).encode("utf-8")) - len(tokenizer.decode(prompt).encode("utf-8"))


def window_bits(engine, pairs, tail_bytes) -> list[float]:
    """Bits per byte of each (prompt, tail)'s tail under `engine.score` (its tail spans
    `tail_bytes` bytes of text), in one call."""
    out = engine.score([p for p, _ in pairs], [t for _, t in pairs])
    return [float(-np.sum(np.asarray(lp)) / np.log(2) / n) for lp, n in zip(out.tokens, tail_bytes)]


def unigram_bits_per_byte(train: np.ndarray | None = None, heldout: np.ndarray | None = None) -> float:
    """Cross-entropy of held-out bytes under train byte frequencies (add-one smoothed)."""
    if train is None:
        _, train = corpus.load_split("train")
    if heldout is None:
        _, heldout = corpus.load_split("heldout")
    counts = np.bincount(train, minlength=256).astype(np.float64) + 1
    p = counts / counts.sum()
    return float(-np.mean(np.log2(p[heldout])))
