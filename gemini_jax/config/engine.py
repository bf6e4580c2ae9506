"""How the engine runs a model (`EngineConfig`): limits, chunking, and the concerns it nests."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from gemini_jax.config import compat
from gemini_jax.config.base import nested, require
from gemini_jax.config.cache import CacheConfig
from gemini_jax.config.hardware import MeshConfig
from gemini_jax.config.sparse import SparseConfig
from gemini_jax.config.tier import TierConfig

AttentionImpl = Literal["xla", "pallas"]
KernelPlatform = Literal["tpu", "gpu"]
LayerWeights = Literal["per_layer", "stacked"]


@dataclass(frozen=True, kw_only=True)
class EngineConfig:
    """How the engine runs a model: sequence limits, prefill chunking, cache, attention path.

    attention_impl "xla" is the portable path (fast on CPU); "pallas" runs decode attention
    through the Pallas kernels (compiled on GPU/TPU, interpret mode on CPU: slow, for tests).
    kernel_platform picks the kernels' variant: None follows the backend (Triton kernels on a
    GPU, the TPU kernels on TPU and, in interpret mode, on CPU); "gpu" / "tpu" force one (e.g.
    "gpu" on CPU checks the GPU kernels in interpret mode).

    decode_steps_per_call: decode tokens per device program (`gemini_jax.runtime.multistep`):
    sampling, EOS / max-token stops and counters run on device, the host commits once per call.
    1 runs one jitted step per token. The tiered runner always runs one per token (its host
    bookkeeping runs between steps). Tokens and logits do not depend on it.

    max_soft_tokens: rows of the engine's soft-token table (encoder outputs in prompts,
    `gj.Prompt`). Rows are kept for the engine's life, so the pages of an image stay valid and are
    shared when the same image comes again; a prompt that needs more raises ContextLengthError.

    layer_weights: how the engine holds the decoder's layer weights. "per_layer" (default): one
    buffer per layer and weight, layers unrolled in every program, so a decode step reads each
    weight once where it lies; "stacked": one [num_layers, ...] array per weight under a
    `lax.scan` (compile time independent of depth, but XLA copies each layer's slice before its
    matmuls: a copy of every layer's weights per decode step). Logits agree to rounding (XLA
    fuses the unrolled layers differently), within the engine's float bound. The engine's copy
    replaces nothing in the `Decoder` you passed: drop your reference to it to hold the weights
    once.
    """

    max_seq_len: int = 4096
    max_batch: int = 8
    prefill_chunk: int = 512
    decode_steps_per_call: int = 8
    attention_impl: AttentionImpl = "xla"
    kernel_platform: Optional[KernelPlatform] = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)  # {data: D, model: M}: shard over D x M devices
    max_soft_tokens: int = 4096
    layer_weights: LayerWeights = "per_layer"

    def __post_init__(self):
        for name, cls in (("cache", CacheConfig), ("sparse", SparseConfig), ("tier", TierConfig), ("mesh", MeshConfig)):
            nested(self, name, cls)
        if self.mesh is None:  # None: one device
            object.__setattr__(self, "mesh", MeshConfig())
        require(isinstance(self.max_seq_len, int) and self.max_seq_len > 0,
                 f"max_seq_len={self.max_seq_len!r} must be a positive integer.")
        require(isinstance(self.max_batch, int) and self.max_batch > 0,
                 f"max_batch={self.max_batch!r} must be a positive integer.")
        require(isinstance(self.prefill_chunk, int) and self.prefill_chunk > 0,
                 f"prefill_chunk={self.prefill_chunk!r} must be a positive integer.")
        require(isinstance(self.decode_steps_per_call, int) and self.decode_steps_per_call > 0,
                 f"decode_steps_per_call={self.decode_steps_per_call!r} must be a positive integer (1: one "
                 f"jitted step per token).")
        require(isinstance(self.max_soft_tokens, int) and self.max_soft_tokens >= 0,
                 f"max_soft_tokens={self.max_soft_tokens!r} must be a non-negative integer (0: no soft tokens).")
        require(self.layer_weights in get_args(LayerWeights),
                f"layer_weights={self.layer_weights!r} must be 'per_layer' or 'stacked'.")
        require(self.attention_impl in get_args(AttentionImpl),
                f"attention_impl={self.attention_impl!r} must be 'xla' or 'pallas'.")
        require(self.kernel_platform is None or self.kernel_platform in get_args(KernelPlatform),
                 f"kernel_platform={self.kernel_platform!r} must be None (the backend's), 'tpu' or 'gpu'.")
        c = self.cache
        if c.kind == "paged" and c.num_pages is not None:
            need = -(-self.max_seq_len // c.block_size) + 1
            require(c.num_pages >= need,
                     f"cache.num_pages={c.num_pages} is too small for one sequence of max_seq_len="
                     f"{self.max_seq_len}: it needs {need} (pages of {c.block_size} tokens + the null page).")
        compat.check(self)  # which features combine: one table
        sp = self.sparse
        if sp.enabled:
            fixed = (sp.sink_pages + sp.local_pages) * c.block_size
            require(sp.budget >= fixed,
                    f"sparse.budget={sp.budget} is smaller than sink + local = ({sp.sink_pages} + "
                    f"{sp.local_pages}) pages x {c.block_size} tokens = {fixed}; raise the budget or "
                    f"lower sink_pages/local_pages.")
            require(sp.budget // c.block_size <= self.num_pages - 1,
                    f"sparse.budget={sp.budget} selects {sp.budget // c.block_size} pages (top-k) but the "
                    f"pool has only {self.num_pages - 1}; lower the budget or raise cache.num_pages.")
        t = self.tier
        if t.enabled:
            require(t.pin_local_pages >= 1,
                    f"tier.pin_local_pages={t.pin_local_pages}: the engine keeps each sequence's partial last "
                    f"page on device (it is not stored below until full); it must be >= 1.")
            t.device_slots(self.num_pages)  # raises ConfigError when the budget exceeds the pool

    @property
    def mesh_devices(self) -> int:
        """Devices the mesh spans (1: no sharding)."""
        return self.mesh.devices

    @property
    def pages_per_seq(self) -> int:
        return -(-self.max_seq_len // self.cache.block_size)

    @property
    def num_pages(self) -> int:
        return self.cache.num_pages or self.max_batch * self.pages_per_seq + 1
