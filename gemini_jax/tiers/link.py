"""Emulated links between the tiers: when a transfer of pages would land across a real link.

On a machine whose "device" is its own CPU, a page fetched from host RAM is a memory copy on the
same cores that run the step, so no measurement here says whether a PCIe link would hide it
behind compute. With `tier.link="emulate"` the prefetcher still reads the pages (real bytes,
verified), but a page counts as arrived only at the time this model gives, and a step that needs
it earlier sleeps until then (the wait costs no CPU, as waiting on a DMA does not).

Model of one hop (`Hop`): a pipe shared by transfers in issue order (FIFO), at most
`queue_depth` in flight; transfer i issued at t:

    issue  = t, or the landing of the transfer `queue_depth` back if that is later
    start  = max(issue, when the pipe finished the previous transfer's bytes)
    busy   = max(bytes / bandwidth, ios / iops) x time_scale      (ios: 4 KiB reads; disk only)
    lands  = start + busy + latency x time_scale

A page from host RAM crosses the host link; a page from disk crosses the disk hop, then the
host link (issued when it has left the disk).
"""

from __future__ import annotations

import threading
from collections import deque

from gemini_jax.config import HardwareConfig, LinkConfig, ModelConfig, replace
from gemini_jax.errors import ConfigError

IO_BYTES = 4096  # the unit random-read IOPS figures are quoted in
PCIE_GBS = {4: 25.0, 5: 50.0}  # x16, per direction, after encoding (nominal)


class Hop:
    """One link's timeline (thread-safe). Times are `time.perf_counter()` seconds."""

    def __init__(self, gbs: float, latency_s: float, queue_depth: int, *, iops: float | None = None,
                 scale: float = 1.0):
        self.bps = gbs * 1e9
        self.latency = latency_s * scale
        self.queue_depth = queue_depth
        self.iops = iops
        self.scale = scale
        self._pipe_free = 0.0
        self._landings: deque[float] = deque()  # of the last `queue_depth` transfers, in issue order
        self._lock = threading.Lock()

    def busy_seconds(self, nbytes: int) -> float:
        """Time the pipe spends on a transfer of `nbytes` (bandwidth- or IOPS-bound), scaled."""
        t = nbytes / self.bps
        if self.iops is not None:
            t = max(t, -(-nbytes // IO_BYTES) / self.iops)
        return t * self.scale

    def submit(self, nbytes: int, now: float) -> float:
        """Issue a transfer of `nbytes` at `now`; returns when it lands."""
        with self._lock:
            issue = now
            if len(self._landings) >= self.queue_depth:
                issue = max(issue, self._landings[0])  # waits for the transfer queue_depth back
            start = max(issue, self._pipe_free)
            self._pipe_free = start + self.busy_seconds(nbytes)
            land = self._pipe_free + self.latency
            self._landings.append(land)
            if len(self._landings) > self.queue_depth:
                self._landings.popleft()
            return land


class Links:
    """The hops pages cross to the device, built from a `LinkConfig`, for pages of `page_bytes`."""

    def __init__(self, cfg: LinkConfig, page_bytes: int):
        self.cfg, self.page_bytes = cfg, cfg.page_bytes or page_bytes
        s = cfg.time_scale
        self.host = Hop(cfg.host_gbs, cfg.host_latency_us * 1e-6, cfg.queue_depth, scale=s)
        self.disk = Hop(cfg.disk_gbs, cfg.disk_latency_us * 1e-6, cfg.queue_depth, iops=cfg.disk_iops, scale=s)

    def transfer(self, host_pages: int, disk_pages: int, now: float) -> float:
        """One transfer of pages issued at `now`; returns when the last of them lands on device.
        The host-RAM pages and the disk pages go as one transfer each."""
        land = now
        if disk_pages:
            left_disk = self.disk.submit(disk_pages * self.page_bytes, now)
            land = max(land, self.host.submit(disk_pages * self.page_bytes, left_disk))
        if host_pages:
            land = max(land, self.host.submit(host_pages * self.page_bytes, now))
        return land


def link_for(hw: HardwareConfig, *, pcie: int | None = None, time_scale: float = 1.0, **over) -> LinkConfig:
    """The links of hardware tier `hw`: its host link (or PCIe generation `pcie`: 4 or 5, x16)
    and its disk figures; `over` sets the other `LinkConfig` fields."""
    if pcie is not None and pcie not in PCIE_GBS:
        raise ConfigError(f"pcie={pcie!r} must be one of {sorted(PCIE_GBS)} (x16 links).")
    host = PCIE_GBS[pcie] if pcie is not None else hw.host_link_gbs
    if host is None:
        raise ConfigError(f"hardware {hw.name!r} has no host_link_gbs: give pcie=4 or 5.")
    cfg = LinkConfig(host_gbs=float(host), time_scale=float(time_scale), **over)
    if hw.disk_read_gbs is not None:
        cfg = replace(cfg, disk_gbs=float(hw.disk_read_gbs))
    if hw.disk_iops is not None:
        cfg = replace(cfg, disk_iops=float(hw.disk_iops))
    return cfg


def scale_for(step_seconds_here: float, step_seconds_there: float) -> float:
    """The time scale that makes transfers here overlap a step as they would on the emulated
    hardware: how many times slower this machine computes the same step."""
    if not (step_seconds_here > 0 and step_seconds_there > 0):
        raise ConfigError(f"step times {step_seconds_here!r} (here) and {step_seconds_there!r} (there) must be > 0.")
    return step_seconds_here / step_seconds_there


def matched_link(hw: HardwareConfig, ref: ModelConfig, *, pcie: int | None, layer_seconds_here: float,
                 block_size: int) -> tuple[LinkConfig, dict]:
    """Links that stand, here, for `hw` running its reference model `ref`: a page is timed as one
    of `ref`'s pages (its kv heads x `block_size` x head_dim, k and v, in hw.dtype), and every
    time is scaled by (one layer of a decode step here) / (one layer of `ref`'s decode step on
    `hw`, weights-bound: parameter bytes / device bandwidth / layers). A page then costs, beside
    a layer here, what `ref`'s page costs beside `ref`'s layer there. -> (link, what was used)."""
    if not hw.device_bandwidth_gbs:
        raise ConfigError(f"hardware {hw.name!r} has no device_bandwidth_gbs to time its reference step.")
    itemsize = {"float32": 4, "bfloat16": 2, "float16": 2}[hw.dtype]
    ref_page = 2 * ref.num_kv_heads * block_size * ref.head_dim * itemsize
    ref_step = ref.num_params() * itemsize / (hw.device_bandwidth_gbs * 1e9)
    scale = scale_for(layer_seconds_here, ref_step / ref.num_layers)
    link = link_for(hw, pcie=pcie, time_scale=scale, page_bytes=ref_page)
    return link, {"reference_page_bytes": ref_page, "reference_step_seconds": ref_step,
                  "reference_layers": ref.num_layers, "time_scale": scale, "host_gbs": link.host_gbs}
