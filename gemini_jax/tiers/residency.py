"""Which (layer, page) units sit in device slots: `DeviceSlots` (LRU with pins) and `HotZone`
(which pages deserve a pin: sink, local window, frequently selected).

Device slots are per layer: the device pool is `[layers, kv_heads, slots, block_size, head_dim]`,
so a page of layer l can only live in a slot of layer l, and each layer evicts among its own.
Pure host bookkeeping: the caller moves the bytes (device_put into the slot it is given).

NOTE invariants (property-tested):
  * a slot holds at most one key and a key at most one slot;
  * a layer never holds more keys than it has slots; reserved slots (the null page) are never
    handed out;
  * a pinned key is never evicted; `CacheExhausted` is raised only when every slot of the layer
    holds a pinned (or same-batch) key.
"""

from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence

from gemini_jax.errors import CacheExhausted
from gemini_jax.config import TierConfig
from gemini_jax.tiers.page import PageKey


@dataclass(frozen=True)
class Admission:
    """Result of admitting `key`: its `slot`, whether it was already resident (`hit`; nothing to
    copy), and the key whose slot it took (`evicted`, None if the slot was free)."""

    key: PageKey
    slot: int
    hit: bool
    evicted: Optional[PageKey] = None


class DeviceSlots:
    """`slots_per_layer` device slots for each of `num_layers` layers, minus `reserved` slot ids."""

    def __init__(self, num_layers: int, slots_per_layer: int, *, reserved: Sequence[int] = (0,)):
        if num_layers < 1 or slots_per_layer < 1:
            raise ValueError(f"num_layers={num_layers} and slots_per_layer={slots_per_layer} must be >= 1.")
        self.num_layers = num_layers
        self.slots_per_layer = slots_per_layer
        self.reserved = frozenset(reserved)
        if not self.reserved <= set(range(slots_per_layer)):
            raise ValueError(f"reserved={sorted(self.reserved)} must be slot ids in [0, {slots_per_layer}).")
        self.capacity = slots_per_layer - len(self.reserved)
        if self.capacity < 1:
            raise ValueError(f"no usable slot: slots_per_layer={slots_per_layer}, reserved={sorted(self.reserved)}.")
        free = [s for s in range(slots_per_layer - 1, -1, -1) if s not in self.reserved]
        self._free = [list(free) for _ in range(num_layers)]  # pop() hands out the lowest id
        self._lru: list[OrderedDict[int, int]] = [OrderedDict() for _ in range(num_layers)]  # page -> slot
        self._pins: dict[str, frozenset[PageKey]] = {}
        self._pinned: set[PageKey] = set()
        self._pinned_per_layer = [0] * num_layers
        self.hits = self.misses = self.evictions = 0

    # ---- queries ------------------------------------------------------------------------------
    def lookup(self, key: PageKey) -> Optional[int]:
        """The slot holding `key`, or None. Does not count as a use."""
        return self._lru[key[0]].get(key[1])

    def __contains__(self, key: PageKey) -> bool:
        return key[1] in self._lru[key[0]]

    def resident(self, layer: int) -> list[PageKey]:
        """Keys of `layer`, least recently used first."""
        return [(layer, p) for p in self._lru[layer]]

    def __len__(self) -> int:
        return sum(len(d) for d in self._lru)

    def is_pinned(self, key: PageKey) -> bool:
        return key in self._pinned

    # ---- pins ---------------------------------------------------------------------------------
    def set_pins(self, name: str, keys: Iterable[PageKey]) -> None:
        """Replace the pin set called `name` (e.g. "sink", "local", "hot"). A key is pinned while
        any set names it; a pinned key not yet resident is protected once admitted."""
        self._pins[name] = frozenset((int(l), int(p)) for l, p in keys)
        self._pinned = set().union(*self._pins.values())
        self._pinned_per_layer = [0] * self.num_layers
        for layer, _ in self._pinned:
            self._pinned_per_layer[layer] += 1

    def pinned_pages(self, layer: int) -> set[int]:
        """Pages of `layer` pinned, resident or not."""
        return {p for (l, p) in self._pinned if l == layer}

    def pinned_count(self, layer: int) -> int:
        """Keys of `layer` pinned, resident or not (an upper bound of `pinned_resident`, O(1))."""
        return self._pinned_per_layer[layer]

    def pinned_resident(self, layer: int) -> int:
        return sum(1 for p in self._lru[layer] if (layer, p) in self._pinned)

    # ---- admission ----------------------------------------------------------------------------
    def touch(self, key: PageKey) -> bool:
        """Mark a resident key as just used. Returns whether it was resident."""
        lru = self._lru[key[0]]
        if key[1] not in lru:
            return False
        lru.move_to_end(key[1])
        return True

    def touch_many(self, layer: int, pages) -> None:
        """`touch` of several pages of one layer, in order (the last becomes the most recent)."""
        lru = self._lru[layer]
        move = lru.move_to_end
        for p in pages:
            if p in lru:
                move(p)

    def admit(self, key: PageKey, *, protect: frozenset = frozenset()) -> Admission:
        """Make `key` resident: a hit touches it; a miss takes a free slot or evicts the least
        recently used key that is neither pinned nor in `protect`.

        Raises CacheExhausted when every slot of the layer is pinned or protected.
        """
        layer, page = int(key[0]), int(key[1])
        key = (layer, page)
        lru = self._lru[layer]
        slot = lru.get(page)
        if slot is not None:
            lru.move_to_end(page)
            self.hits += 1
            return Admission(key, slot, True)
        self.misses += 1
        evicted = None
        if self._free[layer]:
            slot = self._free[layer].pop()
        else:
            victim = next((p for p in lru if (layer, p) not in self._pinned and (layer, p) not in protect), None)
            if victim is None:
                self.misses -= 1
                raise CacheExhausted(
                    f"layer {layer}: all {self.capacity} device slots hold pinned or in-use pages; cannot admit "
                    f"page {page}. Raise tier.device_pages / device_fraction, lower pin_sink_pages / "
                    f"pin_local_pages / the sparse budget, or raise tier.hot_threshold.")
            slot = lru.pop(victim)
            evicted = (layer, victim)
            self.evictions += 1
        lru[page] = slot
        return Admission(key, slot, False, evicted)

    def ensure(self, keys: Iterable[PageKey]) -> list[Admission]:
        """Admit a working set (e.g. one layer's selected pages for this step): no key of the set
        evicts another. Raises CacheExhausted (leaving earlier admissions in place) when the set
        plus the pinned pages of a layer exceed its slots."""
        keys = list(dict.fromkeys((int(l), int(p)) for l, p in keys))
        protect = frozenset(keys)
        return [self.admit(k, protect=protect) for k in keys]

    def release(self, key: PageKey) -> Optional[int]:
        """Drop `key` (its page was freed); its slot becomes free. Returns the slot, if any."""
        slot = self._lru[key[0]].pop(key[1], None)
        if slot is not None:
            self._free[key[0]].append(slot)
        return slot

    def check(self) -> None:
        """Assert the invariants (tests; O(slots))."""
        for layer in range(self.num_layers):
            used = list(self._lru[layer].values())
            free = self._free[layer]
            assert len(set(used)) == len(used), f"layer {layer}: a slot holds two keys"
            assert not set(used) & set(free), f"layer {layer}: a used slot is also free"
            assert not (set(used) | set(free)) & self.reserved, f"layer {layer}: a reserved slot is in use"
            assert len(used) + len(free) == self.capacity, f"layer {layer}: slots leaked"


