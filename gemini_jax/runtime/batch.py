"""Boundary types of a runner call: `StepBatch` (its host inputs: a prefill chunk or a decode
step) and the small pytrees / static specs the layer-by-layer jitted pieces take."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, NamedTuple, Optional

import jax

from gemini_jax.attention.dispatch import AttentionImpl

import numpy as np


@dataclass(frozen=True, kw_only=True)
class StepBatch:
    """Which sequences a call runs, their tokens and positions, the span each row writes and
    which query's logits come back. NOTE: rows write positions [starts, ends); a row's tokens
    past its real length (prefill padding) sit at positions >= ends and are never written."""

    ids: tuple  # sequence ids, one per row
    tokens: np.ndarray  # i32[B, T]
    positions: np.ndarray  # i32[B, T]
    starts: np.ndarray  # i32[B]: first position written
    ends: np.ndarray  # i32[B]: tokens in the sequence once the call's tokens are written
    select: np.ndarray  # i32[B]: which query's logits come back
    decode: bool  # one new token per row, sampled from the previous call
    # Syntax-aligned pages (runtime.aligned), else None: `positions` are then cache slots, and
    rope: Optional[np.ndarray] = None  # i32[B, T]: the tokens' positions (rope)
    fill: Optional[np.ndarray] = None  # i32[B, pages_per_seq]: each logical page's fill (PageView.fill)

    @classmethod
    def prefill(cls, sid: int, padded: np.ndarray, positions: np.ndarray, n: int) -> "StepBatch":
        """One sequence's prefill chunk: `n` real tokens of `padded`, at `positions`."""
        first = int(positions[0])
        return cls(ids=(sid,), tokens=padded[None], positions=positions[None], starts=np.array([first], np.int32),
                   ends=np.array([first + n], np.int32), select=np.array([n - 1], np.int32), decode=False)

    @classmethod
    def decode_step(cls, ids, tokens: np.ndarray, lengths: np.ndarray) -> "StepBatch":
        """One new token per sequence (`tokens` i32[B]) written at position `lengths` i32[B]."""
        lengths = np.asarray(lengths, np.int32)
        return cls(ids=tuple(ids), tokens=np.asarray(tokens, np.int32)[:, None], positions=lengths[:, None],
                   starts=lengths, ends=lengths + 1, select=np.zeros(len(lengths), np.int32), decode=True)

    @property
    def batch(self) -> int:
        return self.tokens.shape[0]

    @property
    def width(self) -> int:
        """Tokens per row."""
        return self.tokens.shape[1]


@dataclasses.dataclass(frozen=True)
class LayerProgram:
    """The static half of every jitted piece (hashable): the model's graph, how its attention
    runs, the digests kept (`digest_kind` None: none, dense) and the page size."""

    graphdef: Any
    attention: AttentionImpl
    digest_kind: Optional[str]
    block_size: int
    # The model's graph hashes by walking it, and jit hashes its static arguments on every call
    # (several per layer): hash once here.
    _hash: int = dataclasses.field(init=False, repr=False, compare=False)

    def __post_init__(self):
        object.__setattr__(self, "_hash", hash((self.graphdef, self.attention, self.digest_kind, self.block_size)))

    def __hash__(self) -> int:
        return self._hash


class CallArrays(NamedTuple):
    """One call's device inputs shared by every layer."""

    positions: jax.Array  # i32[B, T]
    page_table: jax.Array  # i32[B, W]: logical page -> page id (0 = null)
    lengths: jax.Array  # i32[B]: tokens per row once this call's tokens are written
    inv_freq: Optional[jax.Array] = None  # the rope's, to move keys under compact positions
    unrope: Optional[jax.Array] = None  # the rope's, when digests hold keys before rope (score_distance)


class LayerArrays(NamedTuple):
    """Which layer: its index and sliding window (device scalars, made once per store)."""

    index: jax.Array  # i32[]
    window: jax.Array  # i32[]
