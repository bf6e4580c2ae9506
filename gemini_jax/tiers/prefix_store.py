"""`PrefixStore`: full KV pages on disk that outlive their process, keyed by what they depend on.

A page's KV depends on the model's weights, the KV layout (layers, kv heads, head dim, block
size, dtype) and every token up to its end: the cache's chained block hash
(`gemini_jax.cache.manager.block_hash`). The store lives in
`<root>/prefix-<hash of the fingerprint>/`, so another model, dtype or block size opens another
directory and never matches; `meta.json` there holds the fingerprint itself and is checked on
open.

    pages.zarr   zarr3 [capacity, 2, layers, kv_heads, block_size, row], one chunk per slot (row:
                 head_dim numbers, or a quantized vector's bytes and scale: `PageSpec.row`)
    digests.zarr the pages' selection digests [capacity, layers, kv_heads, rows, head_dim] (sparse)
    index.log    a header naming the checksum its records use, then append-only records (block
                 hash, slot, checksum of the slot's bytes), each with its own CRC

NOTE invariants:
  * a record is appended only after its slot's bytes are written, so a hash that can be found
    always names complete bytes; a failed or interrupted write leaves nothing that can be found;
  * a slot is written once (new pages take fresh slots), so a read never races a write of the
    same bytes;
  * a read is verified against the record's checksum, which covers the block hash too: bytes at
    the wrong slot fail as surely as flipped bits (`IntegrityError`, never another prefix's KV);
  * a torn last record (the process was killed while appending) is dropped on open and the log
    truncated to its last whole record;
  * one process owns a store at a time (an exclusive `flock` on the log).
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import json
import os
import struct
from typing import Optional

import numpy as np
import tensorstore as ts
import xxhash

from gemini_jax.errors import IntegrityError
from gemini_jax.tiers.errors import TierError
from gemini_jax.tiers.page import PageSpec
from gemini_jax.tiers.record_log import LogFormat, RecordLog

_MAGIC = b"GJPFXLG1"
# The checksum of a slot's bytes, by the id the index header records: a store keeps the one it was
# created with, and a header naming another is refused on open. xxh3-128 hashes at memory speed
# (about 18 GB/s a core here), so verifying a loaded prefix costs little next to reading it;
# blake2b-128 (0.7-0.9 GB/s a core) is what stores created before it use.
CHECKSUMS = {0: "blake2b-128", 1: "xxh3-128"}
CHECKSUM = 1  # new stores


def _format(checksum: int) -> LogFormat:
    return LogFormat(header=_MAGIC + struct.pack("<II", 1, checksum),  # magic, version, checksum id
                     body=struct.Struct("<QI16s"),  # block hash, slot, checksum of the slot's bytes
                     name="the prefix index", remedy="remove the directory.")


FORMAT = _format(CHECKSUM)
RECORD_BYTES = FORMAT.record_bytes  # 32
CAPACITY = 1 << 24  # slots the array can address (chunks are files: only written slots take space)


def fingerprint_id(fingerprint: dict) -> str:
    """16 hex digits naming a fingerprint (its canonical JSON, hashed)."""
    blob = json.dumps(fingerprint, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def slot_digest(block_hash: int, data: np.ndarray, digests: Optional[np.ndarray] = None,
                checksum: int = CHECKSUM) -> bytes:
    """The 16-byte checksum (`CHECKSUMS[checksum]`) of a slot: its block hash, page and digests."""
    if checksum == 1:
        h = xxhash.xxh3_128()
        h.update(b"gj-kv-prefix")
    else:
        h = hashlib.blake2b(digest_size=16, person=b"gj-kv-prefix")
    h.update(int(block_hash).to_bytes(8, "little"))
    h.update(np.ascontiguousarray(data).view(np.uint8).data)
    if digests is not None:
        h.update(np.ascontiguousarray(digests).view(np.uint8).data)
    return h.digest()


def _recorded_checksum(log_path: str, default: int) -> int:
    """The checksum id the index at `log_path` was created with (`default` for a new one). A header
    that is not ours is left to `RecordLog` to refuse; an unknown id is refused here, by name."""
    try:
        with open(log_path, "rb") as fh:
            head = fh.read(len(FORMAT.header))
    except FileNotFoundError:
        return default
    if len(head) < len(FORMAT.header) or not head.startswith(_MAGIC):
        return default
    checksum = struct.unpack_from("<II", head, len(_MAGIC))[1]
    if checksum not in CHECKSUMS:
        raise TierError(f"the prefix index {log_path!r} uses checksum id {checksum}, which this version does not "
                        f"know (it knows {CHECKSUMS}); remove the directory.")
    return checksum


def _zarr(path: str, shape, dtype: str, fsync: bool):
    return {"driver": "zarr3", "kvstore": {"driver": "file", "path": path},
            "metadata": {"shape": [CAPACITY, *shape], "data_type": dtype,
                         "chunk_grid": {"name": "regular", "configuration": {"chunk_shape": [1, *shape]}},
                         "codecs": [{"name": "bytes", "configuration": {"endian": "little"}}], "fill_value": 0},
            "context": {"cache_pool": {"total_bytes_limit": 0}, "file_io_sync": bool(fsync)}}


class PrefixStore:
    """Open (or create) the store for `fingerprint` under `root`; pages of `spec`'s layout
    (`num_pages` is ignored: slots are the store's own), with digests of `digest_shape`
    [layers, kv_heads, rows, head_dim] in `digest_dtype` (None: no digests). A new store checksums
    its pages with `checksum` (a name in `CHECKSUMS`); an existing one keeps the one its index names."""

    def __init__(self, root: str, fingerprint: dict, spec: PageSpec, *, digest_shape=None, digest_dtype=None,
                 fsync: bool = False, checksum: str = CHECKSUMS[CHECKSUM]):
        self.spec, self.fsync = spec, fsync
        self.digest_shape = None if digest_shape is None else tuple(int(x) for x in digest_shape)
        self.shape = (2, spec.num_layers, spec.kv_heads, spec.block_size, spec.row)
        self.path = os.path.join(os.path.abspath(root), f"prefix-{fingerprint_id(fingerprint)}")
        try:
            os.makedirs(self.path, exist_ok=True)
        except OSError as e:
            raise TierError(f"cannot create the prefix store {self.path!r}: {e.strerror} (errno {e.errno}).") from e
        self._check_meta(fingerprint)
        ids = {name: i for i, name in CHECKSUMS.items()}
        if checksum not in ids:
            raise ValueError(f"checksum={checksum!r} must be one of {sorted(ids)}.")
        log = os.path.join(self.path, "index.log")
        self._checksum = _recorded_checksum(log, ids[checksum])
        self._log = RecordLog(log, _format(self._checksum), fsync=fsync)
        self.torn_records = self._log.torn_records
        self.index: dict[int, tuple[int, bytes]] = {}  # block hash -> (slot, checksum)
        self._next = 0
        for block, slot, digest in self._log.records:
            self.index[block] = (slot, digest)
            self._next = max(self._next, slot + 1)
        self._log.records = []  # replayed into the index
        try:
            self._array = ts.open(_zarr(os.path.join(self.path, "pages.zarr"), self.shape, spec.np_dtype.name, fsync),
                                  create=True, open=True).result()
            self._digests = None
            if self.digest_shape is not None:
                self._digests = ts.open(_zarr(os.path.join(self.path, "digests.zarr"), self.digest_shape,
                                              str(np.dtype(digest_dtype).name) if digest_dtype is not None
                                              else spec.np_dtype.name, fsync), create=True, open=True).result()
        except ValueError as e:
            self._log.close()
            raise TierError(f"cannot open the prefix pages at {self.path!r}: {e}") from e
        self.pages_written = self.pages_read = 0
        self.failure: Optional[TierError] = None  # a write failure that stopped the engine persisting

    # ---- open ---------------------------------------------------------------------------------
    def _check_meta(self, fingerprint: dict) -> None:
        meta = os.path.join(self.path, "meta.json")
        want = json.loads(json.dumps(fingerprint, sort_keys=True))
        if os.path.exists(meta):
            try:
                with open(meta) as fh:
                    have = json.load(fh)
            except (OSError, ValueError) as e:
                raise TierError(f"the prefix store's {meta!r} is unreadable ({e}); remove the directory.") from e
            if have != want:
                raise TierError(f"the prefix store {self.path!r} belongs to another model or layout (its meta.json "
                                f"differs from this engine's fingerprint); remove the directory.")
            return
        tmp = meta + ".tmp"
        with open(tmp, "w") as fh:  # written whole, then renamed: a reader never sees half of it
            json.dump(want, fh, sort_keys=True)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, meta)

    # ---- reads and writes -----------------------------------------------------------------------
    def __contains__(self, block_hash: int) -> bool:
        return int(block_hash) in self.index

    def __len__(self) -> int:
        return len(self.index)

    @property
    def checksum(self) -> str:
        """The checksum this store's index records (`CHECKSUMS`)."""
        return CHECKSUMS[self._checksum]

    def prefix_length(self, hashes) -> int:
        """How many of the leading `hashes` (a prompt's full pages, in order) the store holds."""
        n = 0
        for h in hashes:
            if int(h) not in self.index:
                break
            n += 1
        return n

    def put(self, block_hash: int, data: np.ndarray, digests: Optional[np.ndarray] = None) -> bool:
        """Store one page, all layers: `data` [2, layers, kv_heads, block_size, head_dim] (k, v),
        and its `digests` (when the store keeps them). Returns False when the hash is already
        stored. Raises TierError when the write fails; nothing of it is then visible."""
        return self.put_many([block_hash], data[None], None if digests is None else digests[None]) == 1

    def put_many(self, hashes, data: np.ndarray, digests: Optional[np.ndarray] = None) -> int:
        """Store pages `data` [n, 2, layers, kv_heads, block_size, head_dim] under `hashes`, with
        their `digests` [n, ...] (when the store keeps them), skipping hashes already stored; returns
        how many were written. The new pages take consecutive fresh slots, written in one write per
        array, then indexed in one append. Raises TierError when the write fails; nothing of those
        pages is then visible."""
        hashes = [int(h) for h in hashes]
        data = np.asarray(data)
        if data.shape != (len(hashes), *self.shape) or data.dtype != self.spec.np_dtype:
            raise ValueError(f"prefix pages {data.shape} {data.dtype} must be {(len(hashes), *self.shape)} of "
                             f"{self.spec.np_dtype} ({len(hashes)} {self.spec.dtype} pages as stored).")
        if (digests is None) != (self._digests is None):
            raise ValueError(f"prefix page digests {'missing' if digests is None else 'given'}: this store keeps "
                             f"{'digests' if self._digests is not None else 'none'}.")
        seen, keep = set(self.index), []
        for i, h in enumerate(hashes):
            if h not in seen:
                seen.add(h)
                keep.append(i)
        if not keep:
            return 0
        data = np.ascontiguousarray(data[keep])
        if digests is not None:
            digests = np.ascontiguousarray(np.asarray(digests, self._digests.dtype.numpy_dtype)[keep])
        first, n = self._next, len(keep)
        self._next += n  # failed slots are never reused: a half-written chunk stays unreachable
        records = [(hashes[i], first + j, slot_digest(hashes[i], data[j], None if digests is None else digests[j],
                                                      self._checksum)) for j, i in enumerate(keep)]
        try:
            writes = [self._array[first:first + n].write(data)]
            if digests is not None:
                writes.append(self._digests[first:first + n].write(digests))
            for w in writes:
                w.result()
        except ValueError as e:
            raise TierError(f"prefix store write failed at {self.path!r}: {e}. Nothing of the page is visible "
                            f"({n} written together).") from e
        self._log.append(records)
        for block, slot, digest in records:
            self.index[block] = (slot, digest)
        self.pages_written += n
        return n

    def get(self, block_hash: int) -> np.ndarray:
        """The page stored under `block_hash`, verified. KeyError if none; IntegrityError if its
        bytes are not the ones recorded."""
        return self.get_many([block_hash])[0][0]

    def get_many(self, hashes) -> tuple[np.ndarray, Optional[np.ndarray]]:
        """(pages [n, 2, layers, ...], digests [n, layers, ...] or None) of `hashes`, read
        concurrently and verified each. KeyError for a hash not stored."""
        hashes = [int(h) for h in hashes]
        slots = [self.index[h][0] for h in hashes]
        if not hashes:
            return np.zeros((0, *self.shape), self.spec.np_dtype), None
        # One read per run of consecutive slots (a prefix is stored in order: usually one run), so
        # tensorstore reads the pages concurrently instead of one Python future each.
        runs = _runs(slots)
        out = _read_runs(self._array, runs)
        dig = None if self._digests is None else _read_runs(self._digests, runs)

        def failed_in(part: range) -> list[int]:
            return [i for i in part if slot_digest(hashes[i], out[i], None if dig is None else dig[i],
                                                   self._checksum) != self.index[hashes[i]][1]]

        # blake2b releases the GIL on large buffers: the pages' checksums are verified on every core,
        # one contiguous share of the pages per core (a task per page costs a third more here).
        # (xxh3 needs none of it; the shares cost it nothing either.)
        cores = os.cpu_count() or 1
        shares = [range(len(hashes) * c // cores, len(hashes) * (c + 1) // cores) for c in range(cores)]
        with concurrent.futures.ThreadPoolExecutor(max_workers=cores) as pool:
            failed = [i for part in pool.map(failed_in, shares) for i in part]
        if failed:
            h = hashes[failed[0]]
            raise IntegrityError(f"prefix page {h:016x} (slot {self.index[h][0]}) at {self.path!r} failed its "
                                 f"checksum; it is not served (prefill it again).")
        self.pages_read += len(hashes)
        return out, dig

    def close(self) -> None:
        self._log.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def _runs(slots: list[int]) -> list[tuple[int, int]]:
    """[start, stop) ranges covering `slots` in order, one per run of consecutive slots."""
    out = []
    for s in slots:
        if out and out[-1][1] == s:
            out[-1] = (out[-1][0], s + 1)
        else:
            out.append((s, s + 1))
    return out


def _read_runs(array: ts.TensorStore, runs: list[tuple[int, int]]) -> np.ndarray:
    """array[a:b] for each run, read straight into one new 64-byte-aligned buffer.
    NOTE: a long prefix is hundreds of MB, and each host copy of it (joining runs, then jax copying
    a buffer it cannot alias) costs more than the read: on a CPU backend jax aliases an aligned
    buffer instead of copying it, so the pages are touched once between the disk and the pool."""
    n = sum(b - a for a, b in runs)
    out = _aligned_empty((n, *array.shape[1:]), array.dtype.numpy_dtype)
    writes, at = [], 0
    for a, b in runs:
        writes.append(ts.array(out[at:at + b - a], copy=False).write(array[a:b]))
        at += b - a
    for w in writes:
        w.result()
    return out


def _aligned_empty(shape, dtype, align: int = 64) -> np.ndarray:
    dtype = np.dtype(dtype)
    nbytes = int(np.prod(shape)) * dtype.itemsize
    raw = np.empty(nbytes + align, np.uint8)
    at = -raw.ctypes.data % align
    return raw[at:at + nbytes].view(dtype).reshape(shape)
