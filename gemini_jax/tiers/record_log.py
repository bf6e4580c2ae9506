"""`RecordLog`: an append-only file of fixed-size, CRC-checked records, owned by one process.

What the disk tier's page log (`page_log.PageLog`) and the persistent prefix index
(`prefix_store.PrefixStore`) have in common: a header naming the format, then records of one
`struct` layout, each followed by the CRC32 of its bytes.

NOTE invariants:
  * opening replays the file: the records up to the first torn, corrupt or invalid one are returned, and
    the file is truncated there (nothing after a torn record can be trusted), `torn_records`
    counting what was dropped;
  * one process owns a log at a time (an exclusive, non-blocking `flock`, held until `close`);
  * an append writes whole records at the end, then fsyncs when asked to.
"""

from __future__ import annotations

import fcntl
import os
import struct
import zlib
from dataclasses import dataclass
from typing import Callable, Iterable

from gemini_jax.tiers.errors import TierError

_CRC = struct.Struct("<I")


@dataclass(frozen=True)
class LogFormat:
    """A log's header bytes, its record layout, and how errors name it to the user."""

    header: bytes
    body: struct.Struct
    name: str  # e.g. "the disk tier's page log": used in every error
    remedy: str  # what to do when the file is not of this format, e.g. "remove the directory."
    valid: Callable[[tuple], bool] = lambda record: True  # a whole record that fails it ends the replay

    @property
    def record_bytes(self) -> int:
        return self.body.size + _CRC.size


class RecordLog:
    """Open (or create) the log at `path`, lock it and replay it into `records` (tuples)."""

    def __init__(self, path: str, fmt: LogFormat, *, fsync: bool = False):
        self.path, self.fmt, self.fsync = path, fmt, fsync
        self.torn_records = 0  # partial / corrupt records dropped at replay
        try:
            self._fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as e:
            raise TierError(f"cannot open {fmt.name} {path!r}: {e.strerror} (errno {e.errno}).") from e
        try:
            fcntl.flock(self._fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(self._fd)
            raise TierError(f"{fmt.name} {path!r} is held by another process; one process may own it at a "
                            f"time.") from e
        try:
            self.records = self._replay()
        except TierError:
            self.close()
            raise

    def _replay(self) -> list[tuple]:
        fmt, size = self.fmt, os.fstat(self._fd).st_size
        if size == 0:
            self._write(fmt.header)
            return []
        raw = os.pread(self._fd, size, 0)
        if raw[:len(fmt.header)] != fmt.header:
            raise TierError(f"{self.path!r} is not {fmt.name} (bad header); {fmt.remedy}")
        out, good = [], len(fmt.header)
        for off in range(good, size - fmt.record_bytes + 1, fmt.record_bytes):
            body = raw[off:off + fmt.body.size]
            (crc,) = _CRC.unpack_from(raw, off + fmt.body.size)
            if zlib.crc32(body) != crc or not fmt.valid(record := fmt.body.unpack(body)):
                break  # torn or corrupt: nothing after it can be trusted
            out.append(record)
            good = off + fmt.record_bytes
        if good != size:
            self.torn_records = -(-(size - good) // fmt.record_bytes)
            os.ftruncate(self._fd, good)
        return out

    def _write(self, data: bytes) -> None:
        try:
            os.lseek(self._fd, 0, os.SEEK_END)  # O_APPEND is not used: we own the file; writes go at the end
            os.write(self._fd, data)
        except OSError as e:
            raise TierError(f"cannot append to {self.fmt.name} {self.path!r}: {e.strerror} (errno {e.errno}).") from e

    def append(self, records: Iterable[tuple], *, sync: bool | None = None) -> None:
        """Write `records` (tuples of the body's fields) at the end, each with its CRC; then fsync
        when `sync` (default: the log's `fsync`)."""
        body = self.fmt.body
        data = b"".join((b := body.pack(*r)) + _CRC.pack(zlib.crc32(b)) for r in records)
        self._write(data)
        if self.fsync if sync is None else sync:
            try:
                os.fsync(self._fd)
            except OSError as e:
                raise TierError(f"cannot sync {self.fmt.name} {self.path!r}: {e.strerror} (errno {e.errno}).") from e

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)  # releases the flock
            self._fd = -1
