"""Evaluation on real text: needle grids, the RULER-style suite and bits per byte, with any engine
configuration.

Re-exported here: the needle grid, bits per byte, digest recall and the needle report. Submodules
not re-exported: `ruler` (the RULER-style suite: `from gemini_jax.eval.ruler import ruler`; kept
out so that a job which does not run the suite does not import, and depend on, its code: a result
record lists the code its job ran, `record.code_files`), `studies` (the workloads
`experiments/run.py experiment=<study>` runs) and `record` (the one result record they write).
"""

from gemini_jax.eval.needle import NeedleResult, is_correct, needle
from gemini_jax.eval.perplexity import perplexity, unigram_bits_per_byte
from gemini_jax.eval.recall import RecallSetting, digest_recall
from gemini_jax.eval.report import write_needle

__all__ = ["NeedleResult", "RecallSetting", "digest_recall", "is_correct", "needle", "perplexity",
           "unigram_bits_per_byte", "write_needle"]
