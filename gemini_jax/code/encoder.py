"""A small node encoder: one vector per normalized syntax node, such that nodes of one kind lie close
across languages and nodes of different kinds lie apart within one.

It sees hashed syntax features (gemini_jax.code.features), never the kind label; the label only
shapes the training loss (experiments/train_code_encoder.py, a contrastive InfoNCE loss). The shipped
weights live in gemini_jax/assets/code_encoder/ (`encoder.safetensors` + `config.json`).

    encoder = NodeEncoder.load()
    nodes, vectors = encoder.embed(source, "rust")    # list[Node], float32 [len(nodes), dim], unit rows
"""

from __future__ import annotations

import dataclasses
import json
import os

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from safetensors.numpy import load_file, save_file

from gemini_jax.code import features
from gemini_jax.code.nodes import DEFAULT_MAX_BYTES, Node, parse_source, walk_normalized
from gemini_jax.errors import CheckpointError, ConfigError

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "code_encoder")
WEIGHTS_NAME = "encoder.safetensors"
CONFIG_NAME = "config.json"


@dataclasses.dataclass(frozen=True, kw_only=True)
class EncoderConfig:
    """Sizes: `features` hash buckets in, a `hidden` layer, `dim` out."""

    features: int = 1024
    hidden: int = 128
    dim: int = 64

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"EncoderConfig.{field.name}={value!r} must be a positive int.")


class NodeEncoder(nnx.Module):
    """Hashed node features [n, features] -> unit vectors [n, dim] (two dense layers, gelu)."""

    def __init__(self, config: EncoderConfig, *, rngs: nnx.Rngs):
        self.config = config
        self.hidden = nnx.Linear(config.features, config.hidden, rngs=rngs)
        self.out = nnx.Linear(config.hidden, config.dim, rngs=rngs)

    def __call__(self, x: jax.Array) -> jax.Array:  # f32[n, features] -> f32[n, dim], unit rows
        z = self.out(jax.nn.gelu(self.hidden(x)))
        return z / jnp.maximum(jnp.linalg.norm(z, axis=-1, keepdims=True), 1e-6)

    def embed(self, source: str | bytes, language: str, *,
              max_bytes: int = DEFAULT_MAX_BYTES) -> tuple[list[Node], np.ndarray]:
        """The normalized nodes of `source` (see gemini_jax.code.normalized_nodes) and their vectors,
        float32 [len(nodes), dim] with unit rows. Raises what `normalized_nodes` raises."""
        parsed = parse_source(source, language, max_bytes=max_bytes)
        pairs = list(walk_normalized(parsed))
        x = features.hashed_features([syntax for _, syntax in pairs], parsed.data, self.config.features)
        return [node for node, _ in pairs], np.asarray(self(jnp.asarray(x)))

    def save(self, path: str = ASSET_DIR, *, extra: dict | None = None) -> None:
        """Write the weights (safetensors) and the config (plus `extra`, e.g. training facts) to `path`."""
        os.makedirs(path, exist_ok=True)
        tensors = {f"{name}.{part}": getattr(layer, part)[...] for name, layer in (("hidden", self.hidden),
                                                                                   ("out", self.out))
                   for part in ("kernel", "bias")}
        save_file({name: np.asarray(value, np.float32) for name, value in tensors.items()},
                  os.path.join(path, WEIGHTS_NAME))
        with open(os.path.join(path, CONFIG_NAME), "w") as fh:
            json.dump({**dataclasses.asdict(self.config), **(extra or {})}, fh, indent=1, sort_keys=True)
            fh.write("\n")

    @classmethod
    def load(cls, path: str = ASSET_DIR) -> NodeEncoder:
        """The encoder saved in `path` (default: the shipped one).

        Raises CheckpointError when a file is missing or its tensors do not match the config.
        """
        try:
            with open(os.path.join(path, CONFIG_NAME)) as fh:
                saved = json.load(fh)
            tensors = load_file(os.path.join(path, WEIGHTS_NAME))
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"code encoder in {path!r} cannot be read ({exc}); retrain it with "
                                  f"experiments/train_code_encoder.py.") from exc
        config = EncoderConfig(**{field.name: saved[field.name] for field in dataclasses.fields(EncoderConfig)})
        encoder = cls(config, rngs=nnx.Rngs(0))
        for name, layer in (("hidden", encoder.hidden), ("out", encoder.out)):
            for part in ("kernel", "bias"):
                value = tensors.get(f"{name}.{part}")
                expected = getattr(layer, part).shape
                if value is None or value.shape != expected:
                    raise CheckpointError(f"code encoder in {path!r}: {name}.{part} is "
                                          f"{None if value is None else value.shape}, expected {expected} "
                                          f"from its config; the files are from different runs.")
                getattr(layer, part)[...] = jnp.asarray(value)
        return encoder
