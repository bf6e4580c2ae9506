"""Projected step times per hardware tier from a run's counted transfers, and a disk probe.

A CPU run counts what a decode step moves (KV bytes read on device, pages fetched from host and
disk, prefetch hits); `project` turns those counts into times on a `HardwareConfig`'s nominal
bandwidths. Every number it returns is a *projection* (keys `projected_*`, `label="projection"`),
never a measurement; `measure_disk` measures this machine (`label="measured"`).

Model per decode step (bandwidths in GB/s = 1e9 B/s, IOPS of 4 KiB random reads):
  device   = device_bytes / device_bandwidth
  host     = host_pages * page_bytes / host_link
  disk     = disk_pages * (max(page_bytes / disk_read, ios_per_page / disk_iops) + page_bytes / host_link)
  exposed  = (1 - hit) * (host + disk) + max(0, hit * (host + disk) - device)
  step     = device + exposed
Prefetch hides a hit's transfer only behind device time; misses are stalls. A *cold fetch* is the
disk reads one step waits for; its latency is IOPS-bound, which gives the IOPS below which it
exceeds 5 ms (the write-up claims ~800K: here that figure is computed from this run's fetch size).
"""

from __future__ import annotations

import os
import time
from dataclasses import dataclass
from typing import Optional

import numpy as np
import tensorstore as ts

from gemini_jax.config import HardwareConfig
from gemini_jax.errors import ConfigError

IO_BYTES = 4096  # the unit random-read IOPS figures are quoted in
CLAIMED_IOPS_THRESHOLD = 800_000  # the write-up's claim, reported beside our computed figure
COLD_FETCH_BUDGET_S = 0.005


@dataclass(frozen=True, kw_only=True)
class RunCounters:
    """What a run moved, in total over `decode_steps` steps (engine counters + page size).

    `other_device_bytes_per_step`: device bytes a step reads besides KV (the weights, for
    memory-bound decoding); 0 projects attention's KV traffic alone.
    """

    decode_steps: int
    kv_bytes_read: int
    pages_fetched_host: int = 0
    pages_fetched_disk: int = 0
    page_bytes: int
    prefetch_hits: int = 0
    prefetch_misses: int = 0
    other_device_bytes_per_step: int = 0

    def __post_init__(self):
        if self.decode_steps < 1:
            raise ConfigError(f"decode_steps={self.decode_steps} must be >= 1 to project a step.")
        for name in ("kv_bytes_read", "pages_fetched_host", "pages_fetched_disk", "prefetch_hits",
                     "prefetch_misses", "other_device_bytes_per_step"):
            if getattr(self, name) < 0:
                raise ConfigError(f"{name}={getattr(self, name)} must be >= 0.")
        if self.page_bytes < 1:
            raise ConfigError(f"page_bytes={self.page_bytes} must be >= 1.")

    @classmethod
    def from_stats(cls, stats: dict, *, page_bytes: int, **extra) -> "RunCounters":
        """From an engine's counter dict (docs/architecture.md §5 names)."""
        keys = ("decode_steps", "kv_bytes_read", "pages_fetched_host", "pages_fetched_disk",
                "prefetch_hits", "prefetch_misses")
        return cls(**{k: int(stats.get(k, 0)) for k in keys}, page_bytes=page_bytes, **extra)

    @property
    def hit_rate(self) -> float:
        n = self.prefetch_hits + self.prefetch_misses
        return self.prefetch_hits / n if n else 0.0


def _figure(hw: HardwareConfig, name: str, measured: Optional[dict]) -> float:
    v = getattr(hw, name)
    if v is None and measured is not None:
        v = measured.get(name)
    if v is None or v <= 0:
        raise ConfigError(f"hardware {hw.name!r}: {name}={v!r} is needed to project; give the tier a "
                          f"nominal figure or pass measured={{'{name}': ...}} (e.g. from measure_disk).")
    return float(v)


