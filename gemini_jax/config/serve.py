"""The server and its scheduler (`ServeConfig`)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, Optional, get_args

from gemini_jax.config.base import is_int, require

Preempt = Literal["swap", "recompute"]
PREEMPT_MODES = get_args(Preempt)


@dataclass(frozen=True, kw_only=True)
class ServeConfig:
    """The server (`python -m gemini_jax.serve`) and its scheduler (`gemini_jax.serve.Scheduler`).

    `step_tokens`: tokens one scheduler step computes, every decoding request's next token first,
    then prefill chunks of joining requests while the budget lasts (one chunk always runs, so a
    prompt never waits on a budget smaller than `EngineConfig.prefill_chunk`). `preempt`: what
    happens to the lowest-ranked request when pages run out: `swap` copies its pages to host
    memory and back (the same bytes, so the same tokens), `recompute` frees them and prefills its
    tokens again. `pad_batch`: fill each decode call up to a power of two with scratch rows, so
    few batch shapes compile (the pooled cache; tiers run the rows as they are). `max_waiting`: requests queued beyond the running batch before new ones get 503.
    `api_keys`: a JSON file {key: {tenant, pool, per_request}} (compute units, see
    `gemini_jax.serve.quotas`); None accepts any key, with no quotas (the loopback default).
    `state_dir`: where `/snapshot` writes Orbax snapshots and the audit log lives (None: a
    temporary directory of the server's life). `session_ttl_s`: how long an interrupted request's
    state (its pages' image and logits, in host memory) waits for a resume, snapshot or delete
    before it is dropped; its snapshot on disk, if one was taken, stays (0: until deleted).
    """

    host: str = "127.0.0.1"
    port: int = 8000
    model_id: str = "gemini-jax-tiny"
    step_tokens: int = 512
    preempt: Preempt = "swap"
    max_waiting: int = 256
    pad_batch: bool = True
    api_keys: Optional[str] = None
    state_dir: Optional[str] = None
    session_ttl_s: float = 3600.0

    def __post_init__(self):
        require(is_int(self.port) and 0 <= self.port <= 65535,
                 f"serve.port={self.port!r} must be an integer in [0, 65535] (0: any free port).")
        require(isinstance(self.model_id, str) and self.model_id.strip() != "",
                 f"serve.model_id={self.model_id!r} must be a non-empty string.")
        require(is_int(self.step_tokens) and self.step_tokens >= 1,
                 f"serve.step_tokens={self.step_tokens!r} must be an integer >= 1.")
        require(self.preempt in PREEMPT_MODES, f"serve.preempt={self.preempt!r} must be one of {PREEMPT_MODES}.")
        require(is_int(self.max_waiting) and self.max_waiting >= 0,
                 f"serve.max_waiting={self.max_waiting!r} must be an integer >= 0.")
        require(isinstance(self.session_ttl_s, (int, float)) and not isinstance(self.session_ttl_s, bool)
                 and self.session_ttl_s >= 0,
                 f"serve.session_ttl_s={self.session_ttl_s!r} must be a number of seconds >= 0 (0: until deleted).")
