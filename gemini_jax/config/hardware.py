"""Machines: the device mesh (`MeshConfig`) and hardware tiers for the cost model (`HardwareConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Optional

from gemini_jax.config.base import is_int, nested, require
from gemini_jax.config.model import DTYPES, Dtype


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """A (data, model) device mesh: batches go over `data`, attention heads and MLP columns over
    `model` (1 x 1: one device, no sharding)."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for name in ("data", "model"):
            value = getattr(self, name)
            require(is_int(value) and value >= 1, f"mesh.{name}={value!r} must be an integer >= 1.")

    @property
    def devices(self) -> int:
        return self.data * self.model



@dataclass(frozen=True, kw_only=True)
class HardwareConfig:
    """A machine tier. Numbers are nominal vendor figures (bandwidths in GB/s, IOPS for 4 KiB
    random reads), used by the cost model to project; `measured` tiers fill them at run time."""

    name: str
    device_memory_gb: float
    host_memory_gb: float
    device_bandwidth_gbs: Optional[float] = None  # None: measure on this machine
    host_link_gbs: Optional[float] = None
    disk_read_gbs: Optional[float] = None
    disk_iops: Optional[float] = None
    dtype: Dtype = "bfloat16"
    mesh: MeshConfig = field(default_factory=MeshConfig)
    present: bool = False  # True only for the tier that describes the machine we run on
    notes: str = ""
    # Emulation on a machine without this hardware (gemini_jax.tiers.emulate): the reference
    # workload whose KV split (device / host / disk) a run here copies; None = no emulation.
    reference_model: Optional[str] = None  # a conf/model preset, e.g. llama3_1_8b
    reference_context: int = 2097152
    device_reserve_gb: float = 2.0  # per device: activations, workspace, the runtime
    host_reserve_gb: float = 16.0  # the OS, the process, pinned staging

    def __post_init__(self):
        nested(self, "mesh", MeshConfig)
        require(self.device_memory_gb > 0, f"device_memory_gb={self.device_memory_gb} must be > 0.")
        require(self.host_memory_gb > 0, f"host_memory_gb={self.host_memory_gb} must be > 0.")
        require(self.dtype in DTYPES, f"hardware dtype={self.dtype!r} must be one of {DTYPES}.")
        require(is_int(self.reference_context) and self.reference_context >= 1,
                 f"hardware reference_context={self.reference_context!r} must be an integer >= 1.")
        require(0 <= self.device_reserve_gb <= self.device_memory_gb,
                 f"hardware device_reserve_gb={self.device_reserve_gb} must be in [0, device_memory_gb="
                 f"{self.device_memory_gb}].")
        require(0 <= self.host_reserve_gb <= self.host_memory_gb,
                 f"hardware host_reserve_gb={self.host_reserve_gb} must be in [0, host_memory_gb={self.host_memory_gb}].")