def project(run: RunCounters, hw: HardwareConfig, *, measured: Optional[dict] = None) -> dict:
    """Projected per-step times (seconds) and rates of `run` on `hw`.

    `measured` fills figures the tier leaves None (the `cpu` tier): keys device_bandwidth_gbs,
    host_link_gbs, disk_read_gbs, disk_iops. Raises ConfigError naming a figure that is needed
    and missing (disk figures are needed only when the run fetched from disk).
    """
    n = run.decode_steps
    dev_bw = _figure(hw, "device_bandwidth_gbs", measured) * 1e9
    device_bytes = run.kv_bytes_read / n + run.other_device_bytes_per_step
    device_s = device_bytes / dev_bw
    host_pages, disk_pages = run.pages_fetched_host / n, run.pages_fetched_disk / n
    link = _figure(hw, "host_link_gbs", measured) * 1e9 if (host_pages or disk_pages) else float("inf")
    host_s = host_pages * run.page_bytes / link
    ios_per_page = -(-run.page_bytes // IO_BYTES)
    disk_s = cold_s = 0.0
    iops_for_budget = 0.0
    if disk_pages:
        disk_bw = _figure(hw, "disk_read_gbs", measured) * 1e9
        iops = _figure(hw, "disk_iops", measured)
        read_one = max(run.page_bytes / disk_bw, ios_per_page / iops)
        disk_s = disk_pages * (read_one + run.page_bytes / link)
        cold_s = disk_pages * read_one
        # IOPS at which the IOPS-bound part of one step's cold fetch takes exactly the budget.
        iops_for_budget = disk_pages * ios_per_page / COLD_FETCH_BUDGET_S
    transfer = host_s + disk_s
    hit = run.hit_rate
    exposed = (1 - hit) * transfer + max(0.0, hit * transfer - device_s)
    step = device_s + exposed
    return {
        "label": "projection",
        "hardware": hw.name,
        "projected_step_seconds": step,
        "projected_tokens_per_second": 1.0 / step if step > 0 else float("inf"),
        "projected_device_seconds": device_s,
        "projected_host_fetch_seconds": host_s,
        "projected_disk_fetch_seconds": disk_s,
        "projected_stall_seconds": exposed,
        "projected_cold_fetch_seconds": cold_s,
        "projected_iops_for_5ms_cold_fetch": iops_for_budget,
        "projected_cold_fetch_exceeds_5ms": cold_s > COLD_FETCH_BUDGET_S,
        "claimed_iops_threshold": CLAIMED_IOPS_THRESHOLD,  # the write-up's figure, not ours
        "inputs": {"device_bytes_per_step": device_bytes, "host_pages_per_step": host_pages,
                   "disk_pages_per_step": disk_pages, "page_bytes": run.page_bytes,
                   "ios_per_page": ios_per_page, "prefetch_hit_rate": hit},
    }


def project_all(run: RunCounters, tiers: list[HardwareConfig], *, measured: Optional[dict] = None) -> list[dict]:
    """`project` on each tier; a tier missing a needed figure yields {"hardware", "label", "error"}."""
    out = []
    for hw in tiers:
        try:
            out.append(project(run, hw, measured=measured))
        except ConfigError as e:
            out.append({"label": "projection", "hardware": hw.name, "error": str(e)})
    return out


def _drop_cache(path: str) -> bool:
    """Ask the kernel to drop this file's cached pages (only this file; others are untouched)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return False
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        return True
    except (OSError, AttributeError):
        return False
    finally:
        os.close(fd)


def measure_disk(path: str, *, file_mb: int = 64, io_bytes: int = IO_BYTES, seconds: float = 1.0,
                 queue_depth: int = 32, seed: int = 0) -> dict:
    """Measure sequential read bandwidth and random-read IOPS of the file system at `path`, through
    tensorstore's file kvstore (the disk tier's I/O path). Writes one `file_mb` file, reads it
    whole, then issues `io_bytes` reads at random aligned offsets, `queue_depth` at a time, for
    about `seconds`; deletes the file. The file's page cache is dropped first (posix_fadvise);
    when that fails the figures include cache hits and `cache_dropped` says so.
    """
    os.makedirs(path, exist_ok=True)
    store = ts.KvStore.open({"driver": "file", "path": os.path.abspath(path) + "/"}).result()
    key = "gj_measure_disk.bin"
    fname = os.path.join(path, key)
    size = file_mb * 2**20
    rng = np.random.default_rng(seed)
    store.write(key, rng.integers(0, 256, size, dtype=np.uint8).tobytes()).result()
    try:
        dropped = _drop_cache(fname)
        t0 = time.perf_counter()
        got = store.read(key).result().value
        seq_s = time.perf_counter() - t0
        assert len(got) == size
        dropped = _drop_cache(fname) and dropped
        n_blocks = size // io_bytes
        done, t0 = 0, time.perf_counter()
        while time.perf_counter() - t0 < seconds:
            offs = rng.integers(0, n_blocks, queue_depth) * io_bytes
            futs = [store.read(key, byte_range=slice(int(o), int(o) + io_bytes)) for o in offs]
            for f in futs:
                f.result()
            done += queue_depth
        rand_s = time.perf_counter() - t0
    finally:
        store.delete_range(ts.KvStore.KeyRange(key, key + "\0")).result()
    return {"label": "measured", "path": os.path.abspath(path), "disk_read_gbs": size / seq_s / 1e9,
            "disk_iops": done / rand_s, "io_bytes": io_bytes, "queue_depth": queue_depth,
            "file_bytes": size, "cache_dropped": dropped}
