"""Soft tokens: encoder outputs the decoder reads as input embeddings, named by token ids past the
vocabulary so that everything keyed by token ids (the page manager's prefix hashes, a session's
history, a snapshot, a replay of the calls that wrote a page) carries them unchanged.

The engine owns one `SoftTable`. Registering an input's vectors gives it a run of slots, and token id
`vocab_size + slot` stands for row `slot`. Slots are content-addressed and never reused in the
engine's life: the same input through the same encoder and projector (the same key: the input's
content hash and both fingerprints) gets the same ids, so its pages are shared like a text prefix's;
another input never gets ids the first one had, so a cached page can never hold the wrong vectors.

A model call whose tokens hold soft ids gets embeddings f32[B, T, E] instead of ids
(`model_input`): text rows from the model's embedding table, soft rows from this table. The decoder
takes either (gemini_jax.model.Decoder). Generated tokens are always text (logits cover the
vocabulary only), so decode steps never see a soft id.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.cache.shapes import pow2_at_least
from gemini_jax.errors import ContextLengthError, TokenError


@dataclass(frozen=True)
class SoftEntry:
    """One registered input: its slots [first, first + n) and where its vectors came from."""

    key: str      # content key: sha256 over the input's content hash and the fingerprints below
    first: int
    n: int
    source: dict  # {"modality", "encoder", "encoder_fingerprint", "projector_fingerprint", "content_sha256"}


class SoftTable:
    """The engine's soft-token rows (host copy, device copy padded to a power of two)."""

    def __init__(self, vocab_size: int, width: int, dtype, max_rows: int):
        self.base, self.width, self.dtype, self.max_rows = int(vocab_size), int(width), jnp.dtype(dtype), int(max_rows)
        self._rows = np.zeros((0, self.width), np.float32)
        self._by_key: dict[str, SoftEntry] = {}
        self._by_slot: list[SoftEntry] = []  # slot -> its entry
        self._device = None

    def __len__(self) -> int:
        return len(self._rows)

    def lookup(self, key: str) -> SoftEntry | None:
        return self._by_key.get(key)

    def add(self, key: str, vectors, source: dict) -> np.ndarray:
        """Token ids i32[n] for `vectors` f32[n, width] under content `key` (registered once: a
        known key returns its ids and keeps its rows)."""
        entry = self._by_key.get(key)
        if entry is None:
            vec = np.asarray(vectors, np.float32)
            if vec.ndim != 2 or vec.shape[1] != self.width or len(vec) == 0:
                raise TokenError(f"soft tokens must be shaped [n >= 1, {self.width}] (the model's hidden size); "
                                 f"got {list(vec.shape)} from {source.get('encoder', 'an encoder')!r}.")
            if not np.isfinite(vec).all():
                raise TokenError(f"soft tokens from {source.get('encoder', 'an encoder')!r} hold NaN or inf.")
            if len(self._rows) + len(vec) > self.max_rows:
                raise ContextLengthError(
                    f"the engine's soft-token table holds {len(self._rows)} of EngineConfig.max_soft_tokens="
                    f"{self.max_rows} rows; {len(vec)} more do not fit (rows are kept for the engine's life so "
                    f"cached pages stay valid). Raise max_soft_tokens or use a new engine.")
            entry = SoftEntry(key, len(self._rows), len(vec), dict(source))
            self._rows = np.concatenate([self._rows, vec])
            self._by_key[key] = entry
            self._by_slot += [entry] * len(vec)
            self._device = None
        return np.arange(self.base + entry.first, self.base + entry.first + entry.n, dtype=np.int32)

    def holds(self, tokens) -> bool:
        """Whether `tokens` (any int array) name soft rows."""
        return bool(len(self._rows)) and bool((np.asarray(tokens) >= self.base).any())

    def entries_in(self, tokens) -> list[SoftEntry]:
        """The registered inputs `tokens` use, in order of first use."""
        slots = [int(t) - self.base for t in np.asarray(tokens).ravel() if t >= self.base]
        bad = [s for s in slots if s >= len(self._rows)]
        if bad:
            raise TokenError(f"token id {self.base + bad[0]} names soft row {bad[0]}, but the table holds "
                             f"{len(self._rows)}.")
        return list({id(self._by_slot[s]): self._by_slot[s] for s in slots}.values())

    def vectors(self, entry: SoftEntry) -> np.ndarray:
        return self._rows[entry.first:entry.first + entry.n]

    def device_rows(self) -> jax.Array:
        """The rows on device, padded to a power of two (few shapes, few compiles)."""
        if self._device is None:
            cap = pow2_at_least(max(len(self._rows), 1))
            rows = np.zeros((cap, self.width), np.float32)
            rows[:len(self._rows)] = self._rows
            self._device = jnp.asarray(rows, self.dtype)
        return self._device


def model_input(ctx, tokens: np.ndarray):
    """What a model call takes for host tokens i32[B, T]: the ids themselves, or, when they name soft
    rows, the embeddings f32[B, T, E] (text rows from the model, soft rows from `ctx.soft`)."""
    table = ctx.soft
    if table is None or not table.holds(tokens):
        return None
    return _mixed_embed(ctx.graphdef, ctx.params, jnp.asarray(tokens, jnp.int32), table.device_rows(), table.base)


@functools.partial(jax.jit, static_argnums=(0, 4))
def _mixed_embed(graphdef, params, ids, rows, base):
    model = nnx.merge(graphdef, params)
    text = model.embed_tokens(jnp.clip(ids, 0, base - 1))
    soft = rows[jnp.clip(ids - base, 0, rows.shape[0] - 1)].astype(text.dtype)
    return jnp.where((ids >= base)[..., None], soft, text)
