"""The decoder's shape and its family's quirks (`ModelConfig`, `RopeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Literal, Optional, get_args

from gemini_jax.config.base import nested, require

Dtype = Literal["float32", "bfloat16", "float16"]
DTYPES = get_args(Dtype)
Activation = Literal["silu", "gelu_tanh", "gelu"]
ACTIVATIONS = get_args(Activation)
NormKind = Literal["rms", "rms_plus_one"]
NORM_KINDS = get_args(NormKind)
RopeKind = Literal["default", "linear", "llama3"]
ROPE_KINDS = get_args(RopeKind)
Family = Literal["llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "tiny"]
FAMILIES = get_args(Family)


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional context-extension scaling."""

    theta: float = 10000.0
    kind: RopeKind = "default"
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self):
        require(self.theta > 0, f"rope.theta={self.theta} must be > 0.")
        require(self.kind in ROPE_KINDS, f"rope.kind={self.kind!r} must be one of {ROPE_KINDS}.")
        require(self.factor > 0, f"rope.factor={self.factor} must be > 0.")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder's shape and its family's quirks, expressed as data.

    `layer_windows[i]` is the sliding-window size of layer i (0 = full attention): a query at
    position p sees keys at positions p - window < k <= p. `local_rope` is the rope used by
    sliding layers when it differs from the global one (Gemma 3).
    """

    family: Family = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 8192
    norm_eps: float = 1e-6
    norm_kind: NormKind = "rms"  # rms: w * x_hat | rms_plus_one: (1 + w) * x_hat (Gemma)
    activation: Activation = "silu"
    qkv_bias: bool = False
    o_bias: bool = False
    qk_norm: bool = False  # RMSNorm over head_dim on q and k before rope (Qwen3, Gemma 3)
    sandwich_norms: bool = False  # extra norms after attention and after the MLP (Gemma 2/3)
    embed_scale: bool = False  # multiply embeddings by sqrt(hidden_size) (Gemma)
    attn_scale: Optional[float] = None  # None: head_dim ** -0.5
    attn_softcap: Optional[float] = None
    final_softcap: Optional[float] = None
    tie_embeddings: bool = False
    rope: RopeConfig = field(default_factory=RopeConfig)
    local_rope: Optional[RopeConfig] = None
    layer_windows: tuple[int, ...] = ()
    bos_id: Optional[int] = None
    eos_id: Optional[int] = None
    dtype: Dtype = "float32"

    def __post_init__(self):
        nested(self, "rope", RopeConfig)
        nested(self, "local_rope", RopeConfig)
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        require(self.family in FAMILIES, f"family={self.family!r} must be one of {FAMILIES}.")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, name)
            require(isinstance(v, int) and v > 0, f"{name}={v!r} must be a positive integer.")
        require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
        require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (rotary pairs).")
        require(self.norm_kind in NORM_KINDS, f"norm_kind={self.norm_kind!r} must be one of {NORM_KINDS}.")
        require(self.activation in ACTIVATIONS,
                 f"activation={self.activation!r} must be one of {ACTIVATIONS}.")
        require(self.dtype in DTYPES, f"dtype={self.dtype!r} must be one of {DTYPES}.")
        require(len(self.layer_windows) == self.num_layers,
                 f"layer_windows has {len(self.layer_windows)} entries; num_layers={self.num_layers}.")
        require(all(w >= 0 for w in self.layer_windows),
                 f"layer_windows={self.layer_windows} must be >= 0 (0 = full attention).")
        for name in ("attn_softcap", "final_softcap", "attn_scale"):
            v = getattr(self, name)
            require(v is None or v > 0, f"{name}={v} must be None or > 0.")
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            require(v is None or 0 <= v < self.vocab_size,
                     f"{name}={v} must be None or in [0, vocab_size={self.vocab_size}).")

    @property
    def group_size(self) -> int:
        return self.num_heads // self.num_kv_heads

    @property
    def scale(self) -> float:
        return self.attn_scale if self.attn_scale is not None else self.head_dim ** -0.5

    @property
    def max_window(self) -> int:
        """Largest sliding window, or 0 if any layer attends to the full context."""
        return 0 if any(w == 0 for w in self.layer_windows) else max(self.layer_windows)

    def num_params(self) -> int:
        E, I, V, L = self.hidden_size, self.intermediate_size, self.vocab_size, self.num_layers
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        per_layer = E * (q + 2 * kv) + q * E + 3 * E * I
        return L * per_layer + V * E * (1 if self.tie_embeddings else 2)


def windows_spec(num_layers: int, window: int, pattern: int = 0) -> list[int]:
    """Per-layer sliding windows from a compact spec (used by Hydra model presets).

    pattern 0: every layer slides; pattern P >= 2: layer i is global when (i + 1) % P == 0
    (Gemma 2: P = 2, Gemma 3: P = 6), sliding otherwise; window 0: all global.
    """
    if window <= 0:
        return [0] * num_layers
    if pattern == 0:
        return [window] * num_layers
    require(pattern >= 2, f"sliding pattern={pattern} must be 0 (all sliding) or >= 2.")
    return [0 if (i + 1) % pattern == 0 else window for i in range(num_layers)]
