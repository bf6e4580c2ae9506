"""The decode driver: the one place that samples a next token, detects EOS and keeps what a row
produced. `Engine.generate` / `score`, `Session` and the serving scheduler all call it.

    rows = DecodeRows.start(sample_ids, lengths)
    logits = decode(runner, logits, rows, params, stats, k=engine.config.decode_steps_per_call)
    tok = sample_one(params, logits, sample_index, position)       # a session's next token
    toks = sample_each(params_per_row, logits, sample_ids, positions)  # a server's batch

A token's PRNG key is a pure function of (seed, sample index, position) (`gemini_jax.sampling`),
so every caller draws the same token for the same row at the same position, however the rows
were batched or the run was interrupted.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.config import SamplingParams
from gemini_jax.runtime.multistep import LoopInputs, LoopSpec
from gemini_jax.sampling import sample_with


def eos_for(params: SamplingParams, eos_id: Optional[int]) -> Optional[int]:
    """The token that ends a row under `params` (None: none does)."""
    return eos_id if params.stop_at_eos else None


def is_stop(params: SamplingParams, eos_id: Optional[int], token: int) -> bool:
    """Whether `token` ends a row sampled with `params` (its EOS, when it stops at EOS)."""
    eos = eos_for(params, eos_id)
    return eos is not None and int(token) == eos


def sample_one(params: SamplingParams, logits, sample_index: int, position: int) -> int:
    """The next token of one row: logits f32[1, V], drawn with key (seed, sample_index, position)."""
    return int(np.asarray(sample_with(params, logits, [sample_index], [position]))[0])


def sample_rows(params: SamplingParams, logits, sample_ids, positions) -> np.ndarray:
    """int32[B]: every row's next token under the same `params` (logits f32[B, V])."""
    return np.asarray(sample_with(params, logits, sample_ids, positions), np.int32)


def sample_each(params: list, logits: np.ndarray, sample_ids, positions) -> np.ndarray:
    """int32[B]: row i's next token under its own `params[i]`. Rows sharing parameters are drawn
    in one call; greedy rows take the host argmax (the first maximum, as `jnp.argmax`), so a
    server's changing batch sizes compile nothing for them."""
    out = np.zeros(len(params), np.int32)
    groups: dict = {}
    for i, p in enumerate(params):
        groups.setdefault(p, []).append(i)
    for p, idx in groups.items():
        if p.temperature == 0.0:
            out[idx] = np.argmax(logits[idx], axis=-1)
            continue
        out[idx] = sample_rows(p, logits[idx], [sample_ids[i] for i in idx], [positions[i] for i in idx])
    return out


def loop_spec(params: SamplingParams, k: int, eos_id: Optional[int]) -> LoopSpec:
    """The k-step program's static setting for rows sampled with `params` (EOS per `params`)."""
    return LoopSpec.of(params, k, eos_id)


def loop_inputs(tokens, lengths, sample_ids, params: SamplingParams, done, n: int) -> LoopInputs:
    """One k-step call's inputs: the tokens to write first at `lengths`, each row's sampling
    stream, rows already done, and the steps to run (<= the spec's k)."""
    return LoopInputs(np.asarray(tokens, np.int32), np.asarray(lengths, np.int32), np.asarray(sample_ids, np.uint32),
                      jax.random.key(params.seed), np.asarray(done, bool), np.int32(n))


@dataclass
class DecodeRows:
    """What a group's decode keeps per row: sampling stream, length, tokens (and logits) kept,
    and whether the row is done (EOS)."""

    sample_ids: np.ndarray
    lengths: np.ndarray
    out: list
    out_logits: list
    done: np.ndarray

    @classmethod
    def start(cls, sample_ids, lengths) -> "DecodeRows":
        B = len(lengths)
        return cls(sample_ids=np.asarray(sample_ids), lengths=np.asarray(lengths, np.int32),
                   out=[[] for _ in range(B)], out_logits=[[] for _ in range(B)], done=np.zeros(B, bool))

    def keep(self, tokens: np.ndarray, logits: Optional[np.ndarray], eos: Optional[int]) -> None:
        """Append tokens i32[B, n] (and their logits f32[B, n, V]) to the rows not yet done, each
        up to and including its first EOS."""
        for b in np.flatnonzero(~self.done):
            t = tokens[b]
            cut = len(t)
            if eos is not None:
                hit = np.flatnonzero(t == eos)
                if len(hit):
                    cut = int(hit[0]) + 1
                    self.done[b] = True
            self.out[b].extend(int(x) for x in t[:cut])
            if logits is not None:
                self.out_logits[b].extend(logits[b, :cut])


