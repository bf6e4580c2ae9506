"""The executor: runs a `StepPlan` on the engine's runner and returns a `StepOutput`.

It decides nothing about requests. What it owns is how a planned call reaches the device: the
rows' tokens, lengths and sampling keys as arrays, and padding the decode batch to a power of two
with a scratch sequence (`ServeConfig.pad_batch`), so batch sizes 1..max_batch compile
log2(max_batch) + 1 programs instead of max_batch.
"""

from __future__ import annotations

from typing import Optional

import numpy as np

from gemini_jax.runtime import driver
from gemini_jax.serve.plan import DecodeWork, StepOutput, StepPlan


class Executor:
    """Over `runner` (an engine runner: `decode`, `decode_many`, `prefill_piece`) and `seqs` (the
    engine's `SequenceCache`, for the rows' lengths and the padding scratch)."""

    def __init__(self, runner, seqs, *, pad_batch: bool, steps_per_call: int, eos_id: Optional[int]):
        self.runner, self.seqs = runner, seqs
        self.pad_batch, self.steps_per_call, self.eos_id = pad_batch, steps_per_call, eos_id

    @property
    def multistep(self) -> bool:
        """Whether the runner has a k-step decode program."""
        return bool(self.runner.multistep)

    def run(self, plan: StepPlan) -> StepOutput:
        if plan.prefill is not None:
            w = plan.prefill
            padded, pos, n = w.piece
            return StepOutput(logits=np.asarray(self.runner.prefill_piece(w.request.seq_id, padded, pos, n)))
        return self._decode(plan.decode)

    def _decode(self, work: DecodeWork) -> StepOutput:
        rows = work.rows
        ids = [r.seq_id for r in rows]
        lengths = [self.seqs.num_tokens(s) for s in ids]
        tokens = [r.pending for r in rows]
        pad_sid = self._pad_rows(ids, tokens, lengths, work.steps)
        pad = len(ids) - len(rows)
        try:
            if work.steps == 1:
                logits = self.runner.decode(np.asarray(tokens, np.int32), np.asarray(lengths, np.int32), ids, pad=pad)
                return StepOutput(logits=np.asarray(logits)[:len(rows)])
            params = rows[0].params  # a k-step call's rows share their sampling parameters (planned so)
            done = np.zeros(len(ids), bool)
            done[len(rows):] = True  # padding rows never hold the loop
            spec = driver.loop_spec(params, self.steps_per_call, self.eos_id)
            inputs = driver.loop_inputs(tokens, lengths, [r.sample_index for r in rows] + [0] * pad, params, done,
                                        work.steps)
            out = self.runner.decode_many(inputs, spec, ids=ids, pad=pad)
            return StepOutput(tokens=np.asarray(out.tokens)[:len(rows)], steps=int(out.steps))
        finally:
            if pad_sid is not None:
                self.seqs.release(pad_sid)

    def _pad_rows(self, ids: list, tokens: list, lengths: list, steps: int) -> Optional[int]:
        """Fill the batch up to a power of two with rows of a scratch sequence (one page per
        `block_size` steps, position 0) that the real rows never read. Returns its id (freed after
        the call), or None: no padding (`pad_batch` off, tiers, a batch already a power of two, or
        no page left once the real rows hold theirs)."""
        n = len(ids)
        target = 1 << (n - 1).bit_length()
        pages = -(-steps // self.seqs.block_size)
        if not self.pad_batch or target == n or not self.seqs.pads_rows or not self.seqs.can_admit(pages):
            return None
        sid = self.seqs.open_scratch(steps)
        ids += [sid] * (target - n)
        tokens += [0] * (target - n)
        lengths += [0] * (target - n)
        return sid
