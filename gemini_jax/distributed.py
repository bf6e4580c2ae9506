"""The decoder and its paged cache over a jax device mesh (SPMD partitioning by XLA).

Axes: `data` (batch) and `model` (tensor parallel). Weights are sharded Megatron-style: q/k/v
and the MLP's gate/up split their output columns (heads, hidden units) over `model`; o and down
split their input rows, so each layer needs one all-reduce per residual write. The page pool
and page digests are sharded by kv head over `model`: each device holds its heads' pages and
digests, and page selection for a kv head runs where its digests live — no KV moves between
devices. Block tables, lengths and selections are small and replicated.

We write no collective by hand: shardings go on the inputs, XLA's SPMD partitioner does the rest.
"""

from __future__ import annotations

import os
from typing import Optional

import jax
from jax.sharding import AxisType, Mesh, NamedSharding, PartitionSpec as P

from gemini_jax.config import MeshConfig, ModelConfig
from gemini_jax.errors import ConfigError

AXES = ("data", "model")

# Layer weight name -> partition spec of its stacked [layers, ...] array.
_LAYER_SPECS = {
    "wq": P(None, None, "model"), "wk": P(None, None, "model"), "wv": P(None, None, "model"),
    "bq": P(None, "model"), "bk": P(None, "model"), "bv": P(None, "model"),
    "wo": P(None, "model", None), "w_gate": P(None, None, "model"), "w_up": P(None, None, "model"),
    "w_down": P(None, "model", None),
}
# [layers, kv_heads, ...]: the pool [layers, kv_heads, pages, block, head_dim], its digests, and a
# quantized pool's scales [layers, kv_heads, pages, block] alike (trailing axes unsharded).
POOL_SPEC = P(None, "model")


def make_mesh(shape: MeshConfig, cfg: Optional[ModelConfig] = None) -> Mesh:
    """A (data, model) mesh; ConfigError if it does not fit the devices or the model's heads."""
    dims = (shape.data, shape.model)
    n = dims[0] * dims[1]
    have = jax.device_count()
    if n > have:
        raise ConfigError(
            f"mesh {dict(zip(AXES, dims))} needs {n} devices but jax sees {have}; shrink mesh.data or "
            f"mesh.model (on CPU, XLA_FLAGS=--xla_force_host_platform_device_count=N fakes N devices).")
    if cfg is not None:
        m = dims[1]
        for name, heads in (("num_kv_heads", cfg.num_kv_heads), ("num_heads", cfg.num_heads)):
            if heads % m:
                raise ConfigError(
                    f"mesh.model={m} does not divide {name}={heads}: each device must hold whole heads; "
                    f"use a mesh.model that divides {cfg.num_kv_heads} (kv heads), moving the rest to mesh.data.")
        if cfg.intermediate_size % m:
            raise ConfigError(f"mesh.model={m} does not divide intermediate_size={cfg.intermediate_size}.")
    # Auto axes: XLA's partitioner propagates shardings (current jax defaults to Explicit).
    return jax.make_mesh(dims, AXES, axis_types=(AxisType.Auto, AxisType.Auto),
                         devices=jax.devices()[:n])


def shard_params(state, mesh: Mesh):
    """Place a model's state on the mesh (tensor-parallel layers, replicated embeddings/norms)."""

    def place(path, x):
        name = getattr(path[-1], "key", str(path[-1]))
        spec = _LAYER_SPECS.get(name, P()) if any(getattr(p, "key", None) == "layers" for p in path) else P()
        return jax.device_put(x, NamedSharding(mesh, spec))

    return jax.tree_util.tree_map_with_path(place, state)


def pool_sharding(mesh: Mesh) -> NamedSharding:
    return NamedSharding(mesh, POOL_SPEC)


def batch_sharding(mesh: Mesh, batch: int, ndim: int) -> NamedSharding:
    """Batch-leading arrays go over `data` when the batch divides it, else are replicated."""
    data = mesh.shape["data"]
    spec = P("data", *([None] * (ndim - 1))) if data > 1 and batch % data == 0 else P()
    return NamedSharding(mesh, spec)


def initialize_from_env() -> bool:
    """Join a multi-host job: `jax.distributed.initialize()` reads the coordinator address,
    process count and id from the environment (SLURM / GKE / explicit JAX_* variables)."""
    if int(os.environ.get("JAX_PROCESS_COUNT", os.environ.get("SLURM_NTASKS", "1"))) <= 1 and \
            "JAX_COORDINATOR_ADDRESS" not in os.environ:
        return False
    jax.distributed.initialize()
    return True
