"""`PrefixStore`: KV pages that outlive their process, keyed by fingerprint and chained block hash;
faults (failed writes, torn index, SIGKILL mid-write, bytes at the wrong place) never serve
wrong KV."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gemini_jax.errors import IntegrityError
from gemini_jax.tiers import PageSpec
from gemini_jax.tiers.errors import TierError
from gemini_jax.tiers.prefix_store import RECORD_BYTES, PrefixStore

SEED = 41
SPEC = PageSpec(num_layers=2, num_pages=1, kv_heads=2, block_size=8, head_dim=16, dtype="float32")
FP = {"model": "tiny-test", "weights_sha256": "ab" * 32, "block_size": 8, "cache_dtype": "float32"}


def _page(block_hash: int) -> np.ndarray:
    """The page a hash stands for (deterministic, so a reader can check what it got)."""
    rng = np.random.default_rng(block_hash % (2**63))
    return rng.standard_normal((2, SPEC.num_layers, SPEC.kv_heads, SPEC.block_size, SPEC.head_dim)).astype(np.float32)


def _hashes(n: int, seed: int = SEED) -> list[int]:
    return [int(h) for h in np.random.default_rng(seed).integers(1, 2**63, n, dtype=np.int64)]


def test_round_trip_reopen_and_prefix_length(tmp_path):
    hs = _hashes(6)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        assert all(st.put(h, _page(h)) for h in hs[:5])
        assert not st.put(hs[0], _page(hs[0]))  # already there: nothing written
    with PrefixStore(str(tmp_path), FP, SPEC) as st:  # a new owner finds them
        assert len(st) == 5 and st.prefix_length(hs) == 5 and st.prefix_length([hs[5]] + hs) == 0
        np.testing.assert_array_equal(st.get(hs[3]), _page(hs[3]))
        np.testing.assert_array_equal(st.get_many(hs[:5])[0], np.stack([_page(h) for h in hs[:5]]))
        # Out of slot order: several runs, read into one buffer that jax can alias (64-byte aligned).
        order = [hs[i] for i in (3, 4, 0, 2, 1)]
        got = st.get_many(order)[0]
        np.testing.assert_array_equal(got, np.stack([_page(h) for h in order]))
        assert got.ctypes.data % 64 == 0
        with pytest.raises(KeyError):
            st.get(hs[5])


@pytest.mark.parametrize("change", [{"block_size": 16}, {"weights_sha256": "cd" * 32}, {"cache_dtype": "bfloat16"}])
def test_another_model_or_layout_never_matches(tmp_path, change):
    hs = _hashes(3)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        for h in hs:
            st.put(h, _page(h))
    with PrefixStore(str(tmp_path), {**FP, **change}, SPEC) as other:
        assert len(other) == 0 and other.prefix_length(hs) == 0, change


def test_tampered_meta_and_second_owner_are_refused(tmp_path):
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        with pytest.raises(TierError, match="another process"):
            PrefixStore(str(tmp_path), FP, SPEC)
        meta = os.path.join(st.path, "meta.json")
    with open(meta, "w") as fh:
        fh.write('{"model": "something else"}')
    with pytest.raises(TierError, match="another model or layout"):
        PrefixStore(str(tmp_path), FP, SPEC)


def _chunk(st: PrefixStore, slot: int) -> str:
    return os.path.join(st.path, "pages.zarr", "c", str(slot), "0", "0", "0", "0", "0")


def test_corrupt_or_misplaced_bytes_are_never_served(tmp_path):
    hs = _hashes(3)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        for h in hs:
            st.put(h, _page(h))
        a, b = (_chunk(st, st.index[h][0]) for h in hs[:2])
        # Two slots' files swapped: each holds complete, valid-looking KV of another prefix.
        da, db = open(a, "rb").read(), open(b, "rb").read()
        open(a, "wb").write(db)
        open(b, "wb").write(da)
        for h in hs[:2]:
            with pytest.raises(IntegrityError, match="checksum"):
                st.get(h)
        c = _chunk(st, st.index[hs[2]][0])
        raw = bytearray(open(c, "rb").read())
        raw[len(raw) // 2] ^= 0x10
        open(c, "wb").write(bytes(raw))
        with pytest.raises(IntegrityError, match="checksum"):
            st.get_many(hs[2:])


def test_a_failed_write_leaves_nothing_visible(tmp_path):
    hs = _hashes(3)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        st.put(hs[0], _page(hs[0]))
        # The next slot's chunk file cannot be created (a directory sits at its path; root too).
        os.makedirs(_chunk(st, st._next))
        with pytest.raises(TierError, match="Nothing of the page is visible"):
            st.put(hs[1], _page(hs[1]))
        assert hs[1] not in st
        st.put(hs[2], _page(hs[2]))  # the store goes on, on a fresh slot
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        assert hs[1] not in st and st.prefix_length([hs[0]]) == 1
        np.testing.assert_array_equal(st.get(hs[2]), _page(hs[2]))


def test_put_many_writes_consecutive_slots_once_and_skips_stored_hashes(tmp_path):
    hs = _hashes(5)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        st.put(hs[0], _page(hs[0]))
        batch = [hs[1], hs[0], hs[2], hs[1], hs[3]]  # one already stored, one twice
        assert st.put_many(batch, np.stack([_page(h) for h in batch])) == 3
        assert [st.index[h][0] for h in hs[:4]] == [0, 1, 2, 3]
        os.makedirs(_chunk(st, st._next + 1))  # the second page of the next batch cannot be written
        with pytest.raises(TierError, match="Nothing of the page is visible"):
            st.put_many(hs[4:] + [hs[4] + 1], np.stack([_page(hs[4]), _page(hs[4] + 1)]))
        assert hs[4] not in st and hs[4] + 1 not in st  # the whole batch, not the first page only
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        assert len(st) == 4
        np.testing.assert_array_equal(st.get_many(hs[:4])[0], np.stack([_page(h) for h in hs[:4]]))


def test_a_store_keeps_the_checksum_its_index_names(tmp_path):
    """A store created with blake2b (as stores were before xxh3) is read and verified with it; new
    ones use xxh3; a header naming a checksum this version does not know is refused by name."""
    hs = _hashes(3)
    with PrefixStore(str(tmp_path), FP, SPEC, checksum="blake2b-128") as st:
        st.put(hs[0], _page(hs[0]))
        log = os.path.join(st.path, "index.log")
    with PrefixStore(str(tmp_path), FP, SPEC) as st:  # the default would be xxh3: the index says blake2b
        assert st.checksum == "blake2b-128"
        st.put(hs[1], _page(hs[1]))
        np.testing.assert_array_equal(st.get_many(hs[:2])[0], np.stack([_page(h) for h in hs[:2]]))
        chunk = _chunk(st, st.index[hs[1]][0])
    raw = bytearray(open(chunk, "rb").read())
    raw[5] ^= 0x01
    open(chunk, "wb").write(bytes(raw))
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        with pytest.raises(IntegrityError, match="checksum"):
            st.get(hs[1])
    with PrefixStore(str(tmp_path / "new"), FP, SPEC) as st:
        assert st.checksum == "xxh3-128"
    head = bytearray(open(log, "rb").read())
    head[12] = 7  # the checksum id field of the header
    open(log, "wb").write(bytes(head))
    with pytest.raises(TierError, match="checksum id 7"):
        PrefixStore(str(tmp_path), FP, SPEC)
    with pytest.raises(ValueError, match="checksum="):
        PrefixStore(str(tmp_path / "other"), FP, SPEC, checksum="md5")


def test_torn_index_tail_is_trimmed_on_open(tmp_path):
    hs = _hashes(4)
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        for h in hs[:3]:
            st.put(h, _page(h))
        log = os.path.join(st.path, "index.log")
    size = os.path.getsize(log)
    with open(log, "ab") as fh:  # a record cut short by a crash, then garbage
        fh.write(os.urandom(RECORD_BYTES // 2))
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        assert st.torn_records == 1 and os.path.getsize(log) == size
        assert st.prefix_length(hs[:3]) == 3
        st.put(hs[3], _page(hs[3]))
    with PrefixStore(str(tmp_path), FP, SPEC) as st:
        assert st.prefix_length(hs) == 4 and st.torn_records == 0
        np.testing.assert_array_equal(st.get(hs[3]), _page(hs[3]))


_WRITER = textwrap.dedent("""
    import sys, numpy as np
    sys.path.insert(0, {tests!r})
    from test_tiers_prefix import FP, SPEC, _page
    from gemini_jax.tiers.prefix_store import PrefixStore
    st = PrefixStore({root!r}, FP, SPEC)
    rng = np.random.default_rng({seed})
    print("open", flush=True)
    while True:
        h = int(rng.integers(1, 2**63, dtype=np.int64))
        st.put(h, _page(h))
