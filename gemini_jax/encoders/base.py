"""What every modality encoder offers the decoder, and the checks on image inputs.

An encoder turns one input (here an 8x8 grey image) into `n_vectors` vectors of width `d_enc`. It knows
nothing of the decoder: a `Projector` (gemini_jax.encoders.projector), trained for one encoder, maps
those vectors to the decoder's hidden size. So swapping the encoder needs no change to the decoder,
only a projector trained for the new one; the encoder's `fingerprint` is how a projector knows whom it
was trained with.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import json
from typing import Protocol, runtime_checkable

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.errors import EncoderError

IMAGE_SHAPE = (8, 8)   # scikit-learn's load_digits: 8x8 pixels
MAX_PIXEL = 16.0       # ... each an integer grey level 0..16


@runtime_checkable
class Encoder(Protocol):
    """The interface the rest of the package relies on."""

    modality: str      # "image"
    d_enc: int         # width of each output vector
    n_vectors: int     # vectors per input

    @property
    def fingerprint(self) -> str: ...  # sha256 hex of the weights and the config

    def encode(self, inputs) -> jax.Array: ...  # one input -> f32[n_vectors, d_enc]; a batch -> [N, n, d_enc]


def validate_images(images) -> tuple[np.ndarray, bool]:
    """Check images and scale them to 0..1: (float32 [N, 8, 8], whether one [8, 8] image was given).

    Accepts integer or float pixels in 0..16 (load_digits' grey levels), shaped [8, 8] or [N, 8, 8]
    with N >= 1. Raises EncoderError naming the shape, dtype or first bad value otherwise.
    """
    arr = np.asarray(images)
    if not (np.issubdtype(arr.dtype, np.integer) or np.issubdtype(arr.dtype, np.floating)):
        raise EncoderError(f"images must hold integer or float pixels 0..{MAX_PIXEL:g}; got dtype {arr.dtype}.")
    single = arr.ndim == 2
    if single:
        arr = arr[None]
    if arr.ndim != 3 or arr.shape[1:] != IMAGE_SHAPE or arr.shape[0] == 0:
        raise EncoderError(f"images must be shaped {list(IMAGE_SHAPE)} or [N, {IMAGE_SHAPE[0]}, {IMAGE_SHAPE[1]}] "
                           f"with N >= 1; got shape {list(np.asarray(images).shape)}.")
    values = arr.astype(np.float64)
    bad = np.flatnonzero(~np.isfinite(values) | (values < 0) | (values > MAX_PIXEL))
    if bad.size:
        where = np.unravel_index(int(bad[0]), arr.shape)
        raise EncoderError(f"image pixels must lie in 0..{MAX_PIXEL:g} (load_digits' grey levels); pixel "
                           f"{list(map(int, where))} is {float(values[where])!r} ({bad.size} bad pixel(s) in all).")
    return (values / MAX_PIXEL).astype(np.float32), single


def named_arrays(module: nnx.Module) -> dict[str, np.ndarray]:
    """A module's parameters as float32 arrays keyed by their dotted path (the safetensors names)."""
    return {".".join(map(str, path)): np.asarray(value[...], np.float32)
            for path, value in nnx.to_flat_state(nnx.state(module, nnx.Param))}


def load_named_arrays(module: nnx.Module, tensors: dict[str, np.ndarray], where: str) -> None:
    """Write `tensors` (as from `named_arrays`) into `module`'s parameters, in place.

    Raises EncoderError naming the first missing, extra or mis-shaped tensor (files from another run).
    """
    params = dict(nnx.to_flat_state(nnx.state(module, nnx.Param)))
    names = {".".join(map(str, path)): path for path in params}
    if set(names) != set(tensors):
        raise EncoderError(f"{where}: tensors {sorted(set(tensors) ^ set(names))} do not match the module's "
                           f"parameters; its weights and config.json are from different runs.")
    for name, path in names.items():
        if tuple(tensors[name].shape) != tuple(params[path].shape):
            raise EncoderError(f"{where}: {name} is {list(tensors[name].shape)}, the config makes it "
                               f"{list(params[path].shape)}; its weights and config.json are from different runs.")
        params[path].set_value(jnp.asarray(tensors[name]))  # also fills an nnx.eval_shape module


def fingerprint_of(module: nnx.Module, config) -> str:
    """sha256 hex over the config (as sorted JSON) and every parameter (name, shape, float32 bytes)."""
    digest = hashlib.sha256(json.dumps(dataclasses.asdict(config), sort_keys=True).encode())
    for name, value in sorted(named_arrays(module).items()):
        digest.update(f"{name}:{list(value.shape)}".encode())
        digest.update(np.ascontiguousarray(value).tobytes())
    return digest.hexdigest()


class ImageEncoder(nnx.Module):
    """Base of the image encoders: input checks, a jitted encode, the fingerprint and a classifier head.

    Subclasses set `config` (a frozen dataclass with `d_enc` and `n_vectors`), `head` (Linear d_enc -> 10,
    used only to pretrain the encoder as a classifier) and implement `__call__`:
    f32[N, 8, 8] in 0..1 -> f32[N, n_vectors, d_enc].
    """

    modality = "image"
    kind = ""  # the registry's name for the design ("cnn", "mixer")

    @property
    def d_enc(self) -> int:
        return self.config.d_enc

    @property
    def n_vectors(self) -> int:
        return self.config.n_vectors

    @property
    def fingerprint(self) -> str:
        return fingerprint_of(self, self.config)

    def classify_logits(self, x: jax.Array) -> jax.Array:
        """f32[N, 8, 8] in 0..1 -> class logits f32[N, 10] from the mean of the output vectors."""
        return self.head(self(x).mean(axis=1))

    def encode(self, images) -> jax.Array:
        """Images [8, 8] or [N, 8, 8] (pixels 0..16) -> f32[n_vectors, d_enc] or [N, n_vectors, d_enc].

        Raises EncoderError on a wrong shape, dtype or pixel value (see `validate_images`).
        """
        x, single = validate_images(images)
        out = _encode_jit(*nnx.split(self), jnp.asarray(x))
        return out[0] if single else out

    def classify(self, images) -> np.ndarray:
        """Predicted digits int[N] (or a scalar for one image) from the pretraining head."""
        x, single = validate_images(images)
        pred = np.asarray(_classify_jit(*nnx.split(self), jnp.asarray(x)).argmax(-1))
        return pred[0] if single else pred


@functools.partial(jax.jit, static_argnums=0)
def _encode_jit(graphdef, state, x):
    return nnx.merge(graphdef, state)(x)


@functools.partial(jax.jit, static_argnums=0)
def _classify_jit(graphdef, state, x):
    return nnx.merge(graphdef, state).classify_logits(x)
