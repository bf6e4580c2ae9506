"""Weights in and out: Hugging Face checkpoints (config.json + safetensors, single or sharded)
and our own native checkpoints (flat `layers.wq`-style names + a ModelConfig config.json)."""

from gemini_jax.weights.hf import hf_name_map, load_hf
from gemini_jax.weights.hf_config import SUPPORTED_MODEL_TYPES, model_config_from_hf
from gemini_jax.weights.native import (decoder_from_arrays, load_safetensors, model_arrays, param_specs,
                                       params_sha256, save_safetensors)

__all__ = ["SUPPORTED_MODEL_TYPES", "decoder_from_arrays", "hf_name_map", "load_hf", "load_safetensors",
           "model_arrays", "model_config_from_hf", "param_specs", "params_sha256", "save_safetensors"]
