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
import sys
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
def _file_hashes(name: str, root: str) -> tuple[tuple[str, str], ...]:
    """(relative path, sha256 of its bytes) of every file of split `name`, in path order."""
    out = []
    for rel in (f for f in list_files(root) if split_of(f) == name):
        with open(os.path.join(root, rel), "rb") as fh:
            out.append((rel, hashlib.sha256(fh.read()).hexdigest()))
    return tuple(out)


@functools.lru_cache(maxsize=None)
def load_split(name: str, root: str | None = None) -> tuple[Split, np.ndarray]:
    """(description, uint8 bytes of the split's files joined by blank lines), in path order."""
    if name not in ("train", "heldout"):
        raise ValueError(f"split {name!r} must be 'train' or 'heldout'.")
    root = root or stdlib_root()
    files = tuple(rel for rel, _ in _file_hashes(name, root))
    digest = hashlib.sha256()
    parts = []
    for rel, sha in _file_hashes(name, root):
        with open(os.path.join(root, rel), "rb") as fh:
            parts.append(fh.read())
        digest.update(rel.encode() + b"\0" + bytes.fromhex(sha))
    text = SEPARATOR.join(parts)
    arr = np.frombuffer(text, dtype=np.uint8)
    return Split(name, files, digest.hexdigest(), len(arr)), arr


def manifest(root: str | None = None, *, per_file: bool = False) -> dict:
    """What the corpus is on this machine, with no machine path in it: the Python version, and
    per split the file count, byte count and content hash (`per_file`: each file's sha256 too)."""
    out = {"python": sys.version.split()[0], "held_out_percent": HELD_OUT_PERCENT}
    root = root or stdlib_root()
    for name in ("train", "heldout"):
        split, _ = load_split(name, root)
        out[name] = {"files": len(split.files), "bytes": split.num_bytes, "content_sha256": split.content_sha256}
        if per_file:
            out[name]["file_sha256"] = dict(_file_hashes(name, root))
    return out


@dataclass(frozen=True)
class CorpusCheck:
    """This machine's corpus against an expected manifest (e.g. the one a model was trained on)."""

    matches: bool
    python: str  # this interpreter's version (its standard library is the corpus)
    differences: tuple[str, ...]  # per split: "heldout: 3 files changed, 1 missing, 2 new"

    @property
    def label(self) -> str:
        """One line for result files and logs."""
        if self.matches:
            return f"standard library of Python {self.python}: the expected corpus (content hashes match)"
        return (f"standard library of Python {self.python}: NOT the expected corpus ({'; '.join(self.differences)}); "
                f"figures on it are not comparable to those made on the expected one")

    def as_dict(self) -> dict:
        return {"matches": self.matches, "python": self.python, "differences": list(self.differences),
                "label": self.label}


def check(expected: dict, root: str | None = None) -> CorpusCheck:
    """Compare this machine's corpus with `expected` (a `manifest(per_file=True)`): per split, which
    files changed, are missing or are new (by content hash)."""
    here = manifest(root, per_file=True)
    diffs = []
    for name in ("train", "heldout"):
        want, have = expected[name], here[name]
        if want["content_sha256"] == have["content_sha256"]:
            continue
        a, b = want.get("file_sha256", {}), have["file_sha256"]
        changed = sum(1 for f in set(a) & set(b) if a[f] != b[f])
        diffs.append(f"{name}: {changed} files changed, {len(set(a) - set(b))} missing, {len(set(b) - set(a))} new"
                     if a else f"{name}: content hash differs")
    return CorpusCheck(not diffs, here["python"], tuple(diffs))
