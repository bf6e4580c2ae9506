"""The decoder (Flax NNX) and its pure building blocks."""

from gemini_jax.model.decoder import Decoder, KVBackend, layer_param_shapes, self_attention_backend

__all__ = ["Decoder", "KVBackend", "layer_param_shapes", "self_attention_backend"]
