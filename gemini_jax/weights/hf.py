"""Load a Hugging Face checkpoint directory (config.json + safetensors) into a `Decoder`.

HF stores one tensor per layer as `model.layers.{i}.<module>.weight`, Linear weights as [out, in].
We stack layer i into row i of a native `[num_layers, in, out]` array (the decoder computes x @ W).
All families share the names below; Gemma 2/3 differ only in which norm sits before the MLP
(`pre_feedforward_layernorm`, with `post_attention_layernorm` being the sandwich norm), which the
config's `sandwich_norms` decides.
"""

from __future__ import annotations

import os
from pathlib import Path

import jax.numpy as jnp
import numpy as np

from gemini_jax.config import DTYPES, ModelConfig
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.model import Decoder
from gemini_jax.weights.hf_config import model_config_from_hf
from gemini_jax.weights.native import CONFIG_NAME, read_config_json, decoder_from_arrays, param_specs
from gemini_jax.weights.safetensors_io import NUMPY_DTYPES, TensorReader

# native per-layer name -> (name under `model.layers.{i}.`, stored as [out, in] and needs a transpose)
_LAYER = {
    "attn_norm": ("input_layernorm.weight", False),
    "wq": ("self_attn.q_proj.weight", True),
    "wk": ("self_attn.k_proj.weight", True),
    "wv": ("self_attn.v_proj.weight", True),
    "wo": ("self_attn.o_proj.weight", True),
    "bq": ("self_attn.q_proj.bias", False),
    "bk": ("self_attn.k_proj.bias", False),
    "bv": ("self_attn.v_proj.bias", False),
    "bo": ("self_attn.o_proj.bias", False),
    "q_norm": ("self_attn.q_norm.weight", False),
    "k_norm": ("self_attn.k_norm.weight", False),
    "mlp_norm": ("post_attention_layernorm.weight", False),
    "w_gate": ("mlp.gate_proj.weight", True),
    "w_up": ("mlp.up_proj.weight", True),
    "w_down": ("mlp.down_proj.weight", True),
}
_SANDWICH = {
    "mlp_norm": ("pre_feedforward_layernorm.weight", False),
    "post_attn_norm": ("post_attention_layernorm.weight", False),
    "post_mlp_norm": ("post_feedforward_layernorm.weight", False),
}
_TOP = {
    "embed": ("model.embed_tokens.weight", False),
    "final_norm": ("model.norm.weight", False),
    "lm_head": ("lm_head.weight", True),
}
# Multimodal Gemma 3 nests the text decoder; both spellings occur (transformers 4.x/5.x).
_PREFIXES = {"language_model.model.": "model.", "model.language_model.": "model.",
             "language_model.lm_head.": "lm_head."}
# Tensors that carry no weights of the text decoder.
_VISION_PREFIXES = ("vision_tower.", "multi_modal_projector.", "model.vision_tower.",
                    "model.multi_modal_projector.")


def hf_name_map(cfg: ModelConfig) -> dict[str, tuple[list[str], bool]]:
    """Native name -> (HF source tensors, transpose?). Stacked weights have one source per layer."""
    layer = dict(_LAYER)
    if cfg.sandwich_norms:
        layer.update(_SANDWICH)
    plan = {}
    for name in param_specs(cfg):
        if name.startswith("layers."):
            hf, transpose = layer[name.removeprefix("layers.")]
            plan[name] = ([f"model.layers.{i}.{hf}" for i in range(cfg.num_layers)], transpose)
        else:
            hf, transpose = _TOP[name]
            plan[name] = ([hf], transpose)
    return plan


def load_hf(path: str | os.PathLike, dtype: str = "float32") -> Decoder:
    """Load an HF checkpoint directory (config.json + one or sharded safetensors files).

    Weights are read one tensor at a time, cast to `dtype` (float32 | bfloat16 | float16) and
    stacked per layer, so host memory peaks near one copy of the model. Tied embeddings (no
    `lm_head.weight`) reuse `embed`. Raises `ConfigError` for an unsupported dtype, family or
    feature; `CheckpointError` for a missing/corrupt file or a missing, extra or mis-shaped tensor.
    """
    path = Path(path)
    if dtype not in DTYPES:
        raise ConfigError(f"dtype={dtype!r} is not supported; use one of {DTYPES}.")
    config_path = path / CONFIG_NAME
    hf_config = read_config_json(config_path)
    try:
        cfg = model_config_from_hf(hf_config, dtype)
    except ConfigError as e:
        raise ConfigError(f"{config_path}: {e}") from None
    multimodal = hf_config.get("model_type") == "gemma3"

    plan = hf_name_map(cfg)
    specs = param_specs(cfg)
    np_dtype = NUMPY_DTYPES[dtype]
    with TensorReader(path) as reader:
        stored = _canonical_names(reader.names(), path)
        wanted = {hf for sources, _ in plan.values() for hf in sources}
        missing = sorted(wanted - set(stored))
        unexpected = sorted(n for n in set(stored) - wanted if not _harmless(n, cfg, multimodal))
        if missing:
            raise CheckpointError(f"{path}: {len(missing)} tensor(s) that {config_path.name} requires are "
                                  f"missing: {_clip(missing)}.")
        if unexpected:
            raise CheckpointError(f"{path}: {len(unexpected)} tensor(s) the decoder has no place for "
                                  f"(config.json and weights disagree?): {_clip(unexpected)}.")
        arrays = {}
        for name, (sources, transpose) in plan.items():
            # Each array goes to the device before the next is read: one model copy at a time.
            arrays[name] = jnp.asarray(_gather(reader, stored, sources, transpose, tuple(specs[name].shape),
                                               name.startswith("layers."), np_dtype))
    return decoder_from_arrays(cfg, arrays, source=str(path))


def _gather(reader: TensorReader, stored: dict[str, str], sources: list[str], transpose: bool,
            shape: tuple[int, ...], stacked: bool, np_dtype) -> np.ndarray:
    """One native array: a single tensor, or the per-layer tensors stacked along axis 0."""
    def one(hf: str, target: tuple[int, ...]) -> np.ndarray:
        t = reader.read(stored[hf], target[::-1] if transpose else target, np_dtype)
        return t.T if transpose else t

    if not stacked:
        return np.ascontiguousarray(one(sources[0], shape))
    out = np.empty(shape, np_dtype)
    for i, hf in enumerate(sources):
        out[i] = one(hf, shape[1:])
    return out


def _canonical_names(names: list[str], path: Path) -> dict[str, str]:
    """canonical HF name (multimodal prefixes stripped) -> name as stored."""
    out: dict[str, str] = {}
    for stored in names:
        canon = stored
        for prefix, repl in _PREFIXES.items():
            if stored.startswith(prefix):
                canon = repl + stored[len(prefix):]
                break
        if canon in out:
            raise CheckpointError(f"{path}: tensors {out[canon]!r} and {stored!r} both map to {canon!r}.")
        out[canon] = stored
    return out


def _harmless(name: str, cfg: ModelConfig, multimodal: bool) -> bool:
    """Stored tensors we may skip: buffers recomputed from the config, another modality's tower,
    or an lm_head that a tied config tells transformers to ignore as well."""
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if multimodal and name.startswith(_VISION_PREFIXES):
        return True
    return cfg.tie_embeddings and name == "lm_head.weight"


def _clip(names: list[str], limit: int = 8) -> str:
    shown = ", ".join(names[:limit])
    return shown + (f" ... (+{len(names) - limit} more)" if len(names) > limit else "")
