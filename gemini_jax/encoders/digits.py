"""The digits the image encoders learn from: scikit-learn's `load_digits` (1,797 8x8 grey images,
pixels 0..16, labels 0..9), with the one fixed train / held-out split every figure uses.

The split is stratified and seeded: within each digit, a permutation drawn by
`numpy.random.default_rng([SPLIT_SEED, digit])` puts the first round(HELDOUT_FRACTION * count) images
in the held-out set. Nothing is trained or tuned on the held-out images.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from gemini_jax.errors import ConfigError

SPLIT_SEED = 20240
HELDOUT_FRACTION = 0.2


@dataclasses.dataclass(frozen=True)
class Digits:
    images: np.ndarray   # float32 [N, 8, 8], grey levels 0..16
    labels: np.ndarray   # int32 [N], 0..9

    def subset(self, rows: np.ndarray) -> Digits:
        return Digits(self.images[rows], self.labels[rows])

    def __len__(self) -> int:
        return len(self.labels)


def load() -> Digits:
    """All 1,797 images of `sklearn.datasets.load_digits` (shipped with scikit-learn, no download).

    Raises ConfigError when scikit-learn is missing.
    """
    try:
        from sklearn.datasets import load_digits
    except ImportError as exc:
        raise ConfigError("the digits data needs scikit-learn, which is not installed: "
                          "pip install 'gemini_jax[vision]'.") from exc
    data = load_digits()
    return Digits(data.images.astype(np.float32), data.target.astype(np.int32))


def split(labels: np.ndarray, *, seed: int = SPLIT_SEED,
          heldout_fraction: float = HELDOUT_FRACTION) -> tuple[np.ndarray, np.ndarray]:
    """(train rows, held-out rows), sorted int arrays, disjoint, covering every row (see module doc).

    Raises ConfigError unless 0 < heldout_fraction < 1.
    """
    if not 0 < heldout_fraction < 1:
        raise ConfigError(f"heldout_fraction={heldout_fraction!r} must lie strictly between 0 and 1.")
    labels = np.asarray(labels)
    heldout = []
    for digit in np.unique(labels):
        rows = np.flatnonzero(labels == digit)
        order = np.random.default_rng([seed, int(digit)]).permutation(len(rows))
        heldout.append(rows[order[:round(heldout_fraction * len(rows))]])
    held = np.sort(np.concatenate(heldout))
    return np.setdiff1d(np.arange(len(labels)), held), held
