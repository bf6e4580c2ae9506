"""Prompts that mix text with encoder outputs.

    enc = gj.load_encoder("cnn")
    prompt = gj.Prompt([gj.Image(pixels, encoder=enc), " The digit is "])
    out = engine.generate(prompt, gj.SamplingParams(max_new_tokens=2, temperature=0.0))

A part is text (encoded by the prompt's tokenizer: bytes for the shipped byte-level model), token ids
(a list or 1-D array), or an `Image` with the encoder (and its projector) that reads it. `Engine`
resolves a prompt into token ids: text ids as they are, an image as the ids of its soft tokens in the
engine's soft-token table (gemini_jax.runtime.soft), keyed by the image's content hash and the
encoder's and projector's fingerprints. The same image through the same encoder is one run of ids, so
its pages are shared like a text prefix's; anything else gets ids of its own.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from gemini_jax.errors import EncoderError, TokenError
from gemini_jax.tokenizer import ByteTokenizer


@dataclass(frozen=True, eq=False)
class Image:
    """One image and the encoder that reads it (`gj.load_encoder(name)`: an encoder with its projector)."""

    pixels: Any
    encoder: Any

    def fingerprints(self) -> dict:
        """{"encoder", "encoder_fingerprint", "projector_fingerprint"} of the encoder that reads it."""
        from gemini_jax.encoders.base import fingerprint_of  # the encoders' stack loads only for images

        paired = self.encoder
        if not hasattr(paired, "soft_tokens") or not hasattr(paired, "projector"):
            raise EncoderError(f"Image(encoder=...) takes an encoder with its projector (gj.load_encoder(name)); "
                               f"got {type(paired).__name__}.")
        return {"encoder": paired.name, "encoder_fingerprint": paired.encoder.fingerprint,
                "projector_fingerprint": fingerprint_of(paired.projector, paired.projector.config)}

    def soft(self, width: int) -> tuple[str, np.ndarray, dict]:
        """(content key, soft tokens f32[n, width], source) for this image; EncoderError when the
        pixels are not one image or the projector does not give `width`-wide vectors."""
        from gemini_jax.encoders.base import validate_images

        paired = self.encoder
        marks = self.fingerprints()
        pixels, single = validate_images(self.pixels)
        if not single:
            raise EncoderError(f"an Image holds one image [8, 8]; got {pixels.shape[0]} (give one Image per image).")
        source = {"modality": paired.encoder.modality, **marks,
                  "content_sha256": hashlib.sha256(np.ascontiguousarray(pixels, np.float32).tobytes()).hexdigest()}
        key = hashlib.sha256("|".join(source[k] for k in sorted(source)).encode()).hexdigest()
        vectors = np.asarray(paired.soft_tokens(self.pixels), np.float32)
        if vectors.ndim != 2 or vectors.shape[1] != width:
            raise EncoderError(f"encoder {paired.name!r} gives soft tokens {list(vectors.shape)}; this model reads "
                               f"[n, {width}] (its hidden size): the projector was trained for another decoder.")
        return key, vectors, source


class Prompt:
    """Text, token ids and images, in order. `add_bos`: the model's BOS first (the shipped model's
    prompts start with it). `tokenizer`: encodes the text parts (default: bytes, for byte-level
    models)."""

    def __init__(self, parts: Sequence, *, add_bos: bool = True, tokenizer=None):
        if isinstance(parts, (str, Image)):
            parts = [parts]
        self.parts = list(parts)
        if not self.parts:
            raise TokenError("a Prompt needs at least one part (text, token ids or an Image).")
        for i, p in enumerate(self.parts):
            if not isinstance(p, (str, Image, list, tuple, np.ndarray)):
                raise TokenError(f"Prompt part {i} is a {type(p).__name__}; give text, token ids or gj.Image(...).")
        self.add_bos = add_bos
        self.tokenizer = tokenizer

    def resolve(self, model_cfg, table) -> np.ndarray:
        """Token ids i32[T]: text encoded, images registered in the soft-token `table`."""
        tok = self.tokenizer
        if tok is None and any(isinstance(p, str) for p in self.parts):
            if model_cfg.vocab_size < 256:
                raise TokenError(f"text parts need a tokenizer for a {model_cfg.vocab_size}-token vocabulary "
                                 f"(Prompt(..., tokenizer=gj.HFTokenizer(path))).")
            tok = ByteTokenizer()
        ids = [np.asarray([model_cfg.bos_id], np.int32)] if self.add_bos else []
        for i, p in enumerate(self.parts):
            if isinstance(p, str):
                ids.append(np.asarray(tok.encode(p), np.int32))
            elif isinstance(p, Image):
                ids.append(table.add(*p.soft(model_cfg.hidden_size)))
            else:
                arr = np.asarray(p)
                if arr.ndim != 1 or not np.issubdtype(arr.dtype, np.integer):
                    raise TokenError(f"Prompt part {i}: token ids must be a 1-D integer sequence; got shape "
                                     f"{list(arr.shape)}, dtype {arr.dtype}.")
                bad = np.flatnonzero((arr < 0) | (arr >= model_cfg.vocab_size))
                if bad.size:
                    raise TokenError(f"Prompt part {i}: id {int(arr[bad[0]])} is outside the vocabulary "
                                     f"[0, {model_cfg.vocab_size}).")
                ids.append(arr.astype(np.int32))
        out = np.concatenate(ids) if ids else np.zeros(0, np.int32)
        if not len(out):
            raise TokenError("the Prompt resolves to no tokens.")
        return out


def check_encoders(prompt, used: list[dict], where: str) -> None:
    """EncoderError when an image of `prompt` is read by an encoder that `used` (soft-token sources
    already in a context) names with other fingerprints: one context, one version of each encoder."""
    if not isinstance(prompt, Prompt):
        return
    for part in prompt.parts:
        if not isinstance(part, Image):
            continue
        mine = part.fingerprints()
        for src in used:
            if src.get("encoder") == mine["encoder"]:
                for k in ("encoder_fingerprint", "projector_fingerprint"):
                    if src.get(k) != mine[k]:
                        raise EncoderError(
                            f"{where} read encoder {mine['encoder']!r} with {k.replace('_', ' ')} {src.get(k, '?')[:16]}…; "
                            f"this prompt's has {mine[k][:16]}…. Use the encoder and projector the context was built "
                            f"with, or start a new session.")
