"""Decode snapshots with Orbax: arrays as arrays (KV pages, digests, next-token logits), metadata
as JSON, no pickle. Written into a temporary directory, sealed with a content hash, then renamed
into place, so a killed process leaves either the old snapshot or none, never a half one.

Layout of a snapshot directory:
    arrays/        Orbax checkpoint: k, v [layers, kv_heads, pages, block, head_dim], logits [V],
                   digests (sparse engines)
    meta.json      tokens, positions, sampling state, the engine/model fingerprint, array digests
    SEALED         sha256 of meta.json; the snapshot's content hash (written last)
"""

from __future__ import annotations

import dataclasses
import glob
import hashlib
import json
import os
import shutil
import time
import uuid

import numpy as np

from gemini_jax.attention import kvquant
from gemini_jax.errors import SnapshotError
from gemini_jax.runtime import images

FORMAT = 1


def _sha(a: np.ndarray) -> str:
    return hashlib.sha256(np.ascontiguousarray(a).tobytes()).hexdigest()


def fingerprint(engine) -> dict:
    """What must match for a snapshot to be valid on an engine: model, weights, KV layout."""
    c = engine.config
    return {
        "model": json.loads(json.dumps(dataclasses.asdict(engine.model_cfg))),
        "weights_sha256": engine.weights_sha256,
        "block_size": c.cache.block_size,
        "cache_dtype": str(engine.cache_dtype),
        "sparse": json.loads(json.dumps(dataclasses.asdict(c.sparse))),
    }


def _differences(a: dict, b: dict, prefix: str = "") -> list[str]:
    out = []
    for k in sorted(set(a) | set(b)):
        x, y = a.get(k), b.get(k)
        if isinstance(x, dict) and isinstance(y, dict):
            out += _differences(x, y, f"{prefix}{k}.")
        elif x != y:
            out.append(f"{prefix}{k}: snapshot {x!r} != engine {y!r}")
    return out


def save_snapshot(sess, path: str, *, include_kv: bool = True, image: "images.SequenceImage | None" = None) -> str:
    """Save `sess` (a `Session`, or any object with its fields: engine, seq_id, logits f32[1, V],
    prompt_len, generated, new_tokens, finished, params, sample_index, budget, compute_units)
    atomically; returns the content hash. `image`: the sequence's pages when they are off the
    pool already (a server's interrupted request), else they are read from the store."""
    from orbax import checkpoint as ocp

    if not include_kv:
        raise SnapshotError("include_kv=False (KV by reference to persisted pages) needs the disk tier, "
                            "which this engine does not have; use include_kv=True.")
    e = sess.engine
    # Pages wherever they live: the device pool, or device slots, host RAM and disk under tiers.
    image = image if image is not None else e.sequences.image(sess.seq_id)
    arrays = {"logits": np.asarray(sess.logits[0])}
    for name, x in (("k", image.k), ("v", image.v)):  # quantized KV: the stored bytes and their scales
        if isinstance(x, kvquant.QuantPages):
            arrays[name], arrays[f"{name}_scale"] = x.data, x.scale
        else:
            arrays[name] = x
    if image.digests is not None:
        arrays["digests"] = image.digests
    # Soft tokens (encoder outputs): their vectors travel with the snapshot, since their ids name rows
    # of this engine's table, which another engine numbers differently (restore_soft renumbers).
    used = e.soft.entries_in(image.tokens) if e.soft is not None else []
    if used:
        arrays["soft_vectors"] = np.concatenate([e.soft.vectors(s) for s in used])
    meta = {
        "format": FORMAT,
        "created": time.time(),
        "fingerprint": fingerprint(e),
        "tokens": list(image.tokens),
        "prompt_len": sess.prompt_len,
        "generated": [int(t) for t in sess.generated],
        "new_tokens": sess.new_tokens,
        "finished": sess.finished,
        "null_pages": list(image.null_pages),
        "sampling": dataclasses.asdict(sess.params),
        "sample_index": sess.sample_index,
        "budget": sess.budget,
        "compute_units": sess.compute_units,
        "arrays_sha256": {k: _sha(v) for k, v in sorted(arrays.items())},
        "soft": [{"key": s.key, "first": s.first, "n": s.n, "source": s.source} for s in used],
    }
    path = os.path.abspath(path)
    parent = os.path.dirname(path)
    os.makedirs(parent, exist_ok=True)
    tmp = os.path.join(parent, f".{os.path.basename(path)}.tmp-{uuid.uuid4().hex[:8]}")
    try:
        ck = ocp.StandardCheckpointer()
        ck.save(os.path.join(tmp, "arrays"), arrays)
        ck.wait_until_finished()
        ck.close()
        blob = json.dumps(meta, sort_keys=True).encode()
        with open(os.path.join(tmp, "meta.json"), "wb") as fh:
            fh.write(blob)
            fh.flush()
            os.fsync(fh.fileno())
        digest = hashlib.sha256(blob).hexdigest()
        with open(os.path.join(tmp, "SEALED"), "w") as fh:
            fh.write(digest)
            fh.flush()
            os.fsync(fh.fileno())
        if os.path.exists(path):  # replace: move the old one aside first, then swap
            # NOTE: killed between these renames, the old snapshot waits aside, sealed, and
            # load_snapshot finds it there; the next save removes it.
            old = f"{tmp}.old"
            os.rename(path, old)
            os.rename(tmp, path)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, path)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    for stale in glob.glob(os.path.join(parent, f".{glob.escape(os.path.basename(path))}.tmp-*.old")):
        shutil.rmtree(stale, ignore_errors=True)  # copies left aside by a save that was killed
    return digest


