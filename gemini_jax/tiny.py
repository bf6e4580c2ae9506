"""The small byte-level model shipped inside the package: `gj.load_tiny()`.

Its files live in `gemini_jax/assets/tiny/`: `model.safetensors` + `config.json` (our native
names, see gemini_jax.weights), `card.json` (training config, corpus hashes, eval numbers,
and the sha256 of the weights file, checked on every load) and `corpus_manifest.json` (the
content hash of every file of the corpus it was trained and evaluated on).
"""

from __future__ import annotations

import functools
import hashlib
import json
import os

from gemini_jax.data import corpus
from gemini_jax.errors import CheckpointError

ASSET_DIR = os.path.join(os.path.dirname(os.path.abspath(__file__)), "assets", "tiny")


def sha256_file(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def card(path: str = ASSET_DIR) -> dict:
    """The model card: how it was trained and what it scores."""
    file = os.path.join(path, "card.json")
    if not os.path.exists(file):
        raise CheckpointError(f"no shipped tiny model at {path!r} (card.json missing); train one with "
                              f"`python experiments/train_tiny.py` and export it with "
                              f"`python experiments/export_tiny.py`.")
    try:
        with open(file) as fh:
            return json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file!r} is not valid JSON: {e}") from None


@functools.lru_cache(maxsize=None)
def corpus_check(path: str = ASSET_DIR) -> corpus.CorpusCheck:
    """Is this machine's standard library the corpus the shipped model was trained and evaluated
    on? (Another Python's sources make every model figure a different experiment.)"""
    file = os.path.join(path, "corpus_manifest.json")
    try:
        with open(file) as fh:
            expected = json.load(fh)
    except (OSError, json.JSONDecodeError) as e:
        raise CheckpointError(f"{file!r} cannot be read ({e}); re-export with experiments/export_tiny.py.") from None
    return corpus.check(expected)


def available(path: str = ASSET_DIR) -> bool:
    return os.path.exists(os.path.join(path, "card.json"))


def load_tiny(path: str = ASSET_DIR):
    """Load the shipped model after checking its weights against the card's sha256."""
    from gemini_jax.weights import load_safetensors

    info = card(path)
    weights = os.path.join(path, "model.safetensors")
    if not os.path.exists(weights):
        raise CheckpointError(f"{weights!r} is missing.")
    digest = sha256_file(weights)
    if digest != info.get("weights_sha256"):
        raise CheckpointError(f"{weights!r} has sha256 {digest[:16]}…, but card.json records "
                              f"{str(info.get('weights_sha256'))[:16]}…: the file is corrupt or from "
                              f"another model. Re-export it with experiments/export_tiny.py.")
    return load_safetensors(path)


def load_tiny_ruler():
    """The shipped model trained further on the RULER-style task mix (gemini_jax.data.ruler), from
    `gemini_jax/assets/tiny_ruler/` (its card: training config, step, evaluation), weights checked."""
    return load_tiny(os.path.join(os.path.dirname(ASSET_DIR), "tiny_ruler"))
