"""`PageLog`: the append-only record of which disk pages are complete, and their checksums.

A page write is INTENT(key) -> data -> COMMIT(key, digest). Replaying the log tells, for every
key, whether its last write completed (its digest is known) or was cut short (INTENT without
COMMIT: the page is *incomplete* and must never be served).

NOTE invariants:
  * a COMMIT is appended only after the page's data write has completed, so a committed digest
    always describes bytes that reached the file system;
  * the last record of a key decides its state;
  * each record carries its own CRC, so a record torn by a crash is recognised and dropped on
    replay (the log is then truncated to its last whole record).
One process owns a log at a time (an exclusive `flock`).
"""

from __future__ import annotations

import struct
from typing import Iterable

from gemini_jax.tiers.page import PageKey
from gemini_jax.tiers.record_log import LogFormat, RecordLog

_MAGIC = b"GJKVLOG1"
INTENT, COMMIT = 1, 2
FORMAT = LogFormat(header=_MAGIC + struct.pack("<II", 1, 0),  # magic, version, reserved
                   body=struct.Struct("<B3xIQ16s"),  # kind, pad, layer, page, digest
                   name="the disk tier's page log",
                   remedy="point tier.disk_path at an empty directory or one this framework wrote.",
                   valid=lambda record: record[0] in (INTENT, COMMIT))
RECORD_BYTES = FORMAT.record_bytes  # 36
_NO_DIGEST = b"\0" * 16


class PageLog:
    """Open (or create) the log at `path` and replay it (`record_log.RecordLog`: one owner, torn
    tail dropped)."""

    def __init__(self, path: str, *, fsync: bool = False):
        self.path = path
        self.committed: dict[PageKey, bytes] = {}
        self.incomplete: set[PageKey] = set()
        self._log = RecordLog(path, FORMAT, fsync=fsync)
        self.torn_records = self._log.torn_records
        for kind, layer, page, digest in self._log.records:
            key = (layer, page)
            if kind == INTENT:
                self.committed.pop(key, None)
                self.incomplete.add(key)
            else:  # COMMIT (the replay stops at any other kind)
                self.incomplete.discard(key)
                self.committed[key] = digest
        self._log.records = []  # replayed into the sets above

    def begin(self, keys: Iterable[PageKey]) -> None:
        """Record that writes of `keys` are starting (before any of their data is written)."""
        keys = list(keys)
        self._log.append([(INTENT, k[0], k[1], _NO_DIGEST) for k in keys], sync=False)
        for k in keys:
            self.committed.pop(k, None)
            self.incomplete.add(k)

    def commit(self, items: Iterable[tuple[PageKey, bytes]]) -> None:
        """Record that the data of each (key, digest) is completely written."""
        items = list(items)
        self._log.append([(COMMIT, k[0], k[1], d) for k, d in items])
        for k, d in items:
            self.incomplete.discard(k)
            self.committed[k] = d

    def close(self) -> None:
        self._log.close()