def _replaced_copy(path: str) -> str:
    """`path`, or, when a process was killed between the two renames that replace a snapshot
    (`save_snapshot`), the previous snapshot it had moved aside: still sealed, still valid."""
    if os.path.isdir(path):
        return path
    aside = glob.glob(os.path.join(os.path.dirname(path), f".{glob.escape(os.path.basename(path))}.tmp-*.old"))
    aside = [d for d in aside if os.path.isfile(os.path.join(d, "SEALED"))]
    return max(aside, key=os.path.getmtime) if aside else path


def load_snapshot(path: str) -> tuple[dict, dict, str]:
    """(meta, arrays, content hash) of a sealed snapshot, or SnapshotError saying what is wrong."""
    from orbax import checkpoint as ocp

    path = _replaced_copy(os.path.abspath(path))
    if not os.path.isdir(path):
        raise SnapshotError(f"no snapshot at {path!r}.")
    try:
        with open(os.path.join(path, "SEALED")) as fh:
            sealed = fh.read().strip()
        with open(os.path.join(path, "meta.json"), "rb") as fh:
            blob = fh.read()
    except FileNotFoundError as e:
        raise SnapshotError(f"snapshot {path!r} is incomplete ({os.path.basename(e.filename)} missing): "
                            f"it was not finished; take it again.") from None
    if hashlib.sha256(blob).hexdigest() != sealed:
        raise SnapshotError(f"snapshot {path!r}: meta.json does not match its seal (tampered or truncated).")
    try:
        meta = json.loads(blob)
        arrays = ocp.StandardCheckpointer().restore(os.path.join(path, "arrays"))
    except Exception as e:  # orbax/tensorstore raise many kinds on damaged files
        raise SnapshotError(f"snapshot {path!r}: cannot read arrays ({type(e).__name__}: {e}).") from None
    want = meta.get("arrays_sha256", {})
    if set(want) != set(arrays):
        raise SnapshotError(f"snapshot {path!r}: arrays {sorted(arrays)} != recorded {sorted(want)}.")
    for k, v in arrays.items():
        if _sha(np.asarray(v)) != want[k]:
            raise SnapshotError(f"snapshot {path!r}: array {k!r} fails its checksum (tampered or corrupt).")
    if meta.get("format") != FORMAT:
        raise SnapshotError(f"snapshot {path!r} has format {meta.get('format')}, this version reads {FORMAT}.")
    return meta, {k: np.asarray(v) for k, v in arrays.items()}, sealed


def check_fingerprint(engine, path: str, meta: dict) -> None:
    """SnapshotError naming the differences when a snapshot was taken on another model or config."""
    diffs = _differences(meta["fingerprint"], fingerprint(engine))
    if diffs:
        raise SnapshotError(f"snapshot {path!r} was taken on another model or config: " + "; ".join(diffs[:6]))


def restore_pages(engine, seq_id: int, meta: dict, arrays: dict) -> None:
    """Register sequence `seq_id` with the snapshot's tokens and write its pages into the store
    (a prefix already cached is shared, not rewritten)."""
    k, v = ((kvquant.QuantPages(arrays[n], arrays[f"{n}_scale"]) if f"{n}_scale" in arrays else arrays[n])
            for n in ("k", "v"))
    image = images.SequenceImage(tokens=tuple(meta["tokens"]), null_pages=tuple(meta["null_pages"]),
                                 k=k, v=v, digests=arrays.get("digests"))
    engine.sequences.swap_in(seq_id, image)


def restore_soft(engine, path: str, meta: dict, arrays: dict) -> list[int]:
    """The snapshot's tokens with its soft-token ids renumbered for `engine`: each input's vectors are
    registered in the engine's table (an input it holds already keeps its ids). SnapshotError when the
    recorded vectors do not match their entries."""
    tokens = np.asarray(meta["tokens"], np.int64)
    entries = meta.get("soft", [])
    if not entries:
        return [int(t) for t in tokens]
    vectors = arrays.get("soft_vectors")
    if vectors is None or len(vectors) != sum(s["n"] for s in entries):
        raise SnapshotError(f"snapshot {path!r}: its soft tokens' vectors are missing or do not match its entries.")
    base, out, at = engine.model_cfg.vocab_size, tokens.copy(), 0
    for s in entries:
        ids = engine.soft.add(s["key"], vectors[at:at + s["n"]], s["source"])
        at += s["n"]
        old = (tokens >= base + s["first"]) & (tokens < base + s["first"] + s["n"])
        out[old] = ids[tokens[old] - base - s["first"]]
    return [int(t) for t in out]
