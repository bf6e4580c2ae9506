"""Frozen, validated configuration dataclasses.

Everything static lives here; all of it is hashable so it can be a `jax.jit` static argument.
Changing state (weights, caches, counters) lives elsewhere. Each config validates itself once,
at construction, and names the field, the value and what is allowed when it refuses.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from collections.abc import Mapping
from typing import Any, Optional

from gemini_jax.errors import ConfigError

DTYPES = ("float32", "bfloat16", "float16")
# KV stored quantized, one float32 scale per token and kv head (gemini_jax.attention.kvquant).
KV_QUANT_DTYPES = ("int8", "float8_e4m3fn")
ACTIVATIONS = ("silu", "gelu_tanh", "gelu")
NORM_KINDS = ("rms", "rms_plus_one")
ROPE_KINDS = ("default", "linear", "llama3")
FAMILIES = ("llama", "mistral", "qwen2", "qwen3", "gemma2", "gemma3", "tiny")


def _require(cond: bool, message: str) -> None:
    if not cond:
        raise ConfigError(message)


def _nested(obj, name: str, cls) -> None:
    """Field `name` of the frozen config `obj`, given as a mapping (a Hydra node, a dict), becomes
    a `cls` through `from_dict` (the one mapping -> config path)."""
    value = getattr(obj, name)
    if isinstance(value, Mapping):
        object.__setattr__(obj, name, from_dict(cls, value, where=f"{type(obj).__name__}.{name}"))


@dataclass(frozen=True, kw_only=True)
class RopeConfig:
    """Rotary embedding: base frequency and optional context-extension scaling."""

    theta: float = 10000.0
    kind: str = "default"  # default | linear | llama3
    factor: float = 1.0
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position: int = 8192  # llama3 only

    def __post_init__(self):
        _require(self.theta > 0, f"rope.theta={self.theta} must be > 0.")
        _require(self.kind in ROPE_KINDS, f"rope.kind={self.kind!r} must be one of {ROPE_KINDS}.")
        _require(self.factor > 0, f"rope.factor={self.factor} must be > 0.")


@dataclass(frozen=True, kw_only=True)
class ModelConfig:
    """A decoder's shape and its family's quirks, expressed as data.

    `layer_windows[i]` is the sliding-window size of layer i (0 = full attention): a query at
    position p sees keys at positions p - window < k <= p. `local_rope` is the rope used by
    sliding layers when it differs from the global one (Gemma 3).
    """

    family: str = "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    max_position: int = 8192
    norm_eps: float = 1e-6
    norm_kind: str = "rms"  # rms: w * x_hat | rms_plus_one: (1 + w) * x_hat (Gemma)
    activation: str = "silu"
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
    dtype: str = "float32"

    def __post_init__(self):
        _nested(self, "rope", RopeConfig)
        _nested(self, "local_rope", RopeConfig)
        if not self.layer_windows:
            object.__setattr__(self, "layer_windows", (0,) * self.num_layers)
        object.__setattr__(self, "layer_windows", tuple(int(w) for w in self.layer_windows))
        _require(self.family in FAMILIES, f"family={self.family!r} must be one of {FAMILIES}.")
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_layers", "num_heads",
                     "num_kv_heads", "head_dim", "max_position"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v > 0, f"{name}={v!r} must be a positive integer.")
        _require(self.num_heads % self.num_kv_heads == 0,
                 f"num_heads={self.num_heads} must be a multiple of num_kv_heads={self.num_kv_heads}.")
        _require(self.head_dim % 2 == 0, f"head_dim={self.head_dim} must be even (rotary pairs).")
        _require(self.norm_kind in NORM_KINDS, f"norm_kind={self.norm_kind!r} must be one of {NORM_KINDS}.")
        _require(self.activation in ACTIVATIONS,
                 f"activation={self.activation!r} must be one of {ACTIVATIONS}.")
        _require(self.dtype in DTYPES, f"dtype={self.dtype!r} must be one of {DTYPES}.")
        _require(len(self.layer_windows) == self.num_layers,
                 f"layer_windows has {len(self.layer_windows)} entries; num_layers={self.num_layers}.")
        _require(all(w >= 0 for w in self.layer_windows),
                 f"layer_windows={self.layer_windows} must be >= 0 (0 = full attention).")
        for name in ("attn_softcap", "final_softcap", "attn_scale"):
            v = getattr(self, name)
            _require(v is None or v > 0, f"{name}={v} must be None or > 0.")
        for name in ("bos_id", "eos_id"):
            v = getattr(self, name)
            _require(v is None or 0 <= v < self.vocab_size,
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


@dataclass(frozen=True, kw_only=True)
class SamplingParams:
    """How to pick the next token. temperature == 0 means greedy (top_k/top_p ignored)."""

    max_new_tokens: int = 32
    temperature: float = 0.0
    top_k: int = 0  # 0 = off
    top_p: float = 1.0  # 1.0 = off
    seed: int = 0
    stop_at_eos: bool = True

    def __post_init__(self):
        from gemini_jax.errors import SamplingError

        def req(cond, msg):
            if not cond:
                raise SamplingError(msg)

        req(isinstance(self.max_new_tokens, int) and self.max_new_tokens >= 0,
            f"max_new_tokens={self.max_new_tokens!r} must be an integer >= 0.")
        req(self.temperature >= 0, f"temperature={self.temperature} must be >= 0 (0 = greedy).")
        req(isinstance(self.top_k, int) and self.top_k >= 0, f"top_k={self.top_k!r} must be an integer >= 0 (0 = off).")
        req(0.0 < self.top_p <= 1.0, f"top_p={self.top_p} must be in (0, 1] (1 = off).")


ALIGN_MODES = ("none", "syntax")


@dataclass(frozen=True, kw_only=True)
class CacheConfig:
    """The KV cache.

    kind "contiguous": the dense reference, one [max_seq_len] buffer per sequence.
    kind "paged": a pool of `num_pages` pages of `block_size` tokens (page 0 is a reserved null
    page); None sizes the pool for max_batch full-length sequences. `prefix_caching` lets a new
    request reuse cached full pages of an identical prefix.

    dtype: how K and V are stored. A float dtype (None: the model's), or "int8" / "float8_e4m3fn":
    each token's K and V in each kv head quantized with its own float32 scale (absmax), read back
    in the model's dtype (gemini_jax.attention.kvquant). Quantized KV runs wherever float KV does:
    the XLA path and the Pallas decode kernels (they read numbers and scales), the contiguous and
    paged caches, sparse or not, over tiers (pages go down packed with their scales) or a mesh
    (scales sharded by kv head with their data), the persistent prefix store (keyed on the dtype),
    sessions and snapshots.

    align: "none" (pages are fixed token spans) or "syntax": the prompt is read as source code in
    `align_language` (token ids 0-255 as bytes: a byte-level model) and a new page starts at each
    definition (function or class) inside at most `align_depth` other definitions (0: top-level ones;
    1: the methods of top-level classes too), the rest of the page before it left as padding that
    attention, digests and selection mask. A page then never spans two definitions. Rope keeps the
    tokens' true positions, so the numbers are those of fixed pages (exact up to rounding); the
    padding costs slots (and `max_seq_len` counts them). Supported on the paged cache, XLA
    attention, dense or sparse with true positions, one device, full-attention models, through
    `Engine.generate` / `score`; every other combination is refused by name
    (`gemini_jax.runtime.aligned`).
    """

    kind: str = "paged"
    block_size: int = 16
    num_pages: Optional[int] = None
    dtype: Optional[str] = None  # None: the model's dtype
    prefix_caching: bool = True
    align: str = "none"
    align_language: str = "python"
    align_depth: int = 0

    def __post_init__(self):
        _require(self.kind in ("contiguous", "paged"),
                 f"cache.kind={self.kind!r} must be 'contiguous' or 'paged'.")
        bs = self.block_size
        _require(isinstance(bs, int) and 8 <= bs <= 256 and bs & (bs - 1) == 0,
                 f"cache.block_size={bs!r} must be a power of two in [8, 256].")
        _require(self.num_pages is None or (isinstance(self.num_pages, int) and self.num_pages >= 2),
                 f"cache.num_pages={self.num_pages!r} must be None or an integer >= 2.")
        _require(self.dtype is None or self.dtype in DTYPES + KV_QUANT_DTYPES,
                 f"cache.dtype={self.dtype!r} must be None or one of {DTYPES + KV_QUANT_DTYPES}.")
        _require(self.align in ALIGN_MODES, f"cache.align={self.align!r} must be one of {ALIGN_MODES}.")
        _require(isinstance(self.align_depth, int) and not isinstance(self.align_depth, bool) and self.align_depth >= 0,
                 f"cache.align_depth={self.align_depth!r} must be an integer >= 0 (0: top-level definitions only; "
                 f"1: methods too).")
        _require(self.align == "none" or self.kind == "paged",
                 f"cache.align={self.align!r} lays out pages: it needs cache.kind='paged' (got {self.kind!r}).")

    @property
    def quantized(self) -> bool:
        return self.dtype in KV_QUANT_DTYPES


DIGEST_KINDS = ("minmax", "mean")
GROUP_REDUCE = ("max", "mean")
BUDGET_MODES = ("fixed", "topp")


@dataclass(frozen=True, kw_only=True)
class SparseConfig:
    """Chunk-sparse attention over KV pages (needs the paged cache).

    Each page keeps a digest per kv head: "minmax" (Quest: per-dimension key bounds, the score is
    an upper bound of q.k) or "mean" (the page's mean key). A decode step scores every page from
    its digest, keeps the first `sink_pages` and the last `local_pages` (the current page
    included) and fills `budget` tokens with the top-scoring rest. Query heads of a GQA group
    share one selection; `group_reduce` combines their scores. The first `dense_layers` layers
    attend to every page. `sparse_prefill` applies the same selection to prefill chunks (the
    chunk's own pages are always kept). When the budget covers the whole context every page is
    selected, so short contexts are never approximated.

    `positions`: "true" keeps every key at its own position; "compact" (InfLLM-style length
    extrapolation) re-positions the selected pages as if they were contiguous, ending at the query,
    so every query-key distance stays within about `budget` tokens, the span a model trained on
    short contexts knows (keys are re-rotated by the position change; the local pages keep their
    true distances). Identical to "true" while the budget covers the context.
    `score_queries`: how many of a sparse prefill chunk's queries score the pages (the last n real
    ones, padding excluded; 0 = all). Scoring costs chunk x pages x head_dim per chunk, which
    dominates at 10^6 tokens.
    `last_token_alone` (sparse prefill only): the prompt's last token runs as a call of its own, so
    the query whose logits give the first generated token selects its pages itself instead of
    sharing a chunk's selection (one small extra call per prompt; the chunk's queries, scoring
    together, often miss a page only that query needs).
    `score_distance` (compact positions only; 0 = off): score every page as if it sat that many
    tokens before the query, from digests of the keys before rope. Compact positions attend to a
    page at its re-positioned distance (within the budget), so scoring it at its true distance, far
    beyond what a short-context model was trained on, misjudges it.
    `rerank` (0 = off; n >= 2): two-stage selection. The digests pick n times as many candidate
    pages as the budget holds; the keys of the candidates are read and their exact scores (the
    largest q.k over the page's keys, the same queries, heads and distance as the digest scores)
    pick the pages to attend. Digest bounds are loose; exact scores are not, at the price of reading
    the candidates' keys (counted in `kv_bytes_read`). Paged cache only (not over tiers).
    `budget_mode`: "fixed" reads `budget` tokens per (sequence, kv head, layer); "topp" (adaptive,
    Twilight-style) reads, per (sequence, kv head, layer), the best pages until their share of the
    softmax of page scores (digest scores, or exact ones under rerank, at 1 / sqrt(head_dim))
    reaches `top_p`, never fewer than `min_budget` tokens nor more than `budget` (sink and local
    pages always). A peaked score distribution reads a few pages, a flat one the whole budget.
    """

    enabled: bool = False
    digest: str = "minmax"
    budget: int = 2048  # tokens of KV read per (sequence, kv head, layer), sink and local included
    sink_pages: int = 1
    local_pages: int = 2
    group_reduce: str = "max"
    dense_layers: int = 0
    digest_dtype: Optional[str] = None  # None: the cache dtype
    sparse_prefill: bool = False
    positions: str = "true"
    score_queries: int = 0
    last_token_alone: bool = True
    score_distance: int = 0
    rerank: int = 0
    budget_mode: str = "fixed"
    top_p: float = 0.9
    min_budget: int = 0  # tokens (topp only); sink and local pages come on top

    def __post_init__(self):
        _require(self.positions in ("true", "compact"),
                 f"sparse.positions={self.positions!r} must be 'true' or 'compact'.")
        _require(isinstance(self.score_queries, int) and self.score_queries >= 0,
                 f"sparse.score_queries={self.score_queries!r} must be an integer >= 0 (0 = every query).")
        _require(isinstance(self.score_distance, int) and self.score_distance >= 0,
                 f"sparse.score_distance={self.score_distance!r} must be an integer >= 0 (0 = true positions).")
        _require(self.score_distance == 0 or self.positions == "compact",
                 f"sparse.score_distance={self.score_distance} scores pages at the distance compact positions "
                 f"put them; it needs sparse.positions='compact' (got {self.positions!r}).")
        _require(_is_int(self.rerank) and (self.rerank == 0 or self.rerank >= 2),
                 f"sparse.rerank={self.rerank!r} must be 0 (off) or an integer >= 2 (candidate pages per "
                 f"selected page).")
        _require(isinstance(self.last_token_alone, bool),
                 f"sparse.last_token_alone={self.last_token_alone!r} must be true or false.")
        _require(self.digest in DIGEST_KINDS, f"sparse.digest={self.digest!r} must be one of {DIGEST_KINDS}.")
        _require(self.group_reduce in GROUP_REDUCE,
                 f"sparse.group_reduce={self.group_reduce!r} must be one of {GROUP_REDUCE}.")
        for name in ("sink_pages", "local_pages", "dense_layers"):
            v = getattr(self, name)
            _require(isinstance(v, int) and v >= 0, f"sparse.{name}={v!r} must be an integer >= 0.")
        _require(self.local_pages >= 1, f"sparse.local_pages={self.local_pages} must be >= 1 (the current page).")
        _require(isinstance(self.budget, int) and self.budget > 0, f"sparse.budget={self.budget!r} must be > 0.")
        _require(self.digest_dtype is None or self.digest_dtype in DTYPES,
                 f"sparse.digest_dtype={self.digest_dtype!r} must be None or one of {DTYPES}.")
        _require(self.budget_mode in BUDGET_MODES,
                 f"sparse.budget_mode={self.budget_mode!r} must be one of {BUDGET_MODES}.")
        _require(isinstance(self.top_p, (int, float)) and not isinstance(self.top_p, bool) and 0 < self.top_p <= 1,
                 f"sparse.top_p={self.top_p!r} must be in (0, 1] (the share of score mass the pages read cover).")
        _require(_is_int(self.min_budget) and 0 <= self.min_budget <= self.budget,
                 f"sparse.min_budget={self.min_budget!r} must be an integer in [0, sparse.budget={self.budget}].")


# ---- tiers below the device pool (gemini_jax.tiers) ------------------------------------------
WRITE_POLICIES = ("write_through", "write_back")
DISK_LAYOUTS = ("chunked", "sharded")
ON_CORRUPT = ("raise", "recompute")


def _is_int(v) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


LINK_MODES = ("real", "emulate")


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
        _require(self.page_bytes is None or (_is_int(self.page_bytes) and self.page_bytes >= 1),
                 f"tier.link_model.page_bytes={self.page_bytes!r} must be None or an integer >= 1.")
        for name in ("host_gbs", "disk_gbs", "disk_iops", "time_scale"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and v > 0,
                     f"tier.link_model.{name}={v!r} must be a number > 0.")
        for name in ("host_latency_us", "disk_latency_us"):
            v = getattr(self, name)
            _require(isinstance(v, (int, float)) and not isinstance(v, bool) and v >= 0,
                     f"tier.link_model.{name}={v!r} must be a number >= 0.")
        _require(_is_int(self.queue_depth) and self.queue_depth >= 1,
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
    write_policy: str = "write_through"
    disk_layout: str = "chunked"
    shard_pages: int = 64
    disk_fsync: bool = False
    on_corrupt: str = "raise"
    prefetch_depth: int = 1
    lookahead: int = 3
    staging_pages: int = 2048
    io_workers: int = 4
    pin_sink_pages: int = 1
    pin_local_pages: int = 2
    hot_threshold: int = 0
    hot_window: int = 32
    fused_decode: bool = True
    link: str = "real"
    link_model: LinkConfig = field(default_factory=LinkConfig)
    persistent: bool = False

    def __post_init__(self):
        _nested(self, "link_model", LinkConfig)
        _require(self.link in LINK_MODES, f"tier.link={self.link!r} must be one of {LINK_MODES}.")
        _require(isinstance(self.persistent, bool), f"tier.persistent={self.persistent!r} must be true or false.")
        _require(not self.persistent or self.disk_path is not None,
                 "tier.persistent=true keeps prompt pages on disk for later engines: set tier.disk_path.")
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
        _require(isinstance(self.fused_decode, bool), f"tier.fused_decode={self.fused_decode!r} must be true or false.")
        for name in ("shard_pages", "staging_pages", "io_workers", "hot_window"):
            v = getattr(self, name)
            _require(_is_int(v) and v >= 1, f"tier.{name}={v!r} must be an integer >= 1.")
        for name in ("prefetch_depth", "lookahead", "pin_sink_pages", "pin_local_pages", "hot_threshold"):
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


@dataclass(frozen=True, kw_only=True)
class MeshConfig:
    """A (data, model) device mesh: batches go over `data`, attention heads and MLP columns over
    `model` (1 x 1: one device, no sharding)."""

    data: int = 1
    model: int = 1

    def __post_init__(self):
        for name in ("data", "model"):
            value = getattr(self, name)
            _require(_is_int(value) and value >= 1, f"mesh.{name}={value!r} must be an integer >= 1.")

    @property
    def devices(self) -> int:
        return self.data * self.model


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
    attention_impl: str = "xla"
    kernel_platform: Optional[str] = None
    cache: CacheConfig = field(default_factory=CacheConfig)
    sparse: SparseConfig = field(default_factory=SparseConfig)
    tier: TierConfig = field(default_factory=TierConfig)
    mesh: MeshConfig = field(default_factory=MeshConfig)  # {data: D, model: M}: shard over D x M devices
    max_soft_tokens: int = 4096
    layer_weights: str = "per_layer"

    def __post_init__(self):
        for name, cls in (("cache", CacheConfig), ("sparse", SparseConfig), ("tier", TierConfig), ("mesh", MeshConfig)):
            _nested(self, name, cls)
        if self.mesh is None:  # None: one device
            object.__setattr__(self, "mesh", MeshConfig())
        _require(isinstance(self.max_seq_len, int) and self.max_seq_len > 0,
                 f"max_seq_len={self.max_seq_len!r} must be a positive integer.")
        _require(isinstance(self.max_batch, int) and self.max_batch > 0,
                 f"max_batch={self.max_batch!r} must be a positive integer.")
        _require(isinstance(self.prefill_chunk, int) and self.prefill_chunk > 0,
                 f"prefill_chunk={self.prefill_chunk!r} must be a positive integer.")
        _require(isinstance(self.decode_steps_per_call, int) and self.decode_steps_per_call > 0,
                 f"decode_steps_per_call={self.decode_steps_per_call!r} must be a positive integer (1: one "
                 f"jitted step per token).")
        _require(isinstance(self.max_soft_tokens, int) and self.max_soft_tokens >= 0,
                 f"max_soft_tokens={self.max_soft_tokens!r} must be a non-negative integer (0: no soft tokens).")
        _require(self.layer_weights in ("per_layer", "stacked"),
                 f"layer_weights={self.layer_weights!r} must be 'per_layer' or 'stacked'.")
        _require(self.attention_impl in ("xla", "pallas"),
                 f"attention_impl={self.attention_impl!r} must be 'xla' or 'pallas'.")
        _require(self.kernel_platform in (None, "tpu", "gpu"),
                 f"kernel_platform={self.kernel_platform!r} must be None (the backend's), 'tpu' or 'gpu'.")
        c = self.cache
        if c.kind == "paged" and c.num_pages is not None:
            need = -(-self.max_seq_len // c.block_size) + 1
            _require(c.num_pages >= need,
                     f"cache.num_pages={c.num_pages} is too small for one sequence of max_seq_len="
                     f"{self.max_seq_len}: it needs {need} (pages of {c.block_size} tokens + the null page).")
        sp = self.sparse
        if sp.enabled:
            _require(c.kind == "paged", f"sparse.enabled needs cache.kind='paged' (got {c.kind!r}).")
            fixed = (sp.sink_pages + sp.local_pages) * c.block_size
            _require(sp.budget >= fixed,
                     f"sparse.budget={sp.budget} is smaller than sink + local = ({sp.sink_pages} + "
                     f"{sp.local_pages}) pages x {c.block_size} tokens = {fixed}; raise the budget or "
                     f"lower sink_pages/local_pages.")
            _require(sp.budget // c.block_size <= self.num_pages - 1,
                     f"sparse.budget={sp.budget} selects {sp.budget // c.block_size} pages (top-k) but the "
                     f"pool has only {self.num_pages - 1}; lower the budget or raise cache.num_pages.")

        t = self.tier
        if c.align != "none":
            # Padding slots are masked on the XLA path of the all-resident pool; the kernels, the tiers'
            # layer-by-layer runner and a mesh do not carry the page fills (yet): refused, not ignored.
            for ok, what in ((self.attention_impl == "xla", f"attention_impl={self.attention_impl!r} (use 'xla')"),
                             (not t.enabled, "tier.enabled"), (self.mesh_devices == 1, "a device mesh"),
                             (not sp.enabled or sp.positions == "true",
                              f"sparse.positions={sp.positions!r} (use 'true')")):
                _require(ok, f"cache.align={c.align!r} does not run with {what}; set cache.align='none' for it.")
        if t.enabled:
            _require(c.kind == "paged", f"tier.enabled needs cache.kind='paged' (got {c.kind!r}).")
            _require(self.attention_impl == "xla",
                     f"tier.enabled runs attention layer by layer on the XLA path; set attention_impl='xla' "
                     f"(got {self.attention_impl!r}).")
            _require(not (sp.enabled and sp.rerank),
                     f"sparse.rerank={sp.rerank} reads the keys of candidate pages before it selects; over "
                     f"tiers those pages may not be on device. Set sparse.rerank=0 or tier.enabled=false.")
            _require(t.pin_local_pages >= 1,
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


PREEMPT_MODES = ("swap", "recompute")


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The server (`python -m gemini_jax.serve`) and its scheduler (`gemini_jax.serve.Scheduler`).

    `step_tokens`: tokens one scheduler step computes, every decoding request's next token first,
    then prefill chunks of joining requests while the budget lasts (one chunk always runs, so a
    prompt never waits on a budget smaller than `EngineConfig.prefill_chunk`). `preempt`: what
    happens to the lowest-ranked request when pages run out: `swap` copies its pages to host
    memory and back (the same bytes, so the same tokens), `recompute` frees them and prefills its
    tokens again. `pad_batch`: fill each decode call up to a power of two with scratch rows, so
    few batch shapes compile (the pooled cache; tiers run the rows as they are). `max_waiting`: requests queued beyond the running batch before new ones get 503.
    `api_keys`: a JSON file {key: {tenant, pool, per_request}} (compute units, see
    `gemini_jax.serve.quotas`); None accepts any key, with no quotas (the loopback default).
    `state_dir`: where `/snapshot` writes Orbax snapshots and the audit log lives (None: a
    temporary directory of the server's life). `session_ttl_s`: how long an interrupted request's
    state (its pages' image and logits, in host memory) waits for a resume, snapshot or delete
    before it is dropped; its snapshot on disk, if one was taken, stays (0: until deleted).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str = "gemini-jax-tiny"
    step_tokens: int = 512
    preempt: str = "swap"
    max_waiting: int = 256
    pad_batch: bool = True
    api_keys: Optional[str] = None
    state_dir: Optional[str] = None
    session_ttl_s: float = 3600.0

    def __post_init__(self):
        _require(_is_int(self.port) and 0 <= self.port <= 65535,
                 f"serve.port={self.port!r} must be an integer in [0, 65535] (0: any free port).")
        _require(isinstance(self.model_id, str) and self.model_id.strip() != "",
                 f"serve.model_id={self.model_id!r} must be a non-empty string.")
        _require(_is_int(self.step_tokens) and self.step_tokens >= 1,
                 f"serve.step_tokens={self.step_tokens!r} must be an integer >= 1.")
        _require(self.preempt in PREEMPT_MODES, f"serve.preempt={self.preempt!r} must be one of {PREEMPT_MODES}.")
        _require(_is_int(self.max_waiting) and self.max_waiting >= 0,
                 f"serve.max_waiting={self.max_waiting!r} must be an integer >= 0.")
        _require(isinstance(self.session_ttl_s, (int, float)) and not isinstance(self.session_ttl_s, bool)
                 and self.session_ttl_s >= 0,
                 f"serve.session_ttl_s={self.session_ttl_s!r} must be a number of seconds >= 0 (0: until deleted).")


def replace(cfg, **changes):
    """`dataclasses.replace` that re-runs validation."""
    return dataclasses.replace(cfg, **changes)


def from_dict(cls, data: Mapping[str, Any], *, where: str | None = None):
    """Build a config dataclass from a plain mapping (e.g. a Hydra node), refusing unknown keys.
    Nested configs may be mappings too: each config's `__post_init__` sends them back here."""
    where = where or cls.__name__
    if not isinstance(data, Mapping):
        raise ConfigError(f"{where} must be a mapping of {cls.__name__} fields, got {type(data).__name__}.")
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(data) - names)
    if unknown:
        raise ConfigError(f"{where} got unknown field(s) {unknown}; allowed: {sorted(names)}.")
    try:
        return cls(**data)
    except TypeError as e:  # missing required field
        raise ConfigError(f"{where}: {e}") from None


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
    dtype: str = "bfloat16"
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
        _nested(self, "mesh", MeshConfig)
        _require(self.device_memory_gb > 0, f"device_memory_gb={self.device_memory_gb} must be > 0.")
        _require(self.host_memory_gb > 0, f"host_memory_gb={self.host_memory_gb} must be > 0.")
        _require(self.dtype in DTYPES, f"hardware dtype={self.dtype!r} must be one of {DTYPES}.")
        _require(_is_int(self.reference_context) and self.reference_context >= 1,
                 f"hardware reference_context={self.reference_context!r} must be an integer >= 1.")
        _require(0 <= self.device_reserve_gb <= self.device_memory_gb,
                 f"hardware device_reserve_gb={self.device_reserve_gb} must be in [0, device_memory_gb="
                 f"{self.device_memory_gb}].")
        _require(0 <= self.host_reserve_gb <= self.host_memory_gb,
                 f"hardware host_reserve_gb={self.host_reserve_gb} must be in [0, host_memory_gb={self.host_memory_gb}].")


def windows_spec(num_layers: int, window: int, pattern: int = 0) -> list[int]:
    """Per-layer sliding windows from a compact spec (used by Hydra model presets).

    pattern 0: every layer slides; pattern P >= 2: layer i is global when (i + 1) % P == 0
    (Gemma 2: P = 2, Gemma 3: P = 6), sliding otherwise; window 0: all global.
    """
    if window <= 0:
        return [0] * num_layers
    if pattern == 0:
        return [window] * num_layers
    _require(pattern >= 2, f"sliding pattern={pattern} must be 0 (all sliding) or >= 2.")
    return [0 if (i + 1) % pattern == 0 else window for i in range(num_layers)]
