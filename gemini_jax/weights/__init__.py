"""Weights in and out: Hugging Face checkpoints (config.json + safetensors, single or sharded),
GGUF files (llama.cpp's format, dequantized on load), pretrained models by name, and our own native
checkpoints (flat `layers.wq`-style names + a ModelConfig config.json)."""

from gemini_jax.weights.gguf import (decoder_from_gguf, dequantize, gguf_name_map, load_gguf,
                                     model_config_from_gguf)
from gemini_jax.weights.hf import hf_name_map, load_hf
from gemini_jax.weights.hf_config import SUPPORTED_MODEL_TYPES, model_config_from_hf
from gemini_jax.weights.native import (decoder_from_arrays, load_safetensors, model_arrays, param_specs,
                                       params_sha256, save_safetensors)
from gemini_jax.weights.pretrained import PRETRAINED, list_pretrained, load_pretrained, pretrained_path

__all__ = ["PRETRAINED", "SUPPORTED_MODEL_TYPES", "decoder_from_arrays", "decoder_from_gguf", "dequantize",
           "gguf_name_map", "hf_name_map", "list_pretrained", "load_gguf", "load_hf", "load_pretrained",
           "load_safetensors", "model_arrays", "model_config_from_gguf", "model_config_from_hf", "param_specs",
           "params_sha256", "pretrained_path", "save_safetensors"]
