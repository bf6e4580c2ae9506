"""Interruptible decoding: a `Session` yields tokens one by one and can stop at any boundary.

State kept between tokens: the sequence's pages (KV of every token so far), the logits for the
next token, and the sampler's position. Tokens are written eagerly (a token's KV is computed
right after it is sampled), so at every boundary the state is complete: a snapshot taken there
restores exactly, and a new instruction only needs its own tokens prefilled.

With `decode_steps_per_call` k > 1 one device program computes up to k tokens ahead
(`runtime.multistep`); the session still yields them one by one and commits each token's KV to
the page manager as it yields it. Stopping between (interrupt, snapshot, a new instruction)
drops the tokens computed ahead: they were never committed, and their slots in the pages are
written again by the next token, so the state is exactly the one at the last yielded token.
"""

from __future__ import annotations

import threading
from typing import Optional

import jax.numpy as jnp
import numpy as np

from gemini_jax.config import SamplingParams, compat
from gemini_jax.errors import BudgetExceeded, ContextLengthError
from gemini_jax.runtime import driver, new_stats
from gemini_jax.session import snapshot


class Session:
    """One sequence being decoded. Iterate for tokens; `interrupt()` from any thread stops
    the iteration at the next token boundary; `snapshot(path)` saves it; `close()` frees it."""

    def __init__(self, engine, params: SamplingParams, *, budget: Optional[int] = None, sample_index: int = 0):
        compat.check_use("sessions", engine.config)
        self.engine = engine
        self.params = params
        self.budget = budget
        self.sample_index = sample_index  # which sequence's PRNG stream the sampler draws from
        self.stats = new_stats()
        self._seqs = engine.sequences
        self._runner = engine.runner(1, self.stats)
        self.seq_id = self._runner.ids[0]
        self.prompt_len = 0
        self.generated: list[int] = []
        self.new_tokens = 0  # tokens generated since the last prompt/instruction
        self.logits = None  # f32[1, V]: logits for the next token
        self.finished = False
        self._stop = threading.Event()
        self._on_stop = []  # callbacks run once when iteration ends (audit records): `on_stop`
        self._ahead: list = []  # (token, logits after it) computed ahead, not yet yielded
        self.soft_sources: list[dict] = []  # a restored snapshot's soft-token sources (encoders, fingerprints)

    # ---- state ------------------------------------------------------------------------------
    @property
    def tokens(self) -> list[int]:
        """Every token whose KV is in the cache (prompt, generated, instructions), in order."""
        return self._seqs.tokens(self.seq_id)

    @property
    def position(self) -> int:
        return self._seqs.num_tokens(self.seq_id)

    @property
    def compute_units(self) -> int:
        return self.stats.compute_units

    def charge(self, units: int, what: str) -> None:
        """Refuse (BudgetExceeded) work of `units` compute units that would pass the budget."""
        if self.budget is not None and self.compute_units + units > self.budget:
            raise BudgetExceeded(
                f"{what} needs {units} compute units; {self.compute_units} of the quota {self.budget} are "
                f"used. Raise the budget or shorten the request.", partial=list(self.generated))

    # ---- feeding tokens ---------------------------------------------------------------------
    def _check_room(self, n_new: int, what: str) -> None:
        need = self.position + n_new + self.params.max_new_tokens
        limit = self.engine.config.max_seq_len
        if need > limit:
            raise ContextLengthError(
                f"{what}: {self.position} tokens in the sequence + {n_new} new + max_new_tokens="
                f"{self.params.max_new_tokens} = {need} > max_seq_len={limit}.")

    def feed(self, tokens, *, what: str = "prompt") -> None:
        """Prefill `tokens` after the current end (the prompt, or an instruction)."""
        toks = self.engine.token_ids(tokens, what)
        self._settle()
        self._check_room(len(toks), what)
        self.charge(len(toks) * self.engine.model_cfg.num_layers, what)
        if self._seqs.has(self.seq_id):
            self.logits = self._runner.prefill_more(0, toks)
        else:  # the first prompt: a new sequence, sharing any cached prefix pages
            self.logits = self._runner.prefill(0, toks)
        self.new_tokens = 0
        self.finished = False

    def rewind(self, keep: int) -> None:
        """Forget every token after the first `keep` (pages after it are released)."""
        e = self.engine
        self._settle()
        if not 1 <= keep <= self.position:
            raise ValueError(f"rewind_to={keep} must be in [1, {self.position}].")
        tokens = self.tokens
        self._seqs.truncate(self.seq_id, keep - 1)
        # Recompute the last kept token: its logits predict what follows (counted, see DCU).
        self.charge(e.model_cfg.num_layers, "rewind")
        self.logits = self._runner.prefill_more(0, np.asarray(tokens[keep - 1:keep], np.int32))
        self.generated = self.generated[:max(0, keep - self.prompt_len)]
        self.new_tokens = 0
        self.finished = False

    # ---- iteration --------------------------------------------------------------------------
    def interrupt(self) -> None:
        """Stop at the next token boundary (safe from another thread or a signal handler)."""
        self._stop.set()

    @property
    def interrupted(self) -> bool:
        return self._stop.is_set()

    def __iter__(self):
        self._stop.clear()
        return self

    def __next__(self) -> int:
        cfg = self.engine.model_cfg
        if self._stop.is_set() or self.finished or self.new_tokens >= self.params.max_new_tokens:
            self._stopped()
            raise StopIteration
        pos = self.position
        if pos >= self.engine.config.max_seq_len:
            self._stopped()
            raise StopIteration
        self.charge(cfg.num_layers, "decode step")
        if not self._ahead:
            self._compute_ahead(pos)
        if self._ahead:  # computed by a k-step program: commit this token's KV as it is yielded
            tok, self.logits = self._ahead.pop(0)
            self._runner.commit(np.asarray([[tok]], np.int32))
        else:
            tok = driver.sample_one(self.params, self.logits, self.sample_index, pos)
            # Write the token's KV now, so every boundary is a complete state (see module doc).
            self.logits = self._runner.decode(np.asarray([tok], np.int32), np.asarray([pos], np.int32))
        self.stats.decode_steps += 1
        self.stats.compute_units += cfg.num_layers
        self.generated.append(tok)
        self.new_tokens += 1
        if driver.is_stop(self.params, cfg.eos_id, tok):
            self.finished = True
        return tok

    def _compute_ahead(self, pos: int) -> None:
        """Fill `_ahead` with up to k tokens from one program (nothing when k = 1, the runner
        cannot, or only one token may come): each with the logits that follow it."""
        e, cfg = self.engine, self.engine.model_cfg
        n = min(e.config.decode_steps_per_call, self.params.max_new_tokens - self.new_tokens,
                e.config.max_seq_len - pos)
        if self.budget is not None:  # tokens the budget still allows
            n = min(n, (self.budget - self.compute_units) // cfg.num_layers)
        if n <= 1 or not self._runner.multistep:
            return
        self._ahead = driver.compute_ahead(self._runner, self.logits, self.params, (self.sample_index, pos), n,
                                           e.config.decode_steps_per_call)

    def _settle(self) -> None:
        """Drop the tokens computed ahead and not yielded (the state stays the last yielded one)."""
        self._ahead = []
        if self._seqs.has(self.seq_id):
            self._seqs.release_unwritten(self.seq_id)

    def run(self) -> list[int]:
        """Iterate to the end (or an interrupt); return the tokens produced by this run."""
        return [t for t in self]

    def on_stop(self, callback) -> None:
        """Run `callback(session)` once, when the current iteration ends (audit records)."""
        self._on_stop.append(callback)

    def _stopped(self) -> None:
        self._settle()
        callbacks, self._on_stop = self._on_stop, []
        for cb in callbacks:
            cb(self)

    # ---- persistence ------------------------------------------------------------------------
    def snapshot(self, path: str, *, include_kv: bool = True) -> str:
        """Save the session with Orbax (atomically); returns the snapshot's content hash."""
        self._settle()
        return snapshot.save_snapshot(self, path, include_kv=include_kv)

    def close(self) -> None:
        if self._seqs.has(self.seq_id):
            self._seqs.release(self.seq_id)
        if not getattr(self, "_closed", False):
            self.engine.stats.add(self.stats)
            self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()


def restore_session(engine, path: str, *, params: SamplingParams | None = None, budget=None) -> Session:
    """A live Session rebuilt from a snapshot on `engine`. Every check (seal, checksums,
    fingerprint, context) runs before any state changes."""
    meta, arrays, digest = snapshot.load_snapshot(path)
    snapshot.check_fingerprint(engine, path, meta)
    params = params or SamplingParams(**meta["sampling"])
    tokens = meta["tokens"]
    if len(tokens) + params.max_new_tokens > engine.config.max_seq_len:
        raise ContextLengthError(f"snapshot holds {len(tokens)} tokens; + max_new_tokens={params.max_new_tokens} "
                                 f"exceeds max_seq_len={engine.config.max_seq_len}.")
    sess = Session(engine, params, budget=budget if budget is not None else meta["budget"],
                   sample_index=meta["sample_index"])
    meta = {**meta, "tokens": snapshot.restore_soft(engine, path, meta, arrays)}
    snapshot.restore_pages(engine, sess.seq_id, meta, arrays)
    sess.soft_sources = [s["source"] for s in meta.get("soft", [])]
    sess.logits = jnp.asarray(arrays["logits"])[None]
    sess.prompt_len = meta["prompt_len"]
    sess.generated = list(meta["generated"])
    sess.new_tokens = meta["new_tokens"]
    sess.finished = meta["finished"]
    sess.stats.compute_units = meta["compute_units"]
    sess.snapshot_hash = digest
    return sess