class HotZone:
    """Which keys to pin, from a `TierConfig`'s hot-zone settings.

    `fixed(block_tables, lengths)`: the sink pages (first `pin_sink_pages`) and local pages (last
    `pin_local_pages`, the partial page included) of every sequence, in every layer.
    `record(keys)` after each decode step's selection, `end_step()` once per step: a key selected
    in at least `hot_threshold` of the last `hot_window` steps is hot.
    """

    def __init__(self, cfg: TierConfig, num_layers: int):
        self.cfg = cfg
        self.num_layers = num_layers
        self._window: list[frozenset[PageKey]] = []  # the last hot_window steps' selections
        self._counts: dict[PageKey, int] = {}
        self._current: set[PageKey] = set()

    def fixed(self, block_tables, lengths, *, block_size: int) -> set[PageKey]:
        """block_tables int[B, W] (physical page ids, 0 = null), lengths int[B] (tokens) -> keys."""
        keys = set()
        for row, n in zip(block_tables, lengths):
            n_pages = -(-int(n) // block_size)
            logical = set(range(min(self.cfg.pin_sink_pages, n_pages)))
            logical |= set(range(max(0, n_pages - self.cfg.pin_local_pages), n_pages))
            for i in logical:
                page = int(row[i])
                if page != 0:
                    keys.update((layer, page) for layer in range(self.num_layers))
        return keys

    def record(self, keys: Iterable[PageKey]) -> None:
        """Keys selected during the current step (any layer); repeats within a step count once."""
        if self.cfg.hot_threshold == 0:  # no hot zone: nothing to count
            return
        self._current.update((int(l), int(p)) for l, p in keys)

    def end_step(self) -> set[PageKey]:
        """Close the step; return the hot keys (empty when hot_threshold is 0)."""
        if self.cfg.hot_threshold == 0:
            return set()
        step = frozenset(self._current)
        self._current = set()
        self._window.append(step)
        for k in step:
            self._counts[k] = self._counts.get(k, 0) + 1
        if len(self._window) > self.cfg.hot_window:
            for k in self._window.pop(0):
                c = self._counts[k] - 1
                if c:
                    self._counts[k] = c
                else:
                    del self._counts[k]
        return self.hot()

    def hot(self) -> set[PageKey]:
        t = self.cfg.hot_threshold
        return set() if t == 0 else {k for k, c in self._counts.items() if c >= t}
