"""The default evaluation text: the held-out split of this machine's standard library, checked
against the corpus the shipped model was trained and evaluated on."""

from __future__ import annotations

import warnings

import numpy as np

from gemini_jax import tiny
from gemini_jax.data import corpus


class CorpusMismatch(UserWarning):
    """This machine's standard library is not the corpus the shipped model's figures came from."""


def heldout_text() -> np.ndarray:
    """uint8 bytes of the held-out split. Warns (`CorpusMismatch`, once per caller) when this
    Python's sources differ from the shipped model's corpus: figures on them are another experiment
    (result records say which corpus they used, `gemini_jax.eval.record`)."""
    check = tiny.corpus_check()
    if not check.matches:
        warnings.warn(check.label, CorpusMismatch, stacklevel=3)
    return corpus.load_split("heldout")[1]
