"""One request as the scheduler sees it: what was asked, where it stands, what it has produced.

A request moves WAITING -> PREFILL -> DECODE -> FINISHED; preemption sends it back to WAITING
(holding its pages' image in swap mode, or nothing in recompute mode) and it comes back where it
left. At every step boundary a decoding request holds a `pending` token: chosen and already sent
to its client, its KV not written yet (the next decode call writes it and returns the logits the
following token is sampled from), which is the engine's own loop, one token at a time.
"""

from __future__ import annotations

import enum
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Callable, Optional

import numpy as np

from gemini_jax.config import SamplingParams
from gemini_jax.runtime import driver
from gemini_jax.runtime.images import SequenceImage


class Phase(enum.Enum):
    WAITING = "waiting"
    PREFILL = "prefill"
    DECODE = "decode"
    FINISHED = "finished"


# Why a request ended (OpenAI's finish_reason where one exists).
FINISH_REASONS = ("stop", "length", "cancelled", "interrupted", "error")


@dataclass(eq=False)
class Request:
    """`tokens`: the sequence's prompt (and, for a resumed session, what came before it); the
    scheduler appends each generated token. `sink(request, token)` is called from the scheduler's
    thread with each new token, then once with None when the request ends (`finish_reason` set).
    `priority`: lower runs first; equal priorities run first come, first served."""

    rid: str
    tokens: list
    params: SamplingParams
    priority: int = 0
    tenant: str = ""
    sink: Optional[Callable] = None
    sample_index: int = 0  # which PRNG stream the sampler draws from (0: as a solo `generate`)
    prompt_len: int = 0  # tokens before the first generated one (set on submit)
    # ---- scheduler state (the scheduler's thread alone writes these) ----
    phase: Phase = Phase.WAITING
    arrival: int = 0
    seq_id: Optional[int] = None
    generated: list = field(default_factory=list)
    pending: Optional[int] = None  # sent to the client, KV not written yet
    pieces: deque = field(default_factory=deque)  # prefill chunks left (chunking.prefill_pieces items)
    image: Optional[SequenceImage] = None  # the pages while preempted (swap mode) or once interrupted
    logits: Optional[np.ndarray] = None  # f32[V] after the last written token (kept by an interrupt)
    # A resumed session's turn: `image` holds the earlier turn's pages, `tokens` = its first `keep`
    # tokens + the instruction; `rewind` recomputes token keep-1 as `Engine.resume(rewind_to=keep)` does.
    resume: Optional[tuple] = None  # (keep, rewind)
    finish_reason: Optional[str] = None
    error: Optional[str] = None
    compute_units: int = 0
    preemptions: int = 0
    # ---- requests from other threads, applied at the next step boundary ----
    cancel_requested: bool = False
    interrupt_requested: bool = False
    # ---- times (time.perf_counter) for latency metrics ----
    t_arrival: float = field(default_factory=time.perf_counter)
    t_first: Optional[float] = None
    t_last: Optional[float] = None

    @property
    def rank(self) -> tuple:
        """Sort key: the smallest runs first and is preempted last."""
        return (self.priority, self.arrival)

    @property
    def new_tokens(self) -> int:
        return len(self.generated)

    @property
    def finished(self) -> bool:
        return self.phase is Phase.FINISHED

    def wants_more(self, eos_id: Optional[int]) -> bool:
        """After a token was added: may another follow?"""
        if self.new_tokens >= self.params.max_new_tokens:
            return False
        return not (self.generated and driver.is_stop(self.params, eos_id, self.generated[-1]))

    def prompt_array(self) -> np.ndarray:
        return np.asarray(self.tokens, np.int32)
