"""`TierConfig`: where KV pages live (device slots, host RAM, disk) and how they move.

Frozen and hashable like every config in `gemini_jax.config`, validated once at construction;
errors name the field, the value and what is allowed. The Hydra presets are `conf/tier/*.yaml`
(`# @package engine.tier`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

from gemini_jax.errors import ConfigError

WRITE_POLICIES = ("write_through", "write_back")
DISK_LAYOUTS = ("chunked", "sharded")
ON_CORRUPT = ("raise", "recompute")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


@dataclass(frozen=True, kw_only=True)
class TierConfig:
    """Tiers below the device page pool.

    Device budget: `device_pages` slots per layer, or `device_fraction` of the pool's pages; both
    None means every page stays on device (no tiering). `host_pages` bounds the host RAM tier in
    (layer, page) units (None = unbounded); when it is full the least recently used page moves to
    disk (`disk_path`; None = no disk tier, and a full host tier is `CacheExhausted`).

    `write_policy`: "write_through" sends every filled page down to disk asynchronously as soon as
    it is written (a host eviction then costs nothing); "write_back" writes a page to disk only
    when the host tier evicts it. `disk_layout`: "chunked" stores one zarr3 chunk (one file) per
    (layer, page); "sharded" packs `shard_pages` pages of a layer into one file with zarr3's
    `sharding_indexed` codec. `disk_fsync` makes every page durable before its checksum is
    committed (survives power loss; a killed process is safe either way).

    `prefetch_depth`: how many layers ahead the predictor starts fetches (0 = no prefetch);
    `staging_pages`: size of the prefetch staging buffer; `io_workers`: threads issuing reads.

    Hot zone: the first `pin_sink_pages` and last `pin_local_pages` pages of every sequence are
    pinned on device; a page selected in at least `hot_threshold` of the last `hot_window` decode
    steps (per layer) is pinned too (`hot_threshold` 0 = off).
    """

    enabled: bool = False
    device_pages: Optional[int] = None
    device_fraction: Optional[float] = None
    host_pages: Optional[int] = None
    disk_path: Optional[str] = None
    write_policy: str = "write_through"
    disk_layout: str = "chunked"
    shard_pages: int = 64
    disk_fsync: bool = False
    on_corrupt: str = "raise"
    prefetch_depth: int = 1
    staging_pages: int = 256
    io_workers: int = 4
    pin_sink_pages: int = 1
    pin_local_pages: int = 2
    hot_threshold: int = 0
    hot_window: int = 32

    def __post_init__(self):
        dp, df = self.device_pages, self.device_fraction
        _require(dp is None or (_is_int(dp) and dp >= 1),
                 f"tier.device_pages={dp!r} must be None (the whole pool) or an integer >= 1.")
        _require(df is None or (isinstance(df, (int, float)) and not isinstance(df, bool) and 0 < df <= 1),
                 f"tier.device_fraction={df!r} must be None or a number in (0, 1].")
        _require(dp is None or df is None,
                 f"tier.device_pages={dp} and tier.device_fraction={df} are both set; set one of them.")
        hp = self.host_pages
        _require(hp is None or (_is_int(hp) and hp >= 1),
                 f"tier.host_pages={hp!r} must be None (unbounded) or an integer >= 1.")
        _require(self.disk_path is None or (isinstance(self.disk_path, str) and self.disk_path.strip() != ""),
                 f"tier.disk_path={self.disk_path!r} must be None (no disk tier) or a non-empty path.")
        _require(self.write_policy in WRITE_POLICIES,
                 f"tier.write_policy={self.write_policy!r} must be one of {WRITE_POLICIES}.")
        _require(self.disk_layout in DISK_LAYOUTS,
                 f"tier.disk_layout={self.disk_layout!r} must be one of {DISK_LAYOUTS}.")
        _require(self.on_corrupt in ON_CORRUPT,
                 f"tier.on_corrupt={self.on_corrupt!r} must be one of {ON_CORRUPT}.")
        for name in ("shard_pages", "staging_pages", "io_workers", "hot_window"):
            v = getattr(self, name)
            _require(_is_int(v) and v >= 1, f"tier.{name}={v!r} must be an integer >= 1.")
        for name in ("prefetch_depth", "pin_sink_pages", "pin_local_pages", "hot_threshold"):
            v = getattr(self, name)
            _require(_is_int(v) and v >= 0, f"tier.{name}={v!r} must be an integer >= 0.")
        _require(self.hot_threshold <= self.hot_window,
                 f"tier.hot_threshold={self.hot_threshold} can never be reached within "
                 f"tier.hot_window={self.hot_window} steps; lower it or widen the window.")

    def device_slots(self, pool_pages: int) -> int:
        """Device slots per layer for a pool of `pool_pages` pages (page 0, the null page, included).

        Raises ConfigError when the budget exceeds the pool.
        """
        usable = pool_pages - 1
        if self.device_pages is not None:
            _require(self.device_pages <= usable,
                     f"tier.device_pages={self.device_pages} exceeds the pool's {usable} usable pages.")
            return self.device_pages
        if self.device_fraction is not None:
            return max(1, int(usable * self.device_fraction))
        return usable
