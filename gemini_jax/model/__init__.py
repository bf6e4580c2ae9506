"""The decoder (Flax NNX) and its pure building blocks."""

from gemini_jax.model.decoder import (Decoder, KVBackend, forward, layer_param_shapes,
                                      self_attention_backend, unstack_layers, validate_tokens)

__all__ = ["Decoder", "KVBackend", "forward", "layer_param_shapes", "self_attention_backend",
           "unstack_layers", "validate_tokens"]
