"""`WriteLog`: which calls wrote each page, so a page that fails verification below the device
can be rebuilt by running those calls again (`tier.on_corrupt="recompute"`).

A page's KV is a function of its tokens, the pages before it and the *call* that wrote it: a
prefill chunk's sparse selection depends on the chunk's other queries, and a chunk's padded
width sets the shapes XLA computes with. Replaying the same calls (same start, same real and
padded length, prefill or decode) over the same earlier pages gives the same bytes; a page
rebuilt any other way would only approximate them. So the log keeps, per page id, the spans of
the calls that wrote into it, in order; `forget` drops them when the cache hands the id to
another page.

NOTE invariants:
  * a page's spans are those of the calls since the id was last allocated, oldest first;
  * replaying them needs only the tokens of a sequence that holds the page at the same logical
    index (prefix sharing keeps positions: a shared page holds the same tokens everywhere).
"""

from __future__ import annotations

from typing import NamedTuple


class WriteSpan(NamedTuple):
    """One call's write into a sequence: positions [start, start + n) of a call `width` tokens
    wide (prefill padding included); `decode`: a decode step (one token)."""

    start: int
    n: int
    width: int
    decode: bool


class WriteLog:
    """Per page id: its logical index and the spans of the calls that wrote it."""

    def __init__(self, block_size: int):
        self.S = block_size
        self._spans: dict[int, list[WriteSpan]] = {}
        self._logical: dict[int, int] = {}

    def record(self, pages: list[int], span: WriteSpan) -> None:
        """A call wrote `span` of a sequence whose page table is `pages` (physical ids)."""
        S = self.S
        for logical in range(span.start // S, (span.start + span.n - 1) // S + 1):
            page = int(pages[logical])
            if page == 0:  # the null page (outside a window) holds nothing to rebuild
                continue
            self._logical[page] = logical
            self._spans.setdefault(page, []).append(span)

    def spans(self, page: int) -> tuple[int, list[WriteSpan]] | None:
        """(logical index, spans oldest first) of `page`, or None when no call of this engine
        wrote it (it came from a snapshot, or was copied on a rewind)."""
        page = int(page)
        if page not in self._spans:
            return None
        return self._logical[page], list(self._spans[page])

    def forget(self, pages) -> None:
        """Page ids (re)allocated: their history no longer describes them."""
        for p in pages:
            self._spans.pop(int(p), None)
            self._logical.pop(int(p), None)
