"""The one place that picks how attention over pages runs: XLA (gather + dense, or the selected
pages), the Pallas kernels (`pallas_kernels`, decode steps: one query per row; the TPU or the GPU
(Triton) variant, `kernel_platform`), and compact positions (keys moved by rope, XLA only: the
kernels keep true positions).

Every runner's layer body ends here: the pooled cache inside the model's layer scan, the
tiered runner layer by layer, and the one-program tiered decode step.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp

from gemini_jax.attention import kvquant
from gemini_jax.attention.paged_decode import decode_over_pages
from gemini_jax.attention.sparse import sparse_attention
from gemini_jax.attention.views import PageView, Selection, slot_valid
from gemini_jax.config import ModelConfig
from gemini_jax.model import layers
from pallas_kernels.paged_decode import paged_decode_attention
from pallas_kernels.sparse_decode import sparse_decode_attention

IMPLS = ("xla", "pallas")
KERNEL_PLATFORMS = (None, "tpu", "gpu")


@dataclass(frozen=True, kw_only=True)
class AttentionImpl:
    """Static choice of the attention path (hashable). `impl` "xla" is the portable path (fast
    on CPU); "pallas" runs decode steps through the kernels (compiled on GPU / TPU, interpret
    mode on CPU). `windows`: the model's distinct sliding windows (the kernels take the window
    statically, so a step switches among them). `platform`: which kernel variant "pallas" runs,
    see `kernel_platform`."""

    impl: str = "xla"
    scale: float
    cap: Optional[float] = None
    windows: tuple = (0,)
    interpret: Optional[bool] = None
    platform: Optional[str] = None

    def __post_init__(self):
        if self.impl not in IMPLS:
            raise ValueError(f"impl={self.impl!r} must be one of {IMPLS}.")
        if self.platform not in KERNEL_PLATFORMS:
            raise ValueError(f"platform={self.platform!r} must be one of {KERNEL_PLATFORMS}.")

    @classmethod
    def of(cls, cfg: ModelConfig, impl: str = "xla", interpret=None, platform=None) -> "AttentionImpl":
        return cls(impl=impl, scale=cfg.scale, cap=cfg.attn_softcap, windows=tuple(sorted(set(cfg.layer_windows))),
                   interpret=interpret, platform=platform)


def kernel_platform(spec: AttentionImpl) -> Optional[str]:
    """The kernel variant a "pallas" decode step runs: the spec's platform if set, else the
    running backend's: "gpu" (Triton kernels) on a GPU, "tpu" on a TPU, and None on CPU (the
    kernels' own default there: the TPU kernels in interpret mode)."""
    if spec.platform is not None:
        return spec.platform
    backend = jax.default_backend()
    if backend in ("gpu", "cuda", "rocm"):
        return "gpu"
    return "tpu" if backend == "tpu" else None


def gather_pages(pool_layer, block_tables, dtype):
    """[K, P, S, D] pages of the block tables -> contiguous [B, W * S, K, D] in `dtype`."""
    g = kvquant.read(pool_layer[:, block_tables], dtype)  # [K, B, W, S, D]
    K, B, W, S, D = g.shape
    return g.transpose(1, 2, 3, 0, 4).reshape(B, W * S, K, D)


def attend_pages(spec: AttentionImpl, queries, kv_layer, view: PageView, window, layer=None):
    """Dense attention of queries = (q [B, T, H, D], q_pos [B, T]) over every page of the view's
    tables in kv_layer = (k, v) [K, P, S, D] -> [B, T, H, D]. With `layer` (i32[]), kv_layer is
    the whole pool [L, K, P, S, D] (the CPU decode path then reads the layer's pages from it
    without copying the layer: `paged_decode.decode_over_pages`)."""
    q, q_pos = queries
    if q.shape[1] == 1 and jax.default_backend() == "cpu" and spec.impl != "pallas":
        # One query per row on a CPU: row by row, chunk by chunk (see `paged_decode`).
        return decode_over_pages(queries, kv_layer, view, window, scale=spec.scale, cap=spec.cap, layer=layer)
    if layer is not None:
        kv_layer = (kv_layer[0][layer], kv_layer[1][layer])
    k_layer, v_layer = kv_layer
    if spec.impl == "pallas" and q.shape[1] == 1 and view.fill is None:
        (k, ks), (v, vs) = kvquant.kernel_operands(k_layer), kvquant.kernel_operands(v_layer)
        return _by_window(spec, window, lambda w: lambda: paged_decode_attention(
            q[:, 0], k, v, view.tables, view.lengths, sm_scale=spec.scale, soft_cap=spec.cap,
            sliding_window=(w or None), interpret=spec.interpret, platform=kernel_platform(spec),
            k_scales=ks, v_scales=vs)[:, None])
    kk = gather_pages(k_layer, view.tables, q.dtype)
    vv = gather_pages(v_layer, view.tables, q.dtype)
    k_pos = jnp.broadcast_to(jnp.arange(kk.shape[1], dtype=jnp.int32), kk.shape[:2])
    valid = k_pos < view.lengths[:, None]
    held = slot_valid(view.fill, jnp.broadcast_to(jnp.arange(view.tables.shape[1]), view.tables.shape),
                      k_layer.shape[2])
    if held is not None:  # syntax-aligned pages: their padding slots are masked
        valid = valid & held.reshape(valid.shape)
    mask = layers.attention_mask(q_pos, k_pos, valid, window)
    return layers.dense_attention(q, kk, vv, mask, scale=spec.scale, cap=spec.cap)


def attend_selected(spec: AttentionImpl, queries, kv_layer, view: PageView, sel: Selection, window, *,
                    return_lse: bool = False):
    """Attention over the selected pages only (equal to `attend_pages` restricted to them). With
    return_lse (XLA path), also the log-sum-exp that merges it with attention over other pages."""
    q, _ = queries
    if spec.impl == "pallas" and q.shape[1] == 1 and sel.shift is None and not return_lse and view.fill is None:
        (k, ks), (v, vs) = kvquant.kernel_operands(kv_layer[0]), kvquant.kernel_operands(kv_layer[1])
        return _by_window(spec, window, lambda w: lambda: sparse_decode_attention(
            q[:, 0], k, v, view.tables, view.lengths, sel.pages, sm_scale=spec.scale,
            soft_cap=spec.cap, sliding_window=(w or None), interpret=spec.interpret,
            platform=kernel_platform(spec), k_scales=ks, v_scales=vs)[:, None])
    return sparse_attention(queries, kv_layer, view, sel, scale=spec.scale, cap=spec.cap, window=window,
                            return_lse=return_lse)


def _by_window(spec: AttentionImpl, window, make):
    """Kernels take the window statically; layers differ (Gemma), so switch on it."""
    if len(spec.windows) == 1:
        return make(spec.windows[0])()
    idx = sum(jnp.where(window == w, i, 0) for i, w in enumerate(spec.windows))
    return jax.lax.switch(idx, [make(w) for w in spec.windows])
