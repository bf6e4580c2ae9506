"""Modality encoders decoupled from the decoder: an encoder maps an input to a few vectors, a projector
trained for that encoder maps them to soft tokens the frozen decoder reads.

    from gemini_jax import encoders
    paired = encoders.load_encoder("cnn")             # encoder + its projector
    soft = paired.soft_tokens(images)                 # [N, 8, 8] pixels 0..16 -> f32[N, n, d_model]
    logits = encoders.forward_embeds(model, embeds)   # the decoder on embeddings, f32[T, vocab]

Shipped: an image CNN ("cnn") and an MLP-mixer ("mixer"), trained on scikit-learn's digits
(experiments/train_encoders.py).
"""

from gemini_jax.encoders.base import Encoder, ImageEncoder, validate_images
from gemini_jax.encoders.projector import Projector, ProjectorConfig, check_pair
from gemini_jax.encoders.registry import PairedEncoder, build_encoder, list_encoders, load_encoder, save_paired
from gemini_jax.encoders.soft import embeds_logits, forward_embeds, soft_prompt

__all__ = ["Encoder", "ImageEncoder", "PairedEncoder", "Projector", "ProjectorConfig", "build_encoder",
           "check_pair", "embeds_logits", "forward_embeds", "list_encoders", "load_encoder", "save_paired",
           "soft_prompt", "validate_images"]
