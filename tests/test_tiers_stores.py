"""Host and disk page stores: bit-exact round trips, LRU spill, checksums naming the page,
crash-incomplete pages never served, unwritable / full disks failing clearly while host serves."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest

from gemini_jax.errors import CacheExhausted, IntegrityError
from gemini_jax.tiers import (DiskOptions, DiskStore, HostStore, IncompletePage, PageMissing, PageSpec, TierConfig,
                              TierError, TierStack)
from gemini_jax.tiers.page_log import PageLog

SPEC = PageSpec(num_layers=3, num_pages=40, kv_heads=2, block_size=16, head_dim=32, dtype="float32")


def rand_page(rng, spec=SPEC):
    k = rng.standard_normal(spec.page_shape).astype(spec.np_dtype)
    v = rng.standard_normal(spec.page_shape).astype(spec.np_dtype)
    return k, v


def same(a, b) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and a.tobytes() == b.tobytes()


def assert_page(got, want):
    assert same(got[0], want[0]) and same(got[1], want[1])


# ---- host ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("dtype", ["float32", "bfloat16", "float16"])
def test_host_round_trip_bit_exact(dtype):
    spec = PageSpec(num_layers=2, num_pages=300, kv_heads=2, block_size=8, head_dim=16, dtype=dtype)
    rng = np.random.default_rng(1)
    host = HostStore(spec)  # unbounded: grows past its first 64 slots
    pages = {(l, p): rand_page(rng, spec) for l in range(2) for p in range(1, 100)}
    for key, (k, v) in pages.items():
        host.put(key, k, v)
    assert len(host) == len(pages)
    for key, want in pages.items():
        assert_page(host.get(key), want)
    got = host.get((0, 1))
    got[0][...] = 0  # copies: mutating them leaves the store alone
    assert_page(host.get((0, 1)), pages[(0, 1)])
    assert host.get((1, 200)) is None


def test_host_lru_spills_dirty_and_drops_clean():
    rng = np.random.default_rng(2)
    spilled = {}
    host = HostStore(SPEC, capacity=3, spill=lambda key, data: spilled.__setitem__(key, data))
    pages = {(0, p): rand_page(rng) for p in range(1, 6)}
    host.put((0, 1), *pages[(0, 1)], dirty=False)
    host.put((0, 2), *pages[(0, 2)])
    host.put((0, 3), *pages[(0, 3)])
    host.get((0, 1))  # 1 becomes most recent: LRU order 2, 3, 1
    host.put((0, 4), *pages[(0, 4)])  # evicts 2 (dirty) -> spilled
    host.put((0, 5), *pages[(0, 5)])  # evicts 3 (dirty) -> spilled
    assert sorted(spilled) == [(0, 2), (0, 3)]
    assert same(spilled[(0, 2)][0], pages[(0, 2)][0]) and same(spilled[(0, 3)][1], pages[(0, 3)][1])
    host.put((0, 2), *pages[(0, 2)], dirty=False)  # evicts 1: clean, dropped without a spill
    assert sorted(spilled) == [(0, 2), (0, 3)] and (0, 1) not in host
    assert host.keys() == [(0, 4), (0, 5), (0, 2)] and host.evictions == 3 and host.spills == 2


def test_host_full_without_lower_tier_refuses():
    rng = np.random.default_rng(3)
    host = HostStore(SPEC, capacity=2)
    host.put((0, 1), *rand_page(rng))
    host.put((0, 2), *rand_page(rng))
    with pytest.raises(CacheExhausted, match=r"layer=0, page=1"):
        host.put((0, 3), *rand_page(rng))
    assert host.keys() == [(0, 1), (0, 2)]  # nothing was lost


def test_host_refuses_wrong_shape_and_dtype():
    host = HostStore(SPEC)
    with pytest.raises(ValueError, match="kv_heads, block_size, head_dim"):
        host.put((0, 1), np.ones((2, 16, 31), np.float32), np.ones((2, 16, 31), np.float32))
    with pytest.raises(ValueError, match="dtype"):
        host.put((0, 1), np.ones(SPEC.page_shape, np.float16), np.ones(SPEC.page_shape, np.float16))
    with pytest.raises(KeyError, match="layer=3"):
        host.put((3, 1), *rand_page(np.random.default_rng(0)))


# ---- disk ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("layout", ["chunked", "sharded"])
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_disk_round_trip_and_reopen(tmp_path, layout, dtype):
    spec = PageSpec(num_layers=3, num_pages=40, kv_heads=2, block_size=16, head_dim=32, dtype=dtype)
    rng = np.random.default_rng(4)
    pages = {(l, p): rand_page(rng, spec) for l in range(3) for p in rng.choice(40, 12, replace=False)}
    with DiskStore(str(tmp_path / "kv"), spec, DiskOptions(layout=layout, shard_pages=8)) as disk:
        for key, (k, v) in pages.items():
            disk.put(key, k, v)
        key0 = next(iter(pages))
        assert_page(disk.get(key0), pages[key0])  # served from the pending buffer or disk
        disk.flush()
        for key, want in pages.items():
            assert_page(disk.get(key), want)
        # A rewrite replaces the page (ids are reused after a page is freed).
        new = rand_page(rng, spec)
        disk.put(key0, *new)
        assert_page(disk.get(key0), new)
    with DiskStore(str(tmp_path / "kv"), spec, DiskOptions(layout=layout, shard_pages=8)) as disk:
        assert disk.incomplete_pages() == []
        pages[key0] = new
        for key, want in pages.items():
            assert_page(disk.get_async(key).result(), want)
        with pytest.raises(PageMissing, match="never stored"):
            disk.get((0, 39) if (0, 39) not in pages else (0, 38))


def test_disk_back_pressure_and_shape_checks(tmp_path):
    rng = np.random.default_rng(12)
    pages = {(l, p): rand_page(rng) for l in range(3) for p in range(1, 30)}
    with DiskStore(str(tmp_path / "kv"), SPEC, DiskOptions(max_pending=2, write_batch=1)) as disk:
        for key, page in pages.items():  # puts wait for the writer instead of piling up
            disk.put(key, *page)
            assert len(disk._queue) <= 2
        disk.flush()
        for key, want in pages.items():
            assert_page(disk.get(key), want)
        with pytest.raises(ValueError, match=r"\(2, 2, 16, 32\)"):
            disk.put_stacked((0, 1), np.zeros((2, 16, 32), np.float32))  # would broadcast silently
        with pytest.raises(ValueError, match="float32"):
            disk.put_stacked((0, 1), np.zeros((2, 2, 16, 32), np.float64))


def test_disk_refuses_other_layout(tmp_path):
    DiskStore(str(tmp_path / "kv"), SPEC, DiskOptions(layout="chunked")).close()
    with pytest.raises(TierError, match="layout"):
        DiskStore(str(tmp_path / "kv"), SPEC, DiskOptions(layout="sharded"))


def test_disk_single_owner(tmp_path):
    with DiskStore(str(tmp_path / "kv"), SPEC):
        code = textwrap.dedent(f"""
            from gemini_jax.tiers import DiskStore, PageSpec, TierError
            spec = PageSpec(num_layers=3, num_pages=40, kv_heads=2, block_size=16, head_dim=32)
            try:
                DiskStore({str(tmp_path / 'kv')!r}, spec)
            except TierError as e:
                print("REFUSED", e)
        """)
        out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
        assert "REFUSED" in out.stdout and "another process" in out.stdout, out.stderr[-2000:]


def _chunk_file(root, layout, layer, page, shard_pages=8):
    base = os.path.join(root, "kv.zarr", "c")
    idx = page if layout == "chunked" else page // shard_pages
    return os.path.join(base, str(layer), str(idx), "0", "0", "0", "0")


@pytest.mark.parametrize("layout", ["chunked", "sharded"])
def test_corrupt_page_names_layer_and_page(tmp_path, layout):
    rng = np.random.default_rng(5)
    root = str(tmp_path / "kv")
    with DiskStore(root, SPEC, DiskOptions(layout=layout, shard_pages=8)) as disk:
        good = rand_page(rng)
        disk.put((1, 3), *rand_page(rng))
        disk.put((2, 30), *good)
        disk.flush()
        fname = _chunk_file(root, layout, 1, 3)
        with open(fname, "r+b") as f:  # flip one byte of the page's data
            f.seek(100)
            b = f.read(1)
            f.seek(100)
            f.write(bytes([b[0] ^ 0x5A]))
        with pytest.raises(IntegrityError, match=r"layer=1, page=3\).*checksum"):
            disk.get((1, 3))
        assert_page(disk.get((2, 30)), good)  # other pages are unaffected
        os.remove(fname)  # a vanished file reads as zeros: still caught
        with pytest.raises(IntegrityError, match=r"layer=1, page=3"):
            disk.get((1, 3))
        with open(_chunk_file(root, layout, 2, 30), "r+b") as f:  # truncated file
            f.truncate(17)
        with pytest.raises(IntegrityError, match=r"layer=2, page=30"):
            disk.get((2, 30))


def test_on_corrupt_recompute_returns_none(tmp_path):
    rng = np.random.default_rng(6)
    root = str(tmp_path / "kv")
    cfg = TierConfig(enabled=True, host_pages=1, disk_path=root, on_corrupt="recompute")
    with TierStack(SPEC, cfg) as stack:
        stack.put((0, 7), *rand_page(rng))
        stack.put((0, 8), *rand_page(rng))  # evicts (0, 7) from host (clean: on disk)
        stack.flush()
        with open(_chunk_file(root, "chunked", 0, 7), "r+b") as f:
            f.write(b"\xff\xff\xff\xff")
        assert stack.tier_of((0, 7)) == "disk"
        assert stack.get((0, 7)) is None and stack.corrupt_pages == 1
    cfg = TierConfig(enabled=True, host_pages=1, disk_path=root, on_corrupt="raise")
    with TierStack(SPEC, cfg) as stack:
        with pytest.raises(IntegrityError, match=r"layer=0, page=7"):
            stack.get((0, 7))


def test_incomplete_write_is_reported_not_served(tmp_path):
    """A crash between INTENT and COMMIT (simulated by writing the log as a killed writer left it)."""
    rng = np.random.default_rng(7)
    root = str(tmp_path / "kv")
    with DiskStore(root, SPEC) as disk:
        disk.put((0, 5), *rand_page(rng))
        disk.put((1, 6), *rand_page(rng))
    log = PageLog(os.path.join(root, "kv.checksums"))
    log.begin([(0, 5), (2, 9)])  # a rewrite of (0, 5) and a new page, never committed
    log.close()
    with open(os.path.join(root, "kv.checksums"), "ab") as f:
        f.write(b"\x02torn")  # half a record, as a crash mid-append leaves it
    with DiskStore(root, SPEC) as disk:
        assert disk.incomplete_pages() == [(0, 5), (2, 9)]
        for key in [(0, 5), (2, 9)]:
            with pytest.raises(IncompletePage, match=rf"layer={key[0]}, page={key[1]}\).*incomplete"):
                disk.get(key)
        assert disk.get((1, 6)) is not None
        new = rand_page(rng)
        disk.put((0, 5), *new)  # rewriting completes it
        disk.flush()
        assert_page(disk.get((0, 5)), new)
    with DiskStore(root, SPEC) as disk:
        assert disk.incomplete_pages() == [(2, 9)]
        assert_page(disk.get((0, 5)), new)


KILL_SCRIPT = """
import sys, numpy as np
from gemini_jax.tiers import DiskOptions, DiskStore, PageSpec
spec = PageSpec(num_layers=3, num_pages=40, kv_heads=2, block_size=16, head_dim=32)
disk = DiskStore({root!r}, spec, DiskOptions(layout={layout!r}, shard_pages=8, write_batch=16))
print("ready", flush=True)
i = 0
while True:
    key = (i % 3, (i * 7) % 40)
    rng = np.random.default_rng([key[0], key[1], i])
    disk.put(key, *(rng.standard_normal(spec.page_shape).astype(np.float32) for _ in range(2)))
    with open({root!r} + "/written", "a") as f:
        f.write(f"{{key[0]}} {{key[1]}} {{i}}\\n")
    i += 1
    if i % 64 == 0:
        disk.flush()
