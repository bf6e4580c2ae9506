"""The shipped encoders, each with the projector trained for it, in gemini_jax/assets/encoders/<name>/:

    encoder.safetensors    the encoder's weights (with its pretraining classifier head)
    projector.safetensors  the projector's weights
    config.json            {"encoder": {"kind", ...its config}, "projector": {...its config,
                            "encoder_fingerprint", "encoder_name"}}
    card.json              how they were trained: the split, accuracies, fingerprints, the decoder's hash

`load_encoder(name)` checks that the loaded encoder's fingerprint is the one its projector (and the
card) records, so a weights file from another run cannot pass silently.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os

import jax
from flax import nnx
from safetensors.numpy import load_file, save_file

from gemini_jax.encoders.base import ImageEncoder, load_named_arrays, named_arrays
from gemini_jax.encoders.cnn import ConvConfig, ConvEncoder
from gemini_jax.encoders.mixer import MixerConfig, MixerEncoder
from gemini_jax.encoders.projector import Projector, ProjectorConfig, check_pair
from gemini_jax.errors import EncoderError

ASSET_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "encoders")
DESIGNS = {"cnn": (ConvEncoder, ConvConfig), "mixer": (MixerEncoder, MixerConfig)}


@dataclasses.dataclass(frozen=True)
class PairedEncoder:
    """An encoder and the projector trained for it (checked at construction)."""

    name: str
    encoder: ImageEncoder
    projector: Projector
    card: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self):
        check_pair(self.encoder, self.projector, self.name)

    def soft_tokens(self, images) -> jax.Array:
        """Images [8, 8] or [N, 8, 8] -> soft tokens f32[n, d_model] or [N, n, d_model]."""
        return _project(*nnx.split(self.projector), self.encoder.encode(images))


@functools.partial(jax.jit, static_argnums=0)
def _project(graphdef, state, vectors):
    return nnx.merge(graphdef, state)(vectors)


def build_encoder(kind: str, config: dict, *, seed: int = 0) -> ImageEncoder:
    """A freshly initialized encoder of design `kind` ("cnn", "mixer"). Raises EncoderError on an
    unknown design, ConfigError on a bad config field."""
    if kind not in DESIGNS:
        raise EncoderError(f"encoder design {kind!r} is unknown; known: {sorted(DESIGNS)}.")
    cls, config_cls = DESIGNS[kind]
    return cls(config_cls(**config), rngs=nnx.Rngs(seed))


def save_paired(path: str, name: str, encoder: ImageEncoder, projector: Projector, card: dict) -> None:
    """Write encoder + projector + config.json + card.json to `path` (see module doc)."""
    check_pair(encoder, projector, name)
    os.makedirs(path, exist_ok=True)
    save_file(named_arrays(encoder), os.path.join(path, "encoder.safetensors"))
    save_file(named_arrays(projector), os.path.join(path, "projector.safetensors"))
    config = {"encoder": {"kind": encoder.kind, **dataclasses.asdict(encoder.config)},
              "projector": {**dataclasses.asdict(projector.config), "encoder_fingerprint": projector.encoder_fingerprint,
                            "encoder_name": projector.encoder_name}}
    for file, data in (("config.json", config), ("card.json", card)):
        with open(os.path.join(path, file), "w") as fh:
            json.dump(data, fh, indent=1, sort_keys=True)
            fh.write("\n")


def list_encoders(root: str = ASSET_DIR) -> list[str]:
    """Names of the shipped encoders (folders of `root` holding a config.json), sorted."""
    if not os.path.isdir(root):
        return []
    return sorted(entry for entry in os.listdir(root) if os.path.exists(os.path.join(root, entry, "config.json")))


def load_encoder(name: str, root: str = ASSET_DIR) -> PairedEncoder:
    """The shipped encoder `name` with its projector.

    Raises EncoderError when `name` is not shipped (listing the known names), when a file is
    missing or does not match its config, or when the encoder's fingerprint is not the one its
    projector was trained with.
    """
    known = list_encoders(root)
    if name not in known:
        raise EncoderError(f"no encoder named {name!r}; known: {known}. Train one with "
                           f"experiments/train_encoders.py.")
    path = os.path.join(root, name)
    try:
        with open(os.path.join(path, "config.json")) as fh:
            config = json.load(fh)
        card = {}
        if os.path.exists(os.path.join(path, "card.json")):
            with open(os.path.join(path, "card.json")) as fh:
                card = json.load(fh)
        encoder_tensors = load_file(os.path.join(path, "encoder.safetensors"))
        projector_tensors = load_file(os.path.join(path, "projector.safetensors"))
    except (OSError, json.JSONDecodeError) as exc:
        raise EncoderError(f"encoder {name!r} in {path!r} cannot be read ({exc}); retrain it with "
                           f"experiments/train_encoders.py.") from exc
    # Built abstractly (shapes only) and then filled: a random initialization would be thrown away.
    encoder_config = dict(config["encoder"])
    encoder = nnx.eval_shape(lambda: build_encoder(encoder_config.pop("kind"), encoder_config))
    load_named_arrays(encoder, encoder_tensors, f"encoder {name!r}")
    projector_config = dict(config["projector"])
    fingerprint, trained_with = projector_config.pop("encoder_fingerprint"), projector_config.pop("encoder_name")
    projector = nnx.eval_shape(lambda: Projector(ProjectorConfig(**projector_config), encoder_fingerprint=fingerprint,
                                                 encoder_name=trained_with, rngs=nnx.Rngs(0)))
    load_named_arrays(projector, projector_tensors, f"projector of {name!r}")
    return PairedEncoder(name, encoder, projector, card)