""")


def _kill_loop(tmp_path, kills: int):
    rng = np.random.default_rng(SEED)
    seen = 0
    for i in range(kills):
        code = _WRITER.format(tests=os.path.dirname(__file__), root=str(tmp_path), seed=SEED + i)
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        assert proc.stdout.readline().strip() == "open", f"writer {i} did not start (seed={SEED})"
        time.sleep(float(rng.uniform(0.2, 0.8)))
        proc.send_signal(signal.SIGKILL)
        proc.wait()
        with PrefixStore(str(tmp_path), FP, SPEC) as st:  # every page it can find is whole and right
            assert len(st) > seen, f"kill {i}: no page was written (seed={SEED})"
            seen = len(st)
            hs = list(st.index)
            np.testing.assert_array_equal(st.get_many(hs)[0], np.stack([_page(h) for h in hs]),
                                          err_msg=f"kill {i}, seed={SEED}")


def test_sigkill_mid_write_two_kills(tmp_path):
    _kill_loop(tmp_path, 2)


@pytest.mark.slow
def test_sigkill_mid_write_ten_kills(tmp_path):
    _kill_loop(tmp_path, 10)


def test_digests_round_trip_and_are_checked(tmp_path):
    hs = _hashes(2)
    dig = np.random.default_rng(SEED).standard_normal((2, SPEC.num_layers, SPEC.kv_heads, 2, SPEC.head_dim))
    dig = dig.astype(np.float32)
    kw = dict(digest_shape=dig.shape[1:], digest_dtype=np.float32)
    with PrefixStore(str(tmp_path), FP, SPEC, **kw) as st:
        for h, d in zip(hs, dig):
            st.put(h, _page(h), d)
        with pytest.raises(ValueError, match="digests missing"):
            st.put(_hashes(1, SEED + 1)[0], _page(1))
    with PrefixStore(str(tmp_path), FP, SPEC, **kw) as st:
        pages, got = st.get_many(hs)
        np.testing.assert_array_equal(got, dig)
        f = os.path.join(st.path, "digests.zarr", "c", str(st.index[hs[1]][0]), "0", "0", "0", "0")
        raw = bytearray(open(f, "rb").read())
        raw[3] ^= 0x40
        open(f, "wb").write(bytes(raw))
        with pytest.raises(IntegrityError):
            st.get_many(hs)


def _engine_cfg(path, *, tiers: bool, block: int = 8, sparse: bool = False, dtype=None):
    from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig, TierConfig

    sp = SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1) if sparse else SparseConfig()
    tier = TierConfig(enabled=tiers, device_pages=24 if tiers else None, prefetch_depth=0, hot_threshold=0,
                      disk_path=str(path), persistent=True)
    return EngineConfig(max_seq_len=512, max_batch=1, prefill_chunk=32, cache=CacheConfig(block_size=block, dtype=dtype),
                        sparse=sp, tier=tier)


@pytest.mark.parametrize("dtype", ["float32", "int8", "float8_e4m3fn"])
def test_pages_in_the_stored_form_scatter_as_laid_out_pages_do(monkeypatch, dtype):
    """`PooledStore.scatter_rows` (rows [n, 2, L, K, S, row] as the prefix store keeps them, laid out
    and unpacked on device, in pieces) writes the pool `scatter` writes from [L, K, n, S, D] pages:
    several pieces, the last padded, page ids in random order, digests beside them."""
    import jax
    import jax.numpy as jnp

    from gemini_jax.attention import kvquant
    from gemini_jax.cache import store as cache_store
    from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig
    from gemini_jax.testing import tiny_config

    monkeypatch.setattr(cache_store, "ROWS_PIECE", 4)  # 11 pages: pieces of 4, 4 and 3 (padded to 4)
    cfg = tiny_config("llama")
    ec = EngineConfig(max_seq_len=256, max_batch=1, cache=CacheConfig(block_size=8, dtype=dtype),
                      sparse=SparseConfig(enabled=True, budget=64))
    rng = np.random.default_rng(SEED)
    n, L, K, S, D = 11, cfg.num_layers, cfg.num_kv_heads, 8, cfg.head_dim
    pages = rng.permutation(np.arange(1, ec.num_pages))[:n]
    k, v = (rng.standard_normal((L, K, n, S, D)).astype(np.float32) for _ in range(2))
    stores = [cache_store.PooledStore(cfg, ec, jnp.dtype(dtype)) for _ in range(2)]
    dig = rng.standard_normal((L, K, n, *stores[0].device.digests.shape[3:])).astype(np.float32)
    if kvquant.is_quantized(dtype):  # the stored form holds quantized vectors packed with their scales
        k, v = (kvquant.to_host(kvquant.quantize(jnp.asarray(x), dtype)) for x in (k, v))
        rows = np.stack([np.moveaxis(kvquant.pack(x), 2, 0) for x in (k, v)], axis=1)
    else:
        rows = np.stack([np.moveaxis(x, 2, 0) for x in (k, v)], axis=1)
    stores[0].scatter(pages, k, v, dig)
    stores[1].scatter_rows(pages, rows, np.moveaxis(dig, 2, 0))
    want, got = jax.tree.leaves(stores[0].device), jax.tree.leaves(stores[1].device)
    assert len(want) == len(got) == (5 if kvquant.is_quantized(dtype) else 3)
    for a, b in zip(want, got):
        np.testing.assert_array_equal(np.asarray(a), np.asarray(b), err_msg=f"seed={SEED}, dtype={dtype}")
    assert np.asarray(got[-1])[:, :, pages].any(), f"seed={SEED}: nothing was written"


# int8 on the pool without tiers repeats the tiered int8 case's store path: `make test-slow`.
@pytest.mark.parametrize("tiers, sparse, dtype", [(False, False, None), (True, True, None), (True, True, "int8"),
                                                  pytest.param(False, True, "int8", marks=pytest.mark.slow)],
                         ids=["pool", "tiers-sparse", "tiers-sparse-int8", "pool-sparse-int8"])
def test_a_new_engine_loads_a_stored_prefix_instead_of_prefilling(tmp_path, tiers, sparse, dtype):
    """int8: pages go to disk packed with their scales, and a store of another KV dtype never matches."""
    import gemini_jax as gj
    from gemini_jax.config import SamplingParams
    from gemini_jax.testing import logits_tolerance, random_model, random_prompts, tiny_config

    cfg = tiny_config("llama")
    model = random_model(cfg, SEED)
    prompt = random_prompts(np.random.default_rng(SEED), cfg.vocab_size, [300])[0]
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_at_eos=False)
    where = f"seed={SEED}, tiers={tiers}, sparse={sparse}, dtype={dtype}"
    with gj.Engine(model, _engine_cfg(tmp_path, tiers=tiers, sparse=sparse, dtype=dtype)) as eng:
        cold = eng.generate(prompt, params, return_logits=True)
        assert eng.prefixes.pages_written == (len(prompt) - 1) // 8, where
    with gj.Engine(model, _engine_cfg(tmp_path, tiers=tiers, sparse=sparse, dtype=dtype)) as eng:  # same disk
        warm = eng.generate(prompt, params, return_logits=True)
    # Loaded up to the last prefill-chunk boundary (32) before the last token: the rest is
    # prefilled in the chunks the cold run made.
    assert warm.stats["prefill_tokens_reused"] == (len(prompt) - 1) // 32 * 32, where
    assert warm.stats["prefill_tokens_computed"] <= 32, where
    assert warm.tokens == cold.tokens, where
    # The same stored pages; the last chunk attends over them in another program (loaded vs computed).
    tol = logits_tolerance(cfg, context=len(prompt) + 6, reference=cold.logits)
    np.testing.assert_allclose(warm.logits, cold.logits, atol=tol, rtol=0, err_msg=where)
    if dtype is not None:  # the same layout in float32: another store
        with gj.Engine(model, _engine_cfg(tmp_path, tiers=tiers, sparse=sparse)) as eng:
            assert eng.generate(prompt, params).stats["prefill_tokens_reused"] == 0, where
        return  # (another block size or other weights: the float cases check them)
    # Another block size or other weights: another store, nothing reused.
    with gj.Engine(model, _engine_cfg(tmp_path, tiers=tiers, block=16, sparse=sparse)) as eng:
        assert eng.generate(prompt, params).stats["prefill_tokens_reused"] == 0, where
    with gj.Engine(random_model(cfg, SEED + 1), _engine_cfg(tmp_path, tiers=tiers, sparse=sparse)) as eng:
        assert eng.generate(prompt, params).stats["prefill_tokens_reused"] == 0, where


def test_a_corrupt_stored_page_is_prefilled_again(tmp_path):
    import gemini_jax as gj
    from gemini_jax.config import SamplingParams
    from gemini_jax.testing import random_model, random_prompts, tiny_config

    cfg = tiny_config("llama")
    model = random_model(cfg, SEED + 2)
    prompt = random_prompts(np.random.default_rng(SEED + 2), cfg.vocab_size, [200])[0]
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_at_eos=False)
    with gj.Engine(model, _engine_cfg(tmp_path, tiers=False)) as eng:
        cold = eng.generate(prompt, params)
        st = eng.prefixes
        slot = sorted(st.index.values())[10][0]  # the 11th page stored
        f = _chunk(st, slot)
    raw = bytearray(open(f, "rb").read())
    raw[100] ^= 0x01
    open(f, "wb").write(bytes(raw))
    with gj.Engine(model, _engine_cfg(tmp_path, tiers=False)) as eng:
        warm = eng.generate(prompt, params)
    assert warm.stats["prefill_tokens_reused"] == 10 * 8 // 32 * 32, f"seed={SEED + 2}"  # up to the bad page
    assert warm.tokens == cold.tokens, f"seed={SEED + 2}"
