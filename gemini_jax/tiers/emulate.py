"""Run here with the memory proportions of a machine we do not have.

A hardware tier (conf/hardware/*.yaml) names a reference workload: a model preset and a context
length (e.g. Llama-3.1-8B at 2M tokens). On that machine, the reference's KV splits into what
fits in device memory (after the weights and a reserve), what fits in host RAM (after a
reserve) and the rest on disk. `proportions` computes that split; `cap_engine` gives the run on
this machine a tier configuration with the same split of *its own* pages, so the run moves
pages between tiers the way the real machine would have to. Times measured here are this
machine's; what the tier would take comes from the cost model, labelled as a projection.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gemini_jax.config import EngineConfig, HardwareConfig, ModelConfig, TierConfig, replace
from gemini_jax.errors import ConfigError

GB = 1e9


@dataclass(frozen=True)
class Proportions:
    """How a tier's memory holds its reference workload's KV (fractions sum to 1)."""

    hardware: str
    reference: str
    context: int
    weights_bytes: float  # per model-parallel group: every data replica holds a full copy
    kv_bytes: float
    device_kv_bytes: float  # device memory left for KV, all devices of the mesh
    host_kv_bytes: float
    device_fraction: float
    host_fraction: float
    disk_fraction: float

    def describe(self) -> str:
        return (f"{self.hardware}: {self.reference} at {self.context:,} tokens has {self.kv_bytes / GB:.1f} GB of KV; "
                f"device holds {self.device_fraction:.1%}, host RAM {self.host_fraction:.1%}, "
                f"disk {self.disk_fraction:.1%}")


def proportions(hw: HardwareConfig, ref: ModelConfig, context: int, *, name: str = "") -> Proportions:
    """The device / host / disk split of `ref`'s KV at `context` tokens on `hw` (hw.dtype)."""
    if context < 1:
        raise ConfigError(f"hardware {hw.name!r}: reference_context={context} must be >= 1.")
    itemsize = np.dtype(hw.dtype).itemsize
    devices = hw.mesh.devices
    replicas = hw.mesh.data
    weights = ref.num_params() * itemsize
    kv = 2 * ref.num_layers * ref.num_kv_heads * ref.head_dim * itemsize * context
    device_kv = max(0.0, devices * (hw.device_memory_gb - hw.device_reserve_gb) * GB - replicas * weights)
    host_kv = max(0.0, (hw.host_memory_gb - hw.host_reserve_gb) * GB)
    f_dev = min(1.0, device_kv / kv)
    f_host = min(1.0 - f_dev, host_kv / kv)
    return Proportions(hardware=hw.name, reference=name or ref.family, context=context, weights_bytes=weights,
                       kv_bytes=kv, device_kv_bytes=device_kv, host_kv_bytes=host_kv, device_fraction=f_dev,
                       host_fraction=f_host, disk_fraction=max(0.0, 1.0 - f_dev - f_host))


def min_device_fraction(ecfg: EngineConfig) -> float:
    """The smallest device fraction this engine config can run with: a prefill chunk's pages,
    the pins and (sparse) one step's selection must fit the slots of a layer together."""
    S = ecfg.cache.block_size
    usable = ecfg.num_pages - 1
    need = -(-ecfg.prefill_chunk // S) + 2 + ecfg.tier.pin_sink_pages + ecfg.tier.pin_local_pages
    if ecfg.sparse.enabled:
        need += -(-ecfg.sparse.budget // S)
    return min(1.0, need / usable)


def cap_engine(ecfg: EngineConfig, p: Proportions, *, num_layers: int,
               disk_path: str | None) -> tuple[EngineConfig, dict]:
    """`ecfg` with tiers sized to `p`'s split of this engine's pages (of a model with `num_layers`
    layers: the host tier is bounded in (layer, page) units), and a record of what was set.

    The device fraction is raised to `min_device_fraction` when the tier's share is smaller
    than one call's working set (recorded as `raised_from`). A disk share needs `disk_path`.
    """
    if ecfg.cache.kind != "paged":
        raise ConfigError(f"hardware {p.hardware!r} is emulated through tiers, which need cache.kind='paged'.")
    usable = ecfg.num_pages - 1
    # A smaller prefill chunk is exact and shrinks one call's working set; the budget cannot shrink.
    S, chunk = ecfg.cache.block_size, ecfg.prefill_chunk
    while chunk > S and min_device_fraction(replace(ecfg, prefill_chunk=chunk)) > p.device_fraction:
        chunk //= 2
    chunk_from = ecfg.prefill_chunk if chunk != ecfg.prefill_chunk else None
    ecfg = replace(ecfg, prefill_chunk=chunk)
    floor = min_device_fraction(ecfg)
    dev = max(p.device_fraction, floor)
    rec = {"prefill_chunk": chunk, "prefill_chunk_from": chunk_from, "hardware": p.hardware, "reference": p.reference, "context": p.context,
           "tier_device_fraction": p.device_fraction, "tier_host_fraction": p.host_fraction,
           "tier_disk_fraction": p.disk_fraction, "device_fraction": dev,
           "raised_from": p.device_fraction if dev > p.device_fraction else None}
    if dev >= 1.0:
        rec.update(host_pages=None, disk_path=None)
        return replace(ecfg, tier=TierConfig()), rec  # everything fits on the device: no tiers
    on_disk = p.disk_fraction > 0 and dev + p.host_fraction < 1.0
    if on_disk and not disk_path:
        raise ConfigError(f"hardware {p.hardware!r} keeps {p.disk_fraction:.0%} of the KV on disk: give a disk path "
                          f"(engine.tier.disk_path) for the emulated run.")
    tc = ecfg.tier
    host_pages = None
    if on_disk:
        host_pages = max(1, int(p.host_fraction * usable * num_layers))
    tier = replace(tc, enabled=True, device_pages=None, device_fraction=dev, host_pages=host_pages,
                   disk_path=disk_path if on_disk else None)
    rec.update(host_pages=host_pages, disk_path=tier.disk_path)
    return replace(ecfg, tier=tier), rec

