"""Errors of the tiered KV store. All derive from `gemini_jax.errors` so callers can catch the
family (`GeminiJaxError`) or the kind (`IntegrityError` covers every page that must not be served).
"""

from __future__ import annotations

from gemini_jax.errors import GeminiJaxError, IntegrityError


class TierError(GeminiJaxError, RuntimeError):
    """A storage tier cannot do its job: the disk path is unwritable, the disk is full, the store
    belongs to another layout, or another process holds it. The message names the path and the
    OS reason; tiers above the failed one keep serving what they hold."""


class PageMissing(TierError, KeyError):
    """A page was asked of a tier that never stored it (a caller bug, or a page dropped after a
    corrupt read with `on_corrupt="recompute"`)."""

    def __str__(self) -> str:  # KeyError would quote the message
        return str(self.args[0]) if self.args else ""


class IncompletePage(IntegrityError):
    """A disk page whose write began but never committed (the process was killed mid-write).
    It is never served; recompute it or restore it from a snapshot."""


class PageCorrupt(IntegrityError):
    """A page below the device failed verification (bad checksum, torn write) while
    `tier.on_corrupt="recompute"`: the runner rebuilds it from its tokens and runs the call
    again. `key` = (layer, page id). Reaches the caller only when the page cannot be rebuilt."""

    def __init__(self, message: str, key):
        super().__init__(message)
        self.key = (int(key[0]), int(key[1]))


__all__ = ["IncompletePage", "IntegrityError", "PageCorrupt", "PageMissing", "TierError"]
