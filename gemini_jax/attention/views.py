"""Boundary types of attention over pages (small pytrees that jitted code takes and returns)."""

from __future__ import annotations

from typing import Any, NamedTuple, Optional


class Span(NamedTuple):
    """Where a call's new K/V go: `positions` i32[B, T], `lengths` i32[B] (positions at or past
    a row's length are padding, never written), `tables` i32[B, W] (logical page -> index in the
    KV arrays: a page id, or a device slot under tiers) and `page_ids` i32[B, W] (logical page ->
    page id, which digests are kept by; None: the same as `tables`)."""

    positions: Any
    lengths: Any
    tables: Any
    page_ids: Optional[Any] = None


class PageView(NamedTuple):
    """Where a call reads: `tables` i32[B, W] (logical page -> index in the KV arrays) and
    `lengths` i32[B] (valid tokens per row; None: no bound, e.g. a lookahead guess)."""

    tables: Any
    lengths: Optional[Any] = None


class Selection(NamedTuple):
    """The pages queries read: logical ids i32[B, K, n] (-1 padded) and, under compact positions,
    each page's position change i32[B, K, n] with the rope's `inv_freq` to move its keys by
    (None: keys keep their true positions)."""

    pages: Any
    shift: Optional[Any] = None
    inv_freq: Optional[Any] = None
