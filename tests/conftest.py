"""Shared test setup. Tests run on CPU unless JAX_PLATFORMS says otherwise (set before jax loads)."""

import os

os.environ.setdefault("JAX_PLATFORMS", "cpu")