@dataclass(frozen=True)
class DecodeRequest:
    """How a group decodes: its sampling parameters, the model's EOS id, the tokens forced in
    (`score`: i32 per row, or None), whether logits are kept, and tokens per device call."""

    params: SamplingParams
    eos_id: Optional[int]
    num_layers: int
    return_logits: bool = False
    forced: Optional[list] = None
    steps_per_call: int = 1


def decode(runner, logits, rows: DecodeRows, req: DecodeRequest, stats):
    """Decode `rows` from their first next-token `logits` until `max_new_tokens` or every row's
    EOS; returns the last logits. k-step programs (`runtime.multistep`) when the runner has them
    and `steps_per_call` > 1: the same tokens, logits and counters as one step per token."""
    if req.params.max_new_tokens <= 0:
        return logits
    if req.steps_per_call > 1 and runner.multistep:
        return _decode_calls(runner, logits, rows, req, stats)
    return _decode_steps(runner, logits, rows, req, stats)


def _decode_steps(runner, logits, rows: DecodeRows, req: DecodeRequest, stats):
    """One jitted step per token (`decode_steps_per_call=1`, the tiered runner)."""
    params, forced = req.params, req.forced
    B = len(rows.out)
    eos = eos_for(params, req.eos_id)
    lengths = rows.lengths
    for i in range(params.max_new_tokens):
        if forced is not None:
            nxt = np.array([f[i] for f in forced], np.int32)
        else:
            nxt = sample_rows(params, logits, rows.sample_ids, lengths)
        rows.keep(nxt[:, None], np.asarray(logits)[:, None] if req.return_logits else None, eos)
        if rows.done.all() or i == params.max_new_tokens - 1:
            break
        logits = runner.decode(nxt, lengths)
        lengths = lengths + 1  # a new array: the runner may still read the old one (async)
        stats.decode_steps += 1
        stats.compute_units += B * req.num_layers
    return logits


def _decode_calls(runner, logits, rows: DecodeRows, req: DecodeRequest, stats):
    """Programs of up to `steps_per_call` tokens: the host once per call."""
    params = req.params
    B, N = len(rows.out), params.max_new_tokens
    forced = None if req.forced is None else np.stack([np.asarray(f, np.int32) for f in req.forced])
    eos = eos_for(params, req.eos_id)
    first = forced[:, 0] if forced is not None else sample_rows(params, logits, rows.sample_ids, rows.lengths)
    rows.keep(first[:, None], np.asarray(logits)[:, None] if req.return_logits else None, eos)
    spec = LoopSpec.of(params, req.steps_per_call, req.eos_id, keep_logits=req.return_logits,
                       forced=forced is not None)
    key = jax.random.key(params.seed)
    ids = jnp.asarray(rows.sample_ids, jnp.uint32)
    tok, lengths, made = first, rows.lengths, 1
    while made < N and not rows.done.all():
        n = min(spec.k, N - made)
        window = None
        if forced is not None:  # the tokens after the ones written, padded to the loop's length
            window = np.zeros((B, spec.k), np.int32)
            window[:, :n] = forced[:, made:made + n]
        res = runner.decode_many(LoopInputs(tok, lengths, ids, key, rows.done.copy(), np.int32(n), window), spec)
        rows.keep(res.tokens, res.logits, eos)
        stats.decode_steps += res.steps
        stats.compute_units += B * req.num_layers * res.steps
        tok, lengths, made = res.tokens[:, -1], lengths + res.steps, made + res.steps
        logits = res.last_logits
    return logits


def compute_ahead(runner, logits, params: SamplingParams, at: tuple, n: int, k: int) -> list:
    """Up to `n` tokens of row `at` = (sample index, position) from one program of `k` steps,
    uncommitted (a session yields and commits them one by one): [(token, logits f32[1, V] after
    it)]. EOS does not stop the program: the session writes the EOS token it yields, as one step per token does, and what
    was computed past it is dropped with the rest of the overshoot."""
    sample_index, position = at
    first = np.asarray([sample_one(params, logits, sample_index, position)], np.int32)
    spec = LoopSpec.of(params, k, None, keep_logits=True)
    res = runner.decode_many(LoopInputs(first, np.asarray([position], np.int32),
                                        np.asarray([sample_index], np.uint32),
                                        jax.random.key(params.seed), np.zeros(1, bool), np.int32(n)),
                             spec, commit=False)
    written = res.written(first)[0]
    return [(int(t), res.logits[:, j]) for j, t in enumerate(written)]
