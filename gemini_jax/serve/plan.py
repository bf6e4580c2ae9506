"""One device call of a scheduler step, as the scheduler plans it and as the executor returns it.

    plan = sched.plan_decode()            # rows, tokens per row; pages allocated, preemptions made
    out = executor.run(plan)              # the runner's call, padding included
    sched.update(plan, out)               # sample, send, finish, count

The scheduler decides (who runs, how many tokens, which pages, whom to preempt); the executor
(`serve.executor.Executor`, over the engine's runner) only runs what it is given; the scheduler
then changes its requests from the output alone. Policy can so be driven against a fake executor.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np

from gemini_jax.serve.request import Request


@dataclass(frozen=True)
class DecodeWork:
    """Rows that decode in one call, best first, each holding page slots for `steps` tokens."""

    rows: tuple[Request, ...]
    steps: int  # tokens per row: 1, or up to `decode_steps_per_call` in one k-step program


@dataclass(frozen=True)
class PrefillWork:
    """One prefill chunk of one request (`chunking.prefill_pieces`: padded tokens, positions, n)."""

    request: Request
    piece: tuple

    @property
    def tokens(self) -> int:
        return int(self.piece[2])


@dataclass(frozen=True)
class StepPlan:
    """What one device call runs: decode rows or one prefill chunk, and the requests preempted
    while planning it (their pages went back to the pool before the call)."""

    decode: Optional[DecodeWork] = None
    prefill: Optional[PrefillWork] = None
    preempted: tuple[Request, ...] = ()

    def __post_init__(self):
        if (self.decode is None) == (self.prefill is None):
            raise ValueError("a StepPlan runs decode rows or one prefill chunk, exactly one of them.")


@dataclass(frozen=True)
class StepOutput:
    """What the call returned: next-token logits f32[rows, V] (a one-token decode, or the logits
    after a prefill chunk), or the tokens a k-step decode sampled i32[rows, steps], and the steps
    it ran (a k-step call stops early when every row is done)."""

    logits: Optional[np.ndarray] = None
    tokens: Optional[np.ndarray] = None
    steps: int = 1
