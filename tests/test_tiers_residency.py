"""Device-slot residency: property tests of the invariants, LRU order, pins, the hot zone."""

from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from gemini_jax.errors import CacheExhausted
from gemini_jax.tiers import DeviceSlots, HotZone, TierConfig

LAYERS, SLOTS, PAGES = 2, 5, 12  # 4 usable slots per layer (slot 0 is the null page)

key_st = st.tuples(st.integers(0, LAYERS - 1), st.integers(1, PAGES))
op_st = st.one_of(
    st.tuples(st.just("admit"), key_st),
    st.tuples(st.just("ensure"), st.lists(key_st, min_size=1, max_size=5)),
    st.tuples(st.just("pin"), st.sampled_from(["sink", "hot"]), st.lists(key_st, max_size=5)),
    st.tuples(st.just("release"), key_st),
)


@settings(max_examples=300, deadline=None)
@given(st.lists(op_st, max_size=60))
def test_slot_invariants(ops):
    slots = DeviceSlots(LAYERS, SLOTS, reserved=(0,))
    pins: dict[str, set] = {}
    for op in ops:
        before = {l: dict(zip(slots.resident(l), (slots.lookup(k) for k in slots.resident(l))))
                  for l in range(LAYERS)}
        pinned = set().union(*pins.values()) if pins else set()
        if op[0] == "pin":
            pins[op[1]] = set(op[2])
            slots.set_pins(op[1], op[2])
        elif op[0] == "release":
            slots.release(op[1])
            assert op[1] not in slots
        else:
            keys = [op[1]] if op[0] == "admit" else op[1]
            batch = set(keys)
            try:
                adms = slots.ensure(keys) if op[0] == "ensure" else [slots.admit(op[1])]
            except CacheExhausted:
                # Refused only when every slot of some layer of the batch is pinned or in the batch.
                assert any(len(slots.resident(l)) == SLOTS - 1
                           and all(k in pinned or k in batch for k in slots.resident(l))
                           for l in {l for l, _ in batch})
            else:
                for a in adms:
                    assert slots.lookup(a.key) == a.slot and a.slot != 0
                    assert a.hit == (a.key in before[a.key[0]])
                    if a.evicted is not None:
                        assert a.evicted not in pinned, "a pinned page was evicted"
                        assert a.evicted not in batch, "a page of the working set evicted another"
                        assert a.evicted[0] == a.key[0]
                for k in batch:
                    assert k in slots
            # Pinned pages resident before are still resident, in the same slot.
            for l in range(LAYERS):
                for k, s in before[l].items():
                    if k in pinned:
                        assert slots.lookup(k) == s
        slots.check()
        for l in range(LAYERS):
            assert len(slots.resident(l)) <= SLOTS - 1


def test_lru_order_and_counters():
    slots = DeviceSlots(1, 4, reserved=(0,))  # 3 usable
    a = [slots.admit((0, p)) for p in (10, 11, 12)]
    assert [x.slot for x in a] == [1, 2, 3] and not any(x.hit for x in a)
    assert slots.admit((0, 10)).hit  # 10 becomes most recent: LRU order 11, 12, 10
    ad = slots.admit((0, 13))
    assert ad.evicted == (0, 11) and ad.slot == 2
    slots.set_pins("sink", [(0, 12)])
    ad = slots.admit((0, 14))
    assert ad.evicted == (0, 10)  # 12 is older but pinned
    assert (slots.hits, slots.misses, slots.evictions) == (1, 5, 2)
    slots.set_pins("local", [(0, 13), (0, 14)])
    with pytest.raises(CacheExhausted, match="layer 0: all 3 device slots"):
        slots.admit((0, 15))
    slots.set_pins("sink", [])
    assert slots.admit((0, 15)).evicted == (0, 12)
    assert slots.release((0, 13)) is not None and slots.admit((0, 16)).evicted is None
    slots.check()


def test_ensure_protects_the_working_set():
    slots = DeviceSlots(1, 4)
    for p in (1, 2, 3):
        slots.admit((0, p))
    adms = slots.ensure([(0, 3), (0, 7), (0, 8)])  # 3 is a hit; 7, 8 evict 1, 2, never 3 or each other
    assert [a.hit for a in adms] == [True, False, False]
    assert {a.evicted for a in adms if a.evicted} == {(0, 1), (0, 2)}
    with pytest.raises(CacheExhausted):
        slots.ensure([(0, 1), (0, 2), (0, 3), (0, 4)])  # a working set larger than the layer


def test_layers_are_independent():
    slots = DeviceSlots(2, 3)
    slots.admit((0, 5))
    slots.admit((0, 6))
    b = slots.admit((1, 5))
    assert b.evicted is None and b.slot == 1  # layer 1's slots are its own
    assert slots.admit((0, 7)).evicted == (0, 5)


def test_hot_zone_fixed_and_frequency():
    cfg = TierConfig(pin_sink_pages=1, pin_local_pages=2, hot_threshold=3, hot_window=4)
    hz = HotZone(cfg, num_layers=2)
    bt = np.array([[7, 8, 9, 10, 0], [3, 4, 0, 0, 0]])
    fixed = hz.fixed(bt, lengths=np.array([50, 17]), block_size=16)
    # seq 0: 4 pages -> sink 7, local 9, 10; seq 1: 2 pages -> sink 3, local 3, 4 (all layers)
    assert fixed == {(l, p) for l in range(2) for p in (7, 9, 10, 3, 4)}
    for step in range(4):
        hz.record([(0, 8), (1, 9)] if step < 3 else [(0, 9)])
        hz.record([(0, 8)])  # twice in a step counts once
        hot = hz.end_step()
    assert hot == {(0, 8), (1, 9)}
    for _ in range(2):  # (0, 8) falls out of the 4-step window
        hz.record([])
        hot = hz.end_step()
    assert hot == set()
    off = HotZone(TierConfig(hot_threshold=0), num_layers=1)
    off.record([(0, 1)])
    assert off.end_step() == set()
