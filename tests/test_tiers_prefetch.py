"""Predictor output and prefetcher hit/miss/stall accounting, over a real host + disk stack."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from gemini_jax.errors import IntegrityError
from gemini_jax.tiers import DeviceSlots, PageSpec, Predictor, Prefetcher, TierConfig, TierStack

SPEC = PageSpec(num_layers=3, num_pages=32, kv_heads=2, block_size=16, head_dim=16, dtype="float32")


def rand_page(rng):
    return tuple(rng.standard_normal(SPEC.page_shape).astype(np.float32) for _ in range(2))


@pytest.fixture
def stack(tmp_path):
    """Pages (l, 1..20) of every layer: the last 4 put are in host RAM, all are on disk."""
    rng = np.random.default_rng(0)
    cfg = TierConfig(enabled=True, host_pages=4, disk_path=str(tmp_path / "kv"))
    s = TierStack(SPEC, cfg)
    s.pages = {}
    for layer in range(3):
        for p in range(1, 21):
            s.pages[(layer, p)] = rand_page(rng)
            s.put((layer, p), *s.pages[(layer, p)])
    s.flush()
    yield s
    s.close()


def test_predictor_selection_neighbours_and_fixed():
    cfg = TierConfig(prefetch_depth=2, pin_sink_pages=1, pin_local_pages=1)
    pred = Predictor(cfg, num_layers=3, block_size=16)
    bt = np.array([[11, 12, 13, 14, 15, 16, 0, 0],   # seq 0: 6 pages (90 tokens)
                   [21, 22, 23, 0, 0, 0, 0, 0]])     # seq 1: 3 pages (40 tokens)
    lengths = np.array([90, 40])
    sel = np.array([[[2, -1], [3, -1]],  # per kv head, -1 padded; logical ids
                    [[0, 1], [1, -1]]])
    pred.observe(1, bt, sel, lengths)
    pred.observe(2, bt, None, lengths)  # dense layer: every page
    assert pred.predict(0) == [(1, p) for p in (13, 14, 21, 22, 12, 15, 23, 11, 16)] + \
        [(2, p) for p in (11, 12, 13, 14, 15, 16, 21, 22, 23)]
    assert pred.predict(1) == [(2, p) for p in (11, 12, 13, 14, 15, 16, 21, 22, 23)]  # layer 0 unseen
    assert Predictor(TierConfig(prefetch_depth=0), 3, block_size=16).predict(0) == []


def test_predictor_lookahead_comes_first_until_the_layer_runs():
    pred = Predictor(TierConfig(prefetch_depth=1, pin_sink_pages=0, pin_local_pages=0), num_layers=2, block_size=16)
    bt = np.array([[11, 12, 13, 14, 0]])
    lengths = np.array([64])
    pred.observe(1, bt, np.array([[[0, -1]]]), lengths)  # last step layer 1 read page 11 (+ neighbour 12)
    assert pred.predict(0) == [(1, 11), (1, 12)]
    pred.speculate(1, bt, np.array([[[3, 2]]]), lengths)  # this step's lookahead for layer 1
    assert pred.predict(0) == [(1, 13), (1, 14), (1, 11), (1, 12)]
    pred.observe(1, bt, np.array([[[3, -1]]]), lengths)  # layer 1 ran: the lookahead is spent
    assert pred.predict(0) == [(1, 14), (1, 13)]


def test_prefetch_hits_and_misses_are_counted(stack):
    pre = Prefetcher(stack, capacity=8, workers=2)
    assert {stack.tier_of((2, p)) for p in range(17, 21)} == {"host"}
    assert stack.tier_of((0, 5)) == "disk"
    issued = pre.schedule([(0, 5), (0, 6), (2, 20), (0, 5)])  # duplicate ignored
    assert issued == 3
    pre.drain()
    for key in [(0, 5), (0, 6), (2, 20)]:  # arrived: hits, bit-exact
        got = pre.get(key)
        assert got.k.tobytes() == stack.pages[key][0].tobytes() and got.v.tobytes() == stack.pages[key][1].tobytes()
    got = pre.get((1, 9))  # never predicted: a miss, read synchronously
    assert got.v.tobytes() == stack.pages[(1, 9)][1].tobytes()
    assert pre.take((0, 5)) is None  # taken pages leave the staging buffer
    s = pre.stats
    assert (s["prefetch_hits"], s["prefetch_misses"], s["prefetch_late"]) == (3, 1, 0)
    assert (s["pages_fetched_disk"], s["pages_fetched_host"]) == (3, 1)
    assert s["stall_seconds"] > 0 and pre.hit_rate() == 0.75
    pre.close()


class Gated:
    """The real stack behind a gate: fetches of `held` keys wait until `release` (makes 'late'
    deterministic)."""

    def __init__(self, stack, held):
        self.stack, self.held, self.gate = stack, set(held), threading.Event()

    def get(self, key):
        if key in self.held:
            self.gate.wait(10)
        return self.stack.get(key)


def test_late_prefetch_is_a_miss_and_waits_for_the_same_fetch(stack):
    src = Gated(stack, held={(1, 3)})
    pre = Prefetcher(src, capacity=8, workers=2)
    pre.schedule([(1, 3)])
    assert pre.in_flight((1, 3)) and pre.take((1, 3)) is None
    threading.Timer(0.05, src.gate.set).start()
    got = pre.get((1, 3))  # waits for the in-flight fetch instead of reading twice
    assert got.k.tobytes() == stack.pages[(1, 3)][0].tobytes()
    s = pre.stats
    assert (s["prefetch_hits"], s["prefetch_misses"], s["prefetch_late"]) == (0, 1, 1)
    assert s["pages_fetched_disk"] + s["pages_fetched_host"] == 1
    assert s["stall_seconds"] >= 0.03
    pre.close()


def test_staging_is_bounded_and_released_per_layer(stack):
    pre = Prefetcher(stack, capacity=2, workers=1)
    assert pre.schedule([(0, 1), (2, 18)]) == 2
    pre.drain()
    assert pre.schedule([(0, 3), (0, 4)]) == 0  # full: earlier (likelier) guesses keep their place
    assert pre.release_layer(0) == 1  # layer 0 ran: its unused guess (0, 1) leaves
    assert pre.stats["prefetch_wasted"] == 1 and pre.take((0, 1)) is None
    assert pre.schedule([(0, 3)]) == 1
    pre.drain()
    assert pre.take((2, 18)) is not None and pre.take((0, 3)) is not None
    pre.schedule([(0, 4)])
    pre.invalidate((0, 4))
    assert pre.take((0, 4)) is None
    pre.close()


def test_failed_prefetch_raises_at_use(stack, tmp_path):
    import os

    with open(os.path.join(stack.cfg.disk_path, "kv.zarr", "c", "0", "7", "0", "0", "0", "0"), "r+b") as f:
        f.write(b"\x01\x02\x03\x04")
    pre = Prefetcher(stack, capacity=4)
    pre.schedule([(0, 7)])
    pre.drain()
    with pytest.raises(IntegrityError, match=r"layer=0, page=7"):
        pre.get((0, 7))
    pre.close()


def test_decode_loop_scenario_counts(stack):
    """The loop of `gemini_jax.tiers.prefetch`'s docstring over 3 steps, the selection drifting by
    one page per step. Step 0 has no history: 4 misses per layer. Later steps find their two
    new pages staged (they neighbour last step's selection) and the two others still on device."""
    cfg = TierConfig(prefetch_depth=1, pin_sink_pages=0, pin_local_pages=0)
    L = 3
    slots = DeviceSlots(L, 6)  # 5 usable slots per layer for a 4-page working set
    pred = Predictor(cfg, L, block_size=16)
    pre = Prefetcher(stack, capacity=64, workers=2)
    bt = np.arange(1, 21)[None, :]  # logical i -> physical i + 1
    lengths = np.array([20 * 16])
    for step in range(3):
        selected = np.array([[4 + step, 9 + step, 14, 18]])
        for layer in range(L):
            for a in slots.ensure((layer, int(bt[0, i])) for i in selected[0]):
                if not a.hit:
                    got = pre.get(a.key)
                    assert got.k.tobytes() == stack.pages[a.key][0].tobytes()
            pred.observe(layer, bt, selected, lengths)
            pre.schedule(k for k in pred.predict(layer) if k not in slots)
            pre.drain()  # deterministic: the fetch lands before the next layer runs
    s = pre.stats
    assert (s["prefetch_misses"], s["prefetch_hits"], s["prefetch_late"]) == (12, 12, 0)
    assert s["pages_fetched_host"] + s["pages_fetched_disk"] == s["prefetch_misses"] + s["prefetch_issued"]
    assert slots.hits == 2 * L * 2
    pre.close()


def test_get_many_equals_get_page_by_page(stack):
    """The batched read the prefetcher uses: host pages in one gather, disk pages verified one by
    one, an unknown page reported as its error — the same bytes and tiers as `get`."""
    rng = np.random.default_rng(1)
    keys = [tuple(int(x) for x in k) for k in rng.permutation(list(stack.pages))[:24]] + [(0, 25)]
    tiers = {k: stack.tier_of(k) for k in keys}
    got = stack.get_many(keys)
    assert isinstance(got[(0, 25)], Exception)
    assert "disk" in {got[k].tier for k in keys[:-1]}  # 4 of the 60 pages are in host RAM
    for key in keys[:-1]:
        assert got[key].tier == tiers[key], key
        assert got[key].k.tobytes() == stack.pages[key][0].tobytes(), key
        assert got[key].v.tobytes() == stack.pages[key][1].tobytes(), key
