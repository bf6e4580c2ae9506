"""KV pages below the device: host RAM and disk stores, device-slot residency, predictive
prefetch, and a cost model that projects counted transfers onto hardware tiers (docs/architecture.md §8).

    spec  = PageSpec(num_layers=L, num_pages=P, kv_heads=K, block_size=S, head_dim=D, dtype="bfloat16")
    stack = TierStack(spec, TierConfig(enabled=True, host_pages=4096, disk_path="/nvme/kv"))
    stack.put((layer, page), k, v)                 # a full page goes down the tiers
    slots = DeviceSlots(L, cfg.device_slots(P))    # which (layer, page) sits in which device slot
    pre   = Prefetcher(stack, capacity=cfg.staging_pages, workers=cfg.io_workers)
    page  = pre.get((layer, page))                 # staged hit, or a timed synchronous miss
    store = TieredStore(model_cfg, engine_cfg, dtype)  # the engine's KV store over all of the above
"""

from gemini_jax.config import TierConfig
from gemini_jax.tiers.cost_model import RunCounters, measure_disk, project, project_all
from gemini_jax.tiers.errors import IncompletePage, PageMissing, TierError
from gemini_jax.tiers.kv_store import TieredStore
from gemini_jax.tiers.observe import SelectionObserver
from gemini_jax.tiers.page import PageKey, PageSpec, page_digest
from gemini_jax.tiers.prefetch import Predictor, Prefetcher
from gemini_jax.tiers.residency import Admission, DeviceSlots, HotZone
from gemini_jax.tiers.sharded import ShardedTierStack
from gemini_jax.tiers.stack import Fetched, TierStack
from gemini_jax.tiers.stores import DiskOptions, DiskStore, HostStore

__all__ = [
    "TieredStore",
    "Admission", "DeviceSlots", "DiskOptions", "DiskStore", "Fetched", "HostStore", "HotZone", "IncompletePage",
    "PageKey", "PageMissing", "PageSpec", "Predictor", "Prefetcher", "RunCounters", "SelectionObserver", "ShardedTierStack", "TierConfig",
    "TierError", "TierStack", "measure_disk", "page_digest", "project", "project_all",
]
