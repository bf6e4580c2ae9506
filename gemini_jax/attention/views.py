"""Boundary types of attention over pages (small pytrees that jitted code takes and returns)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional

import jax.numpy as jnp


class Span(NamedTuple):
    """Where a call's new K/V go: `positions` i32[B, T], `lengths` i32[B] (positions at or past
    a row's length are padding, never written), `tables` i32[B, W] (logical page -> index in the
    KV arrays: a page id, or a device slot under tiers) and `page_ids` i32[B, W] (logical page ->
    page id, which digests are kept by; None: the same as `tables`)."""

    positions: Any
    lengths: Any
    tables: Any
    page_ids: Optional[Any] = None
    fill: Optional[Any] = None  # i32[B, W]: slots of each logical page that hold tokens (None: all; see PageView)


class PageView(NamedTuple):
    """Where a call reads: `tables` i32[B, W] (logical page -> index in the KV arrays),
    `lengths` i32[B] (valid slots per row; None: no bound, e.g. a lookahead guess) and `fill`
    i32[B, W] (syntax-aligned pages, `cache.align`: slot s of logical page w holds a token iff
    s < fill[b, w], the rest is padding; None: every slot below the length holds one)."""

    tables: Any
    lengths: Optional[Any] = None
    fill: Optional[Any] = None


def slot_valid(fill, logical, S: int):
    """bool[..., S]: which slots of logical pages `logical` [...] hold tokens (`PageView.fill`);
    None when there is no padding to mask."""
    if fill is None:
        return None
    f = jnp.take_along_axis(fill, jnp.clip(logical, 0, fill.shape[1] - 1).reshape(fill.shape[0], -1), axis=1)
    return jnp.arange(S) < f.reshape(logical.shape)[..., None]


class Selection(NamedTuple):
    """The pages queries read: logical ids i32[B, K, n] (-1 padded) and, under compact positions,
    each page's position change i32[B, K, n] with the rope's `inv_freq` to move its keys by
    (None: keys keep their true positions)."""

    pages: Any
    shift: Optional[Any] = None
    inv_freq: Optional[Any] = None
