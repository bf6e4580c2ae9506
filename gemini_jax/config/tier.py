"""Tiers below the device pool and the links pages cross (`TierConfig`, `LinkConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from gemini_jax.config.base import is_int, nested, require

WritePolicy = Literal["write_through", "write_back"]
WRITE_POLICIES = get_args(WritePolicy)
DiskLayout = Literal["chunked", "sharded"]
DISK_LAYOUTS = get_args(DiskLayout)
OnCorrupt = Literal["raise", "recompute"]
ON_CORRUPT = get_args(OnCorrupt)
LinkMode = Literal["real", "emulate"]
LINK_MODES = get_args(LinkMode)


@dataclass(frozen=True, kw_only=True)
class LinkConfig:
    """The links pages cross on their way to the device, for `tier.link="emulate"`.

    Each hop is a pipe of `*_gbs` GB/s that transfers share in issue order, with at most
    `queue_depth` transfers in flight and `*_latency_us` paid by each (after its bytes); a disk
    transfer also takes at least its 4 KiB reads / `disk_iops`. A page from disk crosses the disk
    hop, then the host link. Defaults: PCIe 4.0 x16 (~25 GB/s) and a PCIe 4.0 NVMe drive.
    `time_scale` multiplies every modeled time: a machine that computes a step N times slower
    than the hardware it stands for sees its transfers N times slower too, so the overlap of
    transfers and compute is the hardware's (`gemini_jax.tiers.link.scale_for`).
    """

    host_gbs: float = 25.0
    host_latency_us: float = 10.0
    disk_gbs: float = 7.0
    disk_iops: float = 1_000_000.0
    disk_latency_us: float = 80.0
    queue_depth: int = 8
    time_scale: float = 1.0
    page_bytes: Optional[int] = None  # bytes a page is timed as (None: its own; another model's page when emulating it)

    def __post_init__(self):
        require(self.page_bytes is None or (is_int(self.page_bytes) and self.page_bytes >= 1),
                 f"tier.link_model.page_bytes={self.page_bytes!r} must be None or an integer >= 1.")
        for name in ("host_gbs", "disk_gbs", "disk_iops", "time_scale"):
            v = getattr(self, name)
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                     f"tier.link_model.{name}={v!r} must be a number > 0.")
        for name in ("host_latency_us", "disk_latency_us"):
            v = getattr(self, name)
            require(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                     f"tier.link_model.{name}={v!r} must be a number >= 0.")
        require(is_int(self.queue_depth) and self.queue_depth >= 1,
                 f"tier.link_model.queue_depth={self.queue_depth!r} must be an integer >= 1.")


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
    `lookahead`: during a sparse decode step, layer l also scores layer l+depth's digests with a
    query built from layer l's input (the residual stream changes little from layer to layer),
    and the next step's layer 0 is scored from the embedding of this step's most likely token,
    so pages a step selects for the first time are fetched before they are needed. The guess
    is rough, so it fetches the top `lookahead` x budget pages (0 = off: the previous step's
    selection only). Costs one extra projection and scoring per layer; never changes numbers.
    `staging_pages`: size of the prefetch staging buffer (pages; with lookahead 3 at 16K context
    a buffer of 512 dropped guesses before their layer ran: bench hit rate 66 % vs 84 % with 2048);
    `io_workers`: threads issuing reads.

    `fused_decode`: run a sparse decode step as one device program (the layer loop on device,
    the host called back only for pages not in their slots; `gemini_jax.tiers.fused`) when the
    step allows it (no dense layers, no mesh, one layer's selection fits the slots); False runs
    every step layer by layer from the host. Never changes numbers.

    `link`: "real" — a fetched page is there when its copy is done (on this machine, a copy on
    the cores that also compute); "emulate" — it lands when `link_model` (bandwidth, latency,
    queue depth, disk IOPS of each hop) says it would, the wait spent asleep, so transfers and
    compute overlap as across a real link. Prefetch hits count pages that had landed when their
    layer needed them.

    `persistent`: the full pages of every prompt also go, with all their layers and digests, to
    a store under `disk_path` keyed by (model and weights fingerprint, KV layout, chained block
    hash) that outlives the engine (`gemini_jax.tiers.prefix_store`); a later engine, in any
    process, on the same `disk_path` loads a prompt's stored prefix instead of prefilling it
    (counted in `prefill_tokens_reused`). Another model, weights, dtype, block size or sparse
    setting never matches. Works for every paged engine, over tiers or not.

    `on_corrupt`: what a page below the device that fails verification does: "raise" stops the
    call with `IntegrityError`; "recompute" rebuilds the page by replaying the calls that wrote
    it (`gemini_jax.tiers.write_log`) and runs the call again (counter `pages_recomputed`).

    Hot zone: the first `pin_sink_pages` and last `pin_local_pages` pages of every sequence are
    pinned on device; a page selected in at least `hot_threshold` of the last `hot_window` decode
    steps (per layer) is pinned too (`hot_threshold` 0 = off).
    """

    enabled: bool = False
    device_pages: Optional[int] = None
    device_fraction: Optional[float] = None
    host_pages: Optional[int] = None
    disk_path: Optional[str] = None
    write_policy: WritePolicy = "write_through"
    disk_layout: DiskLayout = "chunked"
    shard_pages: int = 64
    disk_fsync: bool = False
    on_corrupt: OnCorrupt = "raise"
    prefetch_depth: int = 1
    lookahead: int = 3
    staging_pages: int = 2048
    io_workers: int = 4
    pin_sink_pages: int = 1
    pin_local_pages: int = 2
    hot_threshold: int = 0
    hot_window: int = 32
    fused_decode: bool = True
    link: LinkMode = "real"
    link_model: LinkConfig = field(default_factory=LinkConfig)
    persistent: bool = False

    def __post_init__(self):
        nested(self, "link_model", LinkConfig)
        require(self.link in LINK_MODES, f"tier.link={self.link!r} must be one of {LINK_MODES}.")
        require(isinstance(self.persistent, bool), f"tier.persistent={self.persistent!r} must be true or false.")
        require(not self.persistent or self.disk_path is not None,
                 "tier.persistent=true keeps prompt pages on disk for later engines: set tier.disk_path.")
        dp, df = self.device_pages, self.device_fraction
        require(dp is None or (is_int(dp) and dp >= 1),
                 f"tier.device_pages={dp!r} must be None (the whole pool) or an integer >= 1.")
        require(df is None or (isinstance(df, (int, float)) and not isinstance(df, bool) and 0 < df <= 1),
                 f"tier.device_fraction={df!r} must be None or a number in (0, 1].")
        require(dp is None or df is None,
                 f"tier.device_pages={dp} and tier.device_fraction={df} are both set; set one of them.")
        hp = self.host_pages
        require(hp is None or (is_int(hp) and hp >= 1),
                 f"tier.host_pages={hp!r} must be None (unbounded) or an integer >= 1.")
        require(self.disk_path is None or (isinstance(self.disk_path, str) and self.disk_path.strip() != ""),
                 f"tier.disk_path={self.disk_path!r} must be None (no disk tier) or a non-empty path.")
        require(self.write_policy in WRITE_POLICIES,
                 f"tier.write_policy={self.write_policy!r} must be one of {WRITE_POLICIES}.")
        require(self.disk_layout in DISK_LAYOUTS,
                 f"tier.disk_layout={self.disk_layout!r} must be one of {DISK_LAYOUTS}.")
        require(self.on_corrupt in ON_CORRUPT,
                 f"tier.on_corrupt={self.on_corrupt!r} must be one of {ON_CORRUPT}.")
        require(isinstance(self.fused_decode, bool), f"tier.fused_decode={self.fused_decode!r} must be true or false.")
        for name in ("shard_pages", "staging_pages", "io_workers", "hot_window"):
            v = getattr(self, name)
            require(is_int(v) and v >= 1, f"tier.{name}={v!r} must be an integer >= 1.")
        for name in ("prefetch_depth", "lookahead", "pin_sink_pages", "pin_local_pages", "hot_threshold"):
            v = getattr(self, name)
            require(is_int(v) and v >= 0, f"tier.{name}={v!r} must be an integer >= 0.")
        require(self.hot_threshold <= self.hot_window,
                 f"tier.hot_threshold={self.hot_threshold} can never be reached within "
                 f"tier.hot_window={self.hot_window} steps; lower it or widen the window.")

    def device_slots(self, pool_pages: int) -> int:
        """Device slots per layer for a pool of `pool_pages` pages (page 0, the null page, included).

        Raises ConfigError when the budget exceeds the pool.
        """
        usable = pool_pages - 1
        if self.device_pages is not None:
            require(self.device_pages <= usable,
                     f"tier.device_pages={self.device_pages} exceeds the pool's {usable} usable pages.")
            return self.device_pages
        if self.device_fraction is not None:
            return max(1, int(usable * self.device_fraction))
        return usable
