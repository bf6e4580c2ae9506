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

import fcntl
import os
import struct
import zlib
from typing import Iterable

from gemini_jax.tiers.errors import TierError
from gemini_jax.tiers.page import PageKey

_MAGIC = b"GJKVLOG1"
_HEADER = _MAGIC + struct.pack("<II", 1, 0)  # magic, version, reserved
_BODY = struct.Struct("<B3xIQ16s")  # kind, pad, layer, page, digest
_CRC = struct.Struct("<I")
RECORD_BYTES = _BODY.size + _CRC.size  # 36
INTENT, COMMIT = 1, 2


class PageLog:
    """Open (or create) the log at `path` and replay it."""

    def __init__(self, path: str, *, fsync: bool = False):
        self.path = path
        self.fsync = fsync
        self.committed: dict[PageKey, bytes] = {}
        self.incomplete: set[PageKey] = set()
        self.torn_records = 0  # partial / corrupt records dropped at replay
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TierError(f"cannot open the disk tier's page log {path!r}: {e.strerror} "
                            f"(errno {e.errno}); choose a writable tier.disk_path.") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            raise TierError(f"the page log {path!r} is held by another process; one process may own "
                            f"a disk tier at a time (use another tier.disk_path).") from e
        self._replay()

    def _replay(self) -> None:
        size = os.fstat(self._fd).st_size
        if size == 0:
            self._append(_HEADER)
            return
        raw = os.pread(self._fd, size, 0)
        if raw[:len(_HEADER)] != _HEADER:
            raise TierError(f"{self.path!r} is not a gemini_jax page log (bad header); point "
                            f"tier.disk_path at an empty directory or one this framework wrote.")
        good = len(_HEADER)
        for off in range(len(_HEADER), size - RECORD_BYTES + 1, RECORD_BYTES):
            body = raw[off:off + _BODY.size]
            (crc,) = _CRC.unpack_from(raw, off + _BODY.size)
            if zlib.crc32(body) != crc:
                break  # torn or corrupt: nothing after it can be trusted
            kind, layer, page, digest = _BODY.unpack(body)
            key = (layer, page)
            if kind == INTENT:
                self.committed.pop(key, None)
                self.incomplete.add(key)
            elif kind == COMMIT:
                self.incomplete.discard(key)
                self.committed[key] = digest
            else:
                break
            good = off + RECORD_BYTES
        if good != size:
            self.torn_records = -(-(size - good) // RECORD_BYTES)
            os.ftruncate(self._fd, good)

    def _append(self, data: bytes) -> None:
        try:
            os.write(self._fd, data)  # O_APPEND is not used: we own the file; writes go at the end
        except OSError as e:
            raise TierError(f"cannot append to the page log {self.path!r}: {e.strerror} (errno {e.errno}).") from e

    @staticmethod
    def _record(kind: int, key: PageKey, digest: bytes = b"\0" * 16) -> bytes:
        body = _BODY.pack(kind, key[0], key[1], digest)
        return body + _CRC.pack(zlib.crc32(body))

    def begin(self, keys: Iterable[PageKey]) -> None:
        """Record that writes of `keys` are starting (before any of their data is written)."""
        keys = list(keys)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._append(b"".join(self._record(INTENT, k) for k in keys))
        for k in keys:
            self.committed.pop(k, None)
            self.incomplete.add(k)

    def commit(self, items: Iterable[tuple[PageKey, bytes]]) -> None:
        """Record that the data of each (key, digest) is completely written."""
        items = list(items)
        os.lseek(self._fd, 0, os.SEEK_END)
        self._append(b"".join(self._record(COMMIT, k, d) for k, d in items))
        if self.fsync:
            os.fsync(self._fd)
        for k, d in items:
            self.incomplete.discard(k)
            self.committed[k] = d

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1
