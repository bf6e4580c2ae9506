"""The real-text corpus: the running interpreter's standard-library `.py` sources.

Every machine with Python has them, so they are our training text, our haystack and our
held-out set. Files are split by a hash of their relative path (not by random draw), so the
split is the same on every machine with the same standard library, and `manifest()` records a
content hash that says whether two machines really hold the same corpus.
"""

from __future__ import annotations

import functools
import hashlib
import os
import sysconfig
from dataclasses import dataclass

import numpy as np

HELD_OUT_PERCENT = 10
SEPARATOR = b"\n\n"


def stdlib_root() -> str:
    return sysconfig.get_paths()["stdlib"]


def split_of(relpath: str) -> str:
    """'heldout' for ~10% of paths, 'train' for the rest; depends on the path only."""
    h = int.from_bytes(hashlib.sha256(relpath.encode()).digest()[:8], "big")
    return "heldout" if h % 100 < HELD_OUT_PERCENT else "train"


@functools.lru_cache(maxsize=None)
def list_files(root: str | None = None) -> tuple[str, ...]:
    """Sorted relative paths of the standard library's .py files (site-packages excluded)."""
    root = root or stdlib_root()
    out = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(d for d in dirnames if d not in ("site-packages", "__pycache__"))
        for f in filenames:
            if f.endswith(".py"):
                out.append(os.path.relpath(os.path.join(dirpath, f), root))
    return tuple(sorted(out))


@dataclass(frozen=True)
class Split:
    name: str
    files: tuple[str, ...]
    content_sha256: str
    num_bytes: int


@functools.lru_cache(maxsize=None)
def load_split(name: str, root: str | None = None) -> tuple[Split, np.ndarray]:
    """(description, uint8 bytes of the split's files joined by blank lines), in path order."""
    if name not in ("train", "heldout"):
        raise ValueError(f"split {name!r} must be 'train' or 'heldout'.")
    root = root or stdlib_root()
    files = tuple(f for f in list_files(root) if split_of(f) == name)
    digest = hashlib.sha256()
    parts = []
    for rel in files:
        with open(os.path.join(root, rel), "rb") as fh:
            data = fh.read()
        digest.update(rel.encode() + b"\0" + hashlib.sha256(data).digest())
        parts.append(data)
    text = SEPARATOR.join(parts)
    arr = np.frombuffer(text, dtype=np.uint8)
    return Split(name, files, digest.hexdigest(), len(arr)), arr


def manifest(root: str | None = None) -> dict:
    """What the corpus is on this machine: file counts, byte counts and content hashes per split."""
    import sys

    out = {"python": sys.version.split()[0], "root": root or stdlib_root(),
           "held_out_percent": HELD_OUT_PERCENT}
    for name in ("train", "heldout"):
        split, _ = load_split(name, root)
        out[name] = {"files": len(split.files), "bytes": split.num_bytes,
                     "content_sha256": split.content_sha256}
    return out
