"""Evaluation on real text: needle grids, the RULER-style suite and bits per byte, with any engine
configuration.

Submodules not re-exported here: `studies` (the workloads `experiments/run.py experiment=<study>`
runs), `record` (the one result record they write) and `compare` (the sparse-vs-dense report).
"""

from gemini_jax.eval.needle import NeedleResult, is_correct, needle
from gemini_jax.eval.perplexity import perplexity, unigram_bits_per_byte
from gemini_jax.eval.recall import RecallSetting, digest_recall
from gemini_jax.eval.ruler import RulerResult, ruler
from gemini_jax.eval.report import write_needle

__all__ = ["NeedleResult", "RecallSetting", "RulerResult", "digest_recall", "is_correct", "needle", "perplexity", "ruler",
           "unigram_bits_per_byte", "write_needle"]