"""


@pytest.mark.parametrize("layout", ["chunked", "sharded"])
def test_killed_mid_write_never_serves_wrong_pages(tmp_path, layout):
    root = str(tmp_path / "kv")
    proc = subprocess.Popen([sys.executable, "-c", KILL_SCRIPT.format(root=root, layout=layout)],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        assert proc.stdout.readline().strip() == "ready", proc.stderr.read()[-2000:]
        deadline = time.time() + 30
        while time.time() < deadline:  # wait for a few hundred writes, then kill mid-stream
            if os.path.exists(root + "/written") and os.path.getsize(root + "/written") > 4000:
                break
            time.sleep(0.02)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    n_logged = len(open(root + "/written").read().splitlines())
    with DiskStore(root, SPEC, DiskOptions(layout=layout, shard_pages=8)) as disk:
        committed, incomplete = disk.committed_pages(), disk.incomplete_pages()
        assert committed, "the child committed nothing before it was killed"
        assert not set(committed) & set(incomplete)
        for key in committed:
            k, v = disk.get(key)  # verified against its checksum ...
            # ... and bit-equal to a version the child wrote (iteration i writes key (i % 3, 7i % 40);
            # the last put may have happened without its log line).
            ok = False
            for i in range(n_logged + 1):
                if (i % 3, (i * 7) % 40) == key:
                    rng = np.random.default_rng([key[0], key[1], i])
                    want = [rng.standard_normal(SPEC.page_shape).astype(np.float32) for _ in range(2)]
                    ok = ok or (same(k, want[0]) and same(v, want[1]))
            assert ok, f"page {key} verified but matches no version the child wrote"
        for key in incomplete:
            with pytest.raises(IncompletePage):
                disk.get(key)


# ---- failing disks ------------------------------------------------------------------------------
def test_unwritable_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")
    with pytest.raises(TierError, match=r"a_file.*(Not a directory|writable)"):
        DiskStore(str(blocker / "kv"), SPEC)
    with pytest.raises(TierError, match="a_file"):
        TierStack(SPEC, TierConfig(enabled=True, disk_path=str(blocker / "kv")))


@pytest.fixture
def tiny_tmpfs(tmp_path):
    """A 512 KiB tmpfs (needs root / CAP_SYS_ADMIN; skipped elsewhere)."""
    mnt = tmp_path / "tmpfs"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=512k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.decode().strip()}")
    try:
        yield mnt
    finally:
        subprocess.run(["umount", "-l", str(mnt)], capture_output=True)


def _fill_until_error(stack, rng, keys):
    kept = {}
    for i, key in enumerate(keys):
        page = rand_page(rng)
        try:
            stack.put(key, *page)
            kept[key] = page
            if i % 8 == 7:
                stack.flush()
        except TierError as e:
            kept[key] = page  # the refused page is still held by the host tier
            return kept, e
    return kept, None


def test_full_disk_fails_clearly_and_host_keeps_serving(tiny_tmpfs):
    rng = np.random.default_rng(8)
    cfg = TierConfig(enabled=True, host_pages=None, disk_path=str(tiny_tmpfs / "kv"))
    stack = TierStack(SPEC, cfg)
    keys = [(l, p) for l in range(2) for p in range(1, 40)]  # 78 pages x 8 KiB > 512 KiB
    kept, err = _fill_until_error(stack, rng, keys)
    assert err is not None, "the tiny disk never filled up"
    assert "No space left on device" in str(err) and "read-only" in str(err)
    for key, want in kept.items():  # every page, including those the disk refused, still served
        got = stack.get(key)
        assert got.tier == "host"
        assert_page((got.k, got.v), want)
    with pytest.raises(TierError):
        stack.put((2, 5), *rand_page(rng))
    assert stack.get((2, 5)).tier == "host"
    with pytest.raises(TierError):
        stack.close()


def test_path_turned_unwritable_fails_at_next_write(tmp_path):
    """The tier opened fine, then its directory for layer 1 became a regular file (works without
    root, where chmod would not stop us): the first write there fails, clearly, and the host tier
    keeps serving."""
    rng = np.random.default_rng(9)
    root = tmp_path / "kv"
    stack = TierStack(SPEC, TierConfig(enabled=True, host_pages=4, disk_path=str(root)))
    pages = {(0, p): rand_page(rng) for p in range(1, 4)}
    for key, page in pages.items():
        stack.put(key, *page)
    stack.flush()
    (root / "kv.zarr" / "c" / "1").write_text("in the way")
    pages[(1, 1)] = rand_page(rng)
    stack.put((1, 1), *pages[(1, 1)])  # queued: the write fails on the writer thread
    with pytest.raises(TierError, match=r"layer=1, page=1.*Not a directory.*read-only"):
        stack.flush()
    pages[(1, 2)] = rand_page(rng)
    with pytest.raises(TierError, match="read-only"):
        stack.put((1, 2), *pages[(1, 2)])
    for key, want in pages.items():  # disk pages, the failed one and the refused one: all served
        got = stack.get(key)
        assert_page((got.k, got.v), want)
    with pytest.raises(TierError):
        stack.close()


RLIMIT_SCRIPT = """
import resource, signal, numpy as np
from gemini_jax.tiers import PageSpec, TierConfig, TierStack, TierError
signal.signal(signal.SIGXFSZ, signal.SIG_IGN)  # over-limit writes fail with EFBIG instead of killing us
spec = PageSpec(num_layers=3, num_pages=40, kv_heads=2, block_size=16, head_dim=32)
stack = TierStack(spec, TierConfig(enabled=True, disk_path={root!r}))
rng = np.random.default_rng(0)
pages = {{}}
resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # every page file (8 KiB) is too large
for p in range(1, 5):
    pages[p] = [rng.standard_normal(spec.page_shape).astype(np.float32) for _ in range(2)]
    try:
        stack.put((0, p), *pages[p])
        stack.flush()
    except TierError as e:
        print("ERROR", p, str(e).replace("\\n", " "))
        break
