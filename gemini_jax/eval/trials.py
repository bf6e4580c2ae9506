"""Trial splits: knobs are chosen on `dev` trials, reported figures come from `test` trials.

Every seeded trial (a needle prompt, a text window) draws its randomness from
`Draw(split, seed).rng(*index)`. The two splits are disjoint streams of numpy's SeedSequence:

- `dev`  -> `default_rng([seed, *index])`: the derivation every grid before the split used, so
  the trials the shipped presets were tuned on are dev trials, reproducible as they were.
- `test` -> `default_rng([TEST_STREAM, seed, *index])`: a different entropy list, hence a stream
  no dev trial shares.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from gemini_jax.errors import ConfigError

SPLITS = ("dev", "test")
TEST_STREAM = 0x7E57  # the test stream's first entropy word; dev trials never start with it


@dataclass(frozen=True)
class Draw:
    """Which trials to draw: the split and the base seed the per-trial seeds derive from."""

    split: str = "dev"
    seed: int = 0

    def __post_init__(self):
        if self.split not in SPLITS:
            raise ConfigError(f"split={self.split!r} must be one of {SPLITS} (dev: choose knobs; test: report).")
        if not isinstance(self.seed, (int, np.integer)) or self.seed < 0:
            raise ConfigError(f"seed={self.seed!r} must be a non-negative integer.")

    def rng(self, *index: int) -> np.random.Generator:
        """The generator of the trial at `index` (e.g. length, depth, trial number)."""
        head = [int(self.seed)] if self.split == "dev" else [TEST_STREAM, int(self.seed)]
        return np.random.default_rng(head + [int(i) for i in index])
