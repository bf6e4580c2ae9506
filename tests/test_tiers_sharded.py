"""`ShardedTierStack`: one host pool and one zarr array per shard of kv heads; pages split on
the way down and join on the way up, bit-exact; a corrupt shard is named."""

import os

import numpy as np
import pytest

from gemini_jax.config import TierConfig
from gemini_jax.errors import ConfigError, IntegrityError
from gemini_jax.tiers import PageSpec, ShardedTierStack, TierStack

SPEC = PageSpec(num_layers=2, num_pages=24, kv_heads=4, block_size=8, head_dim=16, dtype="float32")


def _pages(rng, n):
    return {(int(rng.integers(2)), p): (rng.standard_normal(SPEC.page_shape).astype(np.float32),
                                        rng.standard_normal(SPEC.page_shape).astype(np.float32))
            for p in rng.choice(np.arange(1, 24), n, replace=False)}


def test_pages_round_trip_through_every_shard(tmp_path):
    rng = np.random.default_rng(1)
    pages = _pages(rng, 10)
    cfg = TierConfig(enabled=True, host_pages=3, disk_path=str(tmp_path))  # most pages spill to disk
    with ShardedTierStack(SPEC, cfg, shards=2) as stack:
        for key, (k, v) in pages.items():
            stack.put(key, k, v)
        stack.flush()
        assert sorted(os.listdir(tmp_path)) == ["shard0of2", "shard1of2"]
        tiers = {stack.tier_of(key) for key in pages}
        assert tiers == {"host", "disk"}
        for key, (k, v) in pages.items():
            got = stack.get(key)
            assert got.k.tobytes() == k.tobytes() and got.v.tobytes() == v.tobytes(), key
        # Each shard holds its own heads only: half of every page's bytes.
        held = stack.bytes_held()
        assert held["disk"] == len(pages) * SPEC.page_bytes
        assert stack.stats()["shards"] == 2


def test_a_corrupt_shard_is_named(tmp_path):
    rng = np.random.default_rng(2)
    cfg = TierConfig(enabled=True, host_pages=1, disk_path=str(tmp_path))
    k, v = (rng.standard_normal(SPEC.page_shape).astype(np.float32) for _ in range(2))
    with ShardedTierStack(SPEC, cfg, shards=2) as stack:
        stack.put((1, 5), k, v)
        stack.put((0, 6), v, k)  # pushes (1, 5) out of host RAM: it is read from disk
        stack.flush()
        with open(os.path.join(tmp_path, "shard1of2", "kv.zarr", "c", "1", "5", "0", "0", "0", "0"), "r+b") as f:
            f.write(b"\x01\x02\x03\x04")
        with pytest.raises(IntegrityError, match=r"shard 1 of 2 \(kv heads 2..3\).*layer=1, page=5"):
            stack.get((1, 5))


def test_shards_equal_the_plain_stack_and_bad_counts_fail(tmp_path):
    with pytest.raises(ConfigError, match="divide kv_heads=4"):
        ShardedTierStack(SPEC, TierConfig(enabled=True), shards=3)
    rng = np.random.default_rng(3)
    pages = _pages(rng, 4)
    with ShardedTierStack(SPEC, TierConfig(enabled=True), shards=4) as a, TierStack(SPEC, TierConfig(enabled=True)) as b:
        for key, (k, v) in pages.items():
            a.put(key, k, v)
            b.put(key, k, v)
        for key in pages:
            x, y = a.get(key), b.get(key)
            assert x.k.tobytes() == y.k.tobytes() and x.v.tobytes() == y.v.tobytes() and x.tier == y.tier
