"""The projector: an encoder's vectors -> the decoder's hidden size, one soft token per vector.

It is the only part trained against the decoder (which stays frozen), and it belongs to one encoder:
it records that encoder's fingerprint, and `check_pair` refuses any other.

    f32[..., n, d_enc] -> Linear hidden, gelu -> Linear d_model -> f32[..., n, d_model]
"""

from __future__ import annotations

import dataclasses

import jax
from flax import nnx

from gemini_jax.encoders.base import Encoder
from gemini_jax.errors import ConfigError, EncoderError


@dataclasses.dataclass(frozen=True, kw_only=True)
class ProjectorConfig:
    """Widths: `d_enc` in (the encoder's), `hidden`, `d_model` out (the decoder's hidden size)."""

    d_enc: int
    d_model: int
    hidden: int = 256

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value = getattr(self, field.name)
            if not isinstance(value, int) or value <= 0:
                raise ConfigError(f"ProjectorConfig.{field.name}={value!r} must be a positive int.")


class Projector(nnx.Module):
    """Trained for the encoder whose fingerprint is `encoder_fingerprint` (named `encoder_name`)."""

    def __init__(self, config: ProjectorConfig, *, encoder_fingerprint: str, encoder_name: str, rngs: nnx.Rngs):
        self.config = config
        self.encoder_fingerprint = encoder_fingerprint
        self.encoder_name = encoder_name
        self.inner = nnx.Linear(config.d_enc, config.hidden, rngs=rngs)
        self.out = nnx.Linear(config.hidden, config.d_model, rngs=rngs)

    def __call__(self, vectors: jax.Array) -> jax.Array:  # f32[..., n, d_enc] -> f32[..., n, d_model]
        return self.out(jax.nn.gelu(self.inner(vectors)))


def check_pair(encoder: Encoder, projector: Projector, encoder_name: str = "?") -> None:
    """Raise EncoderError, naming both encoders and fingerprints, unless `projector` was trained with
    `encoder` (same fingerprint: same weights and config) and takes its width."""
    if projector.encoder_fingerprint != encoder.fingerprint:
        raise EncoderError(
            f"projector trained with encoder {projector.encoder_name!r} (fingerprint "
            f"{projector.encoder_fingerprint[:16]}…) cannot take the vectors of encoder {encoder_name!r} "
            f"(fingerprint {encoder.fingerprint[:16]}…); load the projector shipped with {encoder_name!r} "
            f"(gemini_jax.encoders.load_encoder) or train one for it.")
    if projector.config.d_enc != encoder.d_enc:  # same fingerprint yet another width: files tampered with
        raise EncoderError(f"projector takes d_enc={projector.config.d_enc}, encoder {encoder_name!r} gives "
                           f"{encoder.d_enc}.")
