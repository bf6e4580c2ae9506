"""`tier.on_corrupt="recompute"`: disk pages whose bytes change under the engine are rebuilt by
replaying the calls that wrote them, and the run goes on as a clean run (same tokens, same
bytes in the rebuilt pages); `pages_recomputed` counts them."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.errors import IntegrityError
from gemini_jax.testing import float_tolerance, random_model, random_prompts, tiny_config

SEED = 23
N_CORRUPT = 10
NEW = 24  # tokens generated; the pages are corrupted after the first 4
CHUNK = 16  # prefill chunk: two pages


def _engine(model, path, *, sparse: bool, on_corrupt="recompute"):
    sp = SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1) if sparse else SparseConfig()
    tier = TierConfig(enabled=True, device_pages=12, host_pages=6, disk_path=str(path), prefetch_depth=1,
                      hot_threshold=0, on_corrupt=on_corrupt)
    return gj.Engine(model, EngineConfig(max_seq_len=512, max_batch=1, prefill_chunk=CHUNK, cache=CacheConfig(block_size=8),
                                         sparse=sp, tier=tier))


def _chunk_file(root: pathlib.Path, key) -> pathlib.Path:
    """The zarr3 chunk of page `key` in the chunked layout ([layer, page, 2, K, S, D], one chunk per page)."""
    return root / "kv.zarr" / "c" / str(key[0]) / str(key[1]) / "0" / "0" / "0" / "0"


def _corrupt(eng, root: pathlib.Path, rng, n: int) -> dict:
    """Flip bytes in (or, for the first, delete the file of) `n` random committed disk pages that are in neither a device slot nor host RAM
    (so the next read of each comes from disk), each written by a different prefill chunk: rebuilding
    a page replays its chunk, which rewrites every page of the chunk in every layer, so a second
    corrupt page there would be healed before it is ever read (and not counted). Returns {key: its
    bytes before}."""
    store = eng.store
    store.stack.flush()
    cands = [k for k in store.stack.disk.committed_pages()
             if k not in store.stack.host and store.page_to_slot[k] == 0 and k in store.below]
    keys, calls = [], set()
    for i in rng.permutation(len(cands)):
        key = cands[i]
        starts = {sp.start for sp in store.writes.spans(key[1])[1]}  # the calls that wrote it
        if not starts & calls and len(keys) < n:
            calls |= starts
            keys.append(key)
    assert len(keys) == n, f"only {len(keys)} disk-only pages from distinct calls (seed={SEED})"
    before = {}
    for key in keys:
        k, v = store.stack.disk.get(key)
        f = _chunk_file(root, key)
        if not before:  # the first page's file goes missing altogether (it reads back as zeros)
            before[key] = np.stack([k, v])
            f.unlink()
            continue
        data = bytearray(f.read_bytes())
        at = int(rng.integers(0, len(data) - 8))
        data[at:at + 8] = bytes(b ^ 0xA5 for b in data[at:at + 8])
        f.write_bytes(bytes(data))
        before[key] = np.stack([k, v])
    return before


@pytest.mark.parametrize("sparse", [False, True], ids=["dense-layer-path", "sparse-one-program"])
def test_corrupt_disk_pages_are_recomputed_exactly(tmp_path, sparse):
    cfg = tiny_config("llama")
    model = random_model(cfg, SEED)
    rng = np.random.default_rng(SEED)
    prompt = random_prompts(rng, cfg.vocab_size, [300])[0]
    params = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_at_eos=False)
    where = f"seed={SEED}, sparse={sparse}"
    with _engine(model, tmp_path / "clean", sparse=sparse) as eng:
        clean = eng.generate(prompt, params, return_logits=True)
    with _engine(model, tmp_path / "hit", sparse=sparse) as eng:
        sess = eng.start(prompt, params)
        toks = [next(sess) for _ in range(4)]
        before = _corrupt(eng, tmp_path / "hit", rng, N_CORRUPT)
        toks += list(sess)
        stats = sess.stats
        # Every corrupted page read since holds, in host RAM or again on disk, what it held before, up to
        # rounding: a dense replay over tiers may split its attention into other groups of pages (the
        # slots hold other pins by now), which sums the softmax in another order.
        eng.store.stack.flush()
        rebuilt = []
        for key in before:
            page = eng.store.stack.get(key)  # verified when it comes from disk; None: still corrupt
            if page is not None:
                # A page's K and V come out of the layers below it: their float bound, the context
                # (prompt and generated tokens) the longest reduction.
                tol = float_tolerance(depth=cfg.num_layers, terms=max(cfg.hidden_size, cfg.intermediate_size,
                                                                      len(prompt) + NEW),
                                      magnitude=np.abs(before[key]).max())
                np.testing.assert_allclose(np.stack([page.k, page.v]), before[key], atol=tol, rtol=0,
                                           err_msg=f"{key}, {where}")
                rebuilt.append(key)
        corrupt_seen = eng.tier_stats()["corrupt_pages"]
    assert toks == clean.tokens, where
    assert corrupt_seen > 0, where
    if sparse:  # a sparse step reads only the pages it selects: some corrupted pages may never be read
        assert 1 <= stats["pages_recomputed"] <= N_CORRUPT, (stats["pages_recomputed"], where)
    else:  # a dense step reads every page: each corrupted page is read, found bad and rebuilt once
        assert stats["pages_recomputed"] == N_CORRUPT, (stats["pages_recomputed"], where)
        assert len(rebuilt) == N_CORRUPT, where


def test_on_corrupt_raise_still_raises(tmp_path):
    """The default policy: the first corrupt page read stops the run with a typed error naming it."""
    cfg = tiny_config("llama")
    model = random_model(cfg, SEED + 1)
    rng = np.random.default_rng(SEED + 1)
    prompt = random_prompts(rng, cfg.vocab_size, [300])[0]
    with _engine(model, tmp_path, sparse=False, on_corrupt="raise") as eng:
        sess = eng.start(prompt, SamplingParams(max_new_tokens=8, temperature=0.0, stop_at_eos=False))
        next(sess)
        _corrupt(eng, tmp_path, rng, 3)
        with pytest.raises(IntegrityError, match="layer"):
            list(sess)


def test_a_failed_fill_leaves_no_page_claiming_a_slot(tmp_path):
    """`admit` whose read of a page fails (here: corrupt) must leave none of the pages it was filling
    marked resident: a retry would take them for hits and read whatever their slots held."""
    from gemini_jax.tiers.errors import PageCorrupt

    cfg = tiny_config("llama")
    model = random_model(cfg, SEED + 2)
    rng = np.random.default_rng(SEED + 2)
    prompt = random_prompts(rng, cfg.vocab_size, [300])[0]
    with _engine(model, tmp_path, sparse=False) as eng:
        eng.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0.0, stop_at_eos=False))
        # The sequence is freed but its pages stay cached below; pick two disk-only pages of layer 0.
        bad = next(iter(_corrupt(eng, tmp_path, rng, 1)))
        store = eng.store
        other = next(k for k in store.stack.disk.committed_pages()
                     if k[0] == bad[0] and k != bad and k not in store.stack.host and store.page_to_slot[k] == 0)
        with pytest.raises(PageCorrupt) as err:
            store.admit(bad[0], [other[1], bad[1]], fetch=True)
        assert err.value.key == bad
        for key in (bad, other):
            assert store.page_to_slot[key] == 0 and key not in store.slots, (key, f"seed={SEED + 2}")
        store.slots.check()
