"""Evaluation on real text: needle grids, the RULER-style suite and bits per byte, with any engine
configuration.

Submodules not re-exported here: `studies` (the workloads `experiments/run.py experiment=<study>`
runs), `record` (the one result record they write) and `compare` (the sparse-vs-dense report).

The names below load their submodule on first use, so a job that needs one evaluation does not
import (and depend on) the others: a result record lists the code its job ran
(`record.code_files`), and a change to one suite should not make another's figures stale.
"""

import importlib

_HOME = {"NeedleResult": "needle", "is_correct": "needle", "needle": "needle",
         "perplexity": "perplexity", "unigram_bits_per_byte": "perplexity",
         "RecallSetting": "recall", "digest_recall": "recall",
         "RulerResult": "ruler", "ruler": "ruler", "write_needle": "report"}

__all__ = sorted(_HOME)


def __getattr__(name: str):
    if name not in _HOME:
        raise AttributeError(f"module 'gemini_jax.eval' has no attribute {name!r}")
    return getattr(importlib.import_module(f"gemini_jax.eval.{_HOME[name]}"), name)
