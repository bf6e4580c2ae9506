"""Modality encoders decoupled from the decoder: an encoder maps an input to a few vectors, a projector
trained for that encoder maps them to soft tokens the frozen decoder reads.

    from gemini_jax import encoders
    paired = encoders.load_encoder("cnn")             # encoder + its projector
    soft = paired.soft_tokens(images)                 # [N, 8, 8] pixels 0..16 -> f32[N, n, d_model]
    logits = encoders.forward_embeds(model, embeds)   # the decoder on embeddings, f32[T, vocab]
    prompt = gj.Prompt([gj.Image(pixels, encoder=paired), " The digit is "])  # for Engine.generate / start

`prompt` (gj.Prompt, gj.Image) resolves mixed prompts into token ids for the Engine: soft tokens are
rows of the engine's table (gemini_jax.runtime.soft).

Shipped: an image CNN ("cnn") and an MLP-mixer ("mixer"), trained on scikit-learn's digits
(experiments/train_encoders.py).
"""

import importlib

# Names load on first use (PEP 562): `gemini_jax.encoders.prompt`, which every Engine imports, must not
# pull in the encoders' own stack (safetensors for their weights, scikit-learn for the digits).
_WHERE = {
    "Encoder": "base", "ImageEncoder": "base", "validate_images": "base",
    "Projector": "projector", "ProjectorConfig": "projector", "check_pair": "projector",
    "PairedEncoder": "registry", "build_encoder": "registry", "list_encoders": "registry",
    "load_encoder": "registry", "save_paired": "registry",
    "embeds_logits": "soft", "forward_embeds": "soft", "soft_prompt": "soft",
    "Image": "prompt", "Prompt": "prompt",
}
__all__ = sorted(_WHERE)


def __getattr__(name: str):
    if name not in _WHERE:
        raise AttributeError(f"module 'gemini_jax.encoders' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gemini_jax.encoders.{_WHERE[name]}"), name)
