"""Our own weight naming: a `Decoder` as a flat dict of arrays, and on disk as safetensors.

The names are the decoder's state paths joined by dots (`embed`, `final_norm`, `lm_head`,
`layers.wq`, ...), so they cannot drift from the module: `param_specs` asks the module itself.
A native checkpoint directory holds `model.safetensors` in these names and `config.json` holding
`dataclasses.asdict(ModelConfig)` (no `model_type` key, which is how it differs from an HF one).
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from pathlib import Path
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.config import DTYPES, ModelConfig, from_dict, replace
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.model import Decoder
from gemini_jax.weights.safetensors_io import NUMPY_DTYPES, WEIGHTS_NAME, TensorReader, write_safetensors

CONFIG_NAME = "config.json"


def _abstract(cfg: ModelConfig):
    """(graphdef, abstract state) of a Decoder for `cfg`, without allocating its weights."""
    return nnx.split(nnx.eval_shape(lambda: Decoder(cfg, rngs=nnx.Rngs(0))))


def _flatten(pure: dict) -> dict[str, object]:
    return {".".join(map(str, path)): leaf for path, leaf in nnx.traversals.flatten_mapping(pure).items()}


def param_specs(cfg: ModelConfig) -> dict[str, jax.ShapeDtypeStruct]:
    """Native name -> shape and dtype of every weight a Decoder for `cfg` holds."""
    _, state = _abstract(cfg)
    return _flatten(nnx.to_pure_dict(state))


def model_arrays(model: Decoder) -> dict[str, jax.Array]:
    """Native name -> array of every weight in `model`."""
    return _flatten(nnx.to_pure_dict(nnx.state(model, nnx.Param)))


def decoder_from_arrays(cfg: ModelConfig, arrays: dict[str, object], *, source: str = "arrays") -> Decoder:
    """Build a Decoder for `cfg` holding exactly `arrays` (native names), cast to `cfg.dtype`.

    Raises `CheckpointError` naming `source` when a weight is missing, unexpected or mis-shaped.
    """
    graphdef, state = _abstract(cfg)
    specs = _flatten(nnx.to_pure_dict(state))
    missing, extra = sorted(set(specs) - set(arrays)), sorted(set(arrays) - set(specs))
    if missing or extra:
        raise CheckpointError(f"{source}: weights do not match the config; missing {missing}, "
                              f"unexpected {extra}.")
    pure = {}
    for name, spec in specs.items():
        value = arrays[name]
        if tuple(value.shape) != tuple(spec.shape):
            raise CheckpointError(f"{source}: weight {name!r} has shape {list(value.shape)}, "
                                  f"expected {list(spec.shape)} from the config.")
        pure[tuple(name.split("."))] = jnp.asarray(value, dtype=spec.dtype)
    nnx.replace_by_pure_dict(state, nnx.traversals.unflatten_mapping(pure))
    return nnx.merge(graphdef, state)


def save_safetensors(model: Decoder, directory: str | os.PathLike) -> Path:
    """Write `model` as a native checkpoint (`model.safetensors` + `config.json`) into `directory`."""
    directory = Path(directory)
    directory.mkdir(parents=True, exist_ok=True)
    arrays = {name: np.asarray(jax.device_get(a)) for name, a in model_arrays(model).items()}
    write_safetensors(arrays, directory / WEIGHTS_NAME, metadata={"format": "gemini_jax"})
    config_path = directory / CONFIG_NAME
    tmp = config_path.with_name(CONFIG_NAME + ".tmp")
    tmp.write_text(json.dumps(dataclasses.asdict(model.cfg), indent=2, sort_keys=True))
    os.replace(tmp, config_path)
    return directory


def load_safetensors(directory: str | os.PathLike, dtype: Optional[str] = None) -> Decoder:
    """Load a native checkpoint written by `save_safetensors`; `dtype` overrides the saved one.

    Raises `CheckpointError` for missing/corrupt files or mismatched weights, `ConfigError` for
    a config.json that is not a native ModelConfig or an unsupported dtype.
    """
    directory = Path(directory)
    if dtype is not None and dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}.")
    config_path = directory / CONFIG_NAME
    data = read_config_json(config_path)
    if "model_type" in data:
        raise ConfigError(f"{config_path} is a Hugging Face config (model_type={data['model_type']!r}); "
                          f"load it with load_hf.")
    cfg = from_dict(ModelConfig, data)
    if dtype is not None:
        cfg = replace(cfg, dtype=dtype)
    specs = param_specs(cfg)
    np_dtype = NUMPY_DTYPES[cfg.dtype]
    with TensorReader(directory) as reader:
        unexpected = sorted(set(reader.names()) - set(specs))
        missing = sorted(set(specs) - set(reader.names()))
        if missing or unexpected:
            raise CheckpointError(f"{directory / WEIGHTS_NAME}: tensors do not match {config_path}; "
                                  f"missing {missing}, unexpected {unexpected}.")
        # One tensor at a time onto the device, so host memory never holds a second model copy.
        arrays = {name: jnp.asarray(reader.read(name, spec.shape, np_dtype)) for name, spec in specs.items()}
    return decoder_from_arrays(cfg, arrays, source=str(directory))


def read_config_json(path: Path) -> dict:
    if not path.exists():
        raise CheckpointError(f"{path} is missing; a checkpoint directory needs its config.json.")
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as e:
        raise CheckpointError(f"{path} is not valid JSON ({e}); the file is corrupt.") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path} must hold a JSON object, got {type(data).__name__}.")
    return data


def params_sha256(params) -> str:
    """sha256 over every weight array of a model state, in tree order."""
    h = hashlib.sha256()
    for leaf in jax.tree.leaves(params):
        h.update(np.asarray(leaf).tobytes())
    return h.hexdigest()