for p, (k, v) in pages.items():
    got = stack.get((0, p))
    assert got.tier == "host" and got.k.tobytes() == k.tobytes() and got.v.tobytes() == v.tobytes()
print("SERVED", len(pages))
"""


def test_failing_writes_without_root(tmp_path):
    """The same failure path on any Linux machine: a file-size limit makes every page write fail."""
    code = RLIMIT_SCRIPT.format(root=str(tmp_path / "kv"))
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert "ERROR 1" in out.stdout and "File too large" in out.stdout, out.stdout + out.stderr[-3000:]
    assert "SERVED 1" in out.stdout, out.stdout + out.stderr[-3000:]


# ---- the stack's policies -------------------------------------------------------------------------
@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_stack_policies(tmp_path, policy):
    rng = np.random.default_rng(10)
    cfg = TierConfig(enabled=True, host_pages=4, disk_path=str(tmp_path / "kv"), write_policy=policy)
    pages = {(l, p): rand_page(rng) for l in range(2) for p in range(1, 7)}
    with TierStack(SPEC, cfg) as stack:
        for key, page in pages.items():
            stack.put(key, *page)
        stack.flush()
        on_disk = set(stack.disk.committed_pages())
        if policy == "write_through":
            assert on_disk == set(pages)  # every page went down at once
        else:
            assert on_disk == set(pages) - set(stack.host.keys())  # only the evicted ones
        for key, want in pages.items():
            got = stack.get(key)
            assert_page((got.k, got.v), want)
        # A page promoted from disk, then rewritten, must reach disk again with the new content.
        key = (0, 1)
        new = rand_page(rng)
        stack.put(key, *new)
        for other in [(1, 3), (1, 4), (1, 5), (1, 6)]:  # push `key` out of the host tier
            stack.get(other)
        stack.flush()
        assert key not in stack.host
        assert_page(stack.disk.get(key), new)
    with TierStack(SPEC, cfg) as stack:  # and it survives a reopen
        got = stack.get(key)
        assert got.tier == "disk"
        assert_page((got.k, got.v), new)


def test_stack_without_disk_is_bounded_by_host(tmp_path):
    rng = np.random.default_rng(11)
    with TierStack(SPEC, TierConfig(enabled=True, host_pages=2)) as stack:
        stack.put((0, 1), *rand_page(rng))
        stack.put((0, 2), *rand_page(rng))
        with pytest.raises(CacheExhausted, match="tier.host_pages"):
            stack.put((0, 3), *rand_page(rng))
        with pytest.raises(PageMissing, match=r"layer=0, page=3"):
            stack.get((0, 3))
