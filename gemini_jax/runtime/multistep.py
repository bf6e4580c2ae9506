"""Several decode tokens per device program: the per-token loop on device, the host once per call.

A decode step of a small model on one device is mostly host work (block tables, sampling, a
dispatch and a device->host copy per token). `decode_loop` runs up to `k` steps in one jitted
`lax.while_loop`:

    for i in range(n):                     # n <= k, a traced count (one compile per k)
        stop when every row is done (EOS sampled; the EOS token itself is not written)
        write `tok` at `lengths + i`       # the engine's whole-model step over the runner's cache
        tok = sample(logits, key(seed, sequence, lengths + i + 1))   # or the teacher-forced token
        keep tok (and its logits); done |= tok == eos

Sampling uses the explicit per-token keys of `gemini_jax.sampling`, so the tokens are those of
the one-token path; the step is the same whole-model function, so the logits are too (to
rounding). The runner reserves pages for all `n` tokens before the call and commits what was
written after it (one device->host transfer per call).

A runner supplies `step(params, state, consts, tok i32[B], pos i32[B]) -> (logits f32[B, V],
state, (page_reads, key_reads))` over its cache (`state` is donated); see `SequenceRunner` and
`ContiguousRunner`.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, NamedTuple, Optional

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.config import SamplingParams
from gemini_jax.sampling import keys_from, sample


@dataclasses.dataclass(frozen=True, kw_only=True)
class LoopSpec:
    """The static setting of one compiled loop (one program per spec and batch shape)."""

    k: int  # most tokens per call (the loop's static length)
    temperature: float = 0.0
    top_k: int = 0
    top_p: float = 1.0
    eos_id: Optional[int] = None  # stop a row once it samples this (None: never)
    keep_logits: bool = False  # return the logits every kept token was chosen from
    forced: bool = False  # teacher-forced tokens (scoring) instead of sampling

    @classmethod
    def of(cls, params: SamplingParams, k: int, eos_id: Optional[int], *, keep_logits: bool = False,
           forced: bool = False) -> "LoopSpec":
        return cls(k=int(k), temperature=float(params.temperature), top_k=int(params.top_k),
                   top_p=float(params.top_p), eos_id=eos_id if params.stop_at_eos else None,
                   keep_logits=keep_logits, forced=forced)


class LoopInputs(NamedTuple):
    """One call's inputs (host arrays are fine: they are copied in once)."""

    tok: Any  # i32[B]: the token to write first (sampled by the previous call or the host)
    lengths: Any  # i32[B]: its position
    sample_ids: Any  # u32[B]: each row's sampling stream
    key: Any  # jax.random.key(SamplingParams.seed)
    done: Any  # bool[B]: rows already finished (they still run, their tokens are not kept)
    n: Any  # i32[]: steps to run at most (<= k)
    forced: Any = None  # i32[B, k]: the tokens to "sample" (LoopSpec.forced)


class LoopOut(NamedTuple):
    tokens: jax.Array  # i32[B, k]: tokens sampled after each step (entries >= steps unused)
    logits: Optional[jax.Array]  # f32[B, k, V]: the logits each was chosen from (keep_logits)
    last_logits: jax.Array  # f32[B, V]: the last step's
    steps: jax.Array  # i32[]: steps run (tokens written)
    done: jax.Array  # bool[B]
    page_reads: jax.Array  # i32[]: summed over the steps (paged runners; 0 otherwise)
    key_reads: jax.Array


@dataclasses.dataclass(frozen=True)
class HostOut:
    """`LoopOut` on the host, fetched in one transfer (`last_logits` stays on device)."""

    tokens: np.ndarray  # i32[B, steps]
    logits: Optional[np.ndarray]  # f32[B, steps, V]
    last_logits: jax.Array
    steps: int
    page_reads: int
    key_reads: int

    def written(self, first: np.ndarray) -> np.ndarray:
        """i32[B, steps]: the tokens the call wrote (its first input, then all but the last sampled)."""
        return np.concatenate([np.asarray(first, np.int32)[:, None], self.tokens[:, :self.steps - 1]], axis=1)


def decode_loop(step: Callable, spec: LoopSpec, vocab_size: int):
    """The jitted k-step program over `step` (see the module doc); donates the state."""
    k = spec.k

    def run(params, state, consts, inp: LoopInputs):
        B = inp.tok.shape[0]
        tok = jnp.asarray(inp.tok, jnp.int32)
        lengths = jnp.asarray(inp.lengths, jnp.int32)
        sample_ids = jnp.asarray(inp.sample_ids, jnp.uint32)

        def body(c):
            i, state, tok, done, toks, hist, _, pr, kr = c
            pos = lengths + i
            logits, state, (p, r) = step(params, state, consts, tok, pos)
            logits = logits.astype(jnp.float32)
            if spec.forced:
                nxt = jax.lax.dynamic_index_in_dim(inp.forced, i, axis=1, keepdims=False).astype(jnp.int32)
            else:
                keys = keys_from(inp.key, sample_ids, (pos + 1).astype(jnp.uint32))
                nxt = sample(logits, keys, temperature=spec.temperature, top_k=spec.top_k, top_p=spec.top_p)
            toks = jax.lax.dynamic_update_index_in_dim(toks, nxt, i, axis=1)
            if hist is not None:
                hist = jax.lax.dynamic_update_index_in_dim(hist, logits, i, axis=1)
            if spec.eos_id is not None:
                done = done | (nxt == spec.eos_id)
            return i + 1, state, nxt, done, toks, hist, logits, pr + p, kr + r

        def cond(c):
            return (c[0] < inp.n) & ~jnp.all(c[3])

        V = vocab_size
        init = (jnp.int32(0), state, tok, jnp.asarray(inp.done, bool), jnp.zeros((B, k), jnp.int32),
                jnp.zeros((B, k, V), jnp.float32) if spec.keep_logits else None,
                jnp.zeros((B, V), jnp.float32), jnp.int32(0), jnp.int32(0))
        steps, state, _, done, toks, hist, last, pr, kr = jax.lax.while_loop(cond, body, init)
        return state, LoopOut(toks, hist, last, steps, done, pr, kr)

    return jax.jit(run, donate_argnums=(1,))


def fetch(out: LoopOut) -> HostOut:
    """One device->host transfer of what the host needs after a call."""
    toks, hist, steps, pr, kr = jax.device_get((out.tokens, out.logits, out.steps, out.page_reads, out.key_reads))
    steps = int(steps)
    return HostOut(tokens=np.asarray(toks)[:, :steps], logits=None if hist is None else np.asarray(hist)[:, :steps],
                   last_logits=out.last_logits, steps=steps, page_reads=int(pr), key_reads=int(kr))
