"""Helpers for `experiments/bench.py`: the row registry, side-by-side timing, the machine
description and bandwidth probe, the shared benchmark model, and the decode-step harness.

Rows live in `gemini_jax/bench/rows/`, one module per row; importing `gemini_jax.bench.rows` registers them.
"""
