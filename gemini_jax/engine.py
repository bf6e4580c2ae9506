"""The engine: chunked prefill, batched decode, `generate`, counters.

Host code here decides what goes into each jitted call (which sequences, pages, positions);
the jitted functions are pure over (weights, cache, tokens, positions) and donate the cache.
Two caches sit behind one loop: the contiguous dense reference and the paged pool (whose pages
and prefix index persist across calls, so a later request can reuse an earlier prefix).
"""

from __future__ import annotations

import functools
import itertools
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from tqdm import tqdm
from flax import nnx

from gemini_jax.attention import digests
from gemini_jax.cache import ContiguousKV, contiguous_backend
from gemini_jax.cache.manager import KVCacheManager
from gemini_jax.cache.paged import PagedKV, paged_backend
from gemini_jax.config import EngineConfig, SamplingParams
from gemini_jax.errors import ConfigError, ContextLengthError
from gemini_jax.model import Decoder, validate_tokens
from gemini_jax.sampling import sample_with

# The counters every engine reports (DESIGN.md §4); zero where a mechanism is not in use.
COUNTERS = (
    "prefill_tokens_computed", "prefill_tokens_reused", "decode_steps", "kv_bytes_read",
    "digest_bytes_read", "pages_selected", "pages_fetched_host", "pages_fetched_disk",
    "prefetch_hits", "prefetch_misses", "stall_seconds", "compute_units",
)


def new_stats() -> dict:
    return {k: (0.0 if k == "stall_seconds" else 0) for k in COUNTERS}


@dataclass
class GenerateOutput:
    """`tokens`: generated ids (a list per prompt when a list of prompts was given).
    `logits`: per prompt f32[num_generated, vocab], the logits each token was chosen from
    (only with return_logits=True). `stats`: this call's counters. `seconds`: wall times."""

    tokens: list
    stats: dict
    logits: Optional[list] = None
    seconds: dict = field(default_factory=dict)


PREFILL_PROGRESS_CHUNKS = 64  # prompts of at least this many prefill chunks show a progress bar


def _pow2_at_least(n: int, floor: int = 1) -> int:
    b = floor
    while b < n:
        b *= 2
    return b


class Engine:
    """Runs a `Decoder` with a KV cache. `generate` takes one prompt or a list of prompts."""

    def __init__(self, model: Decoder, config: EngineConfig | None = None):
        self.model = model
        self.model_cfg = model.cfg
        self.config = config or EngineConfig()
        self.graphdef, self.params = nnx.split(model)
        c = self.config.cache
        self.cache_dtype = jnp.dtype(c.dtype or model.cfg.dtype)
        self.stats = new_stats()  # cumulative over the engine's life
        self._seq_ids = itertools.count()
        self.tiered = None
        if c.kind == "paged" and self.config.tier.enabled:
            from gemini_jax.tiers.runner import TieredKV

            # Pages live in device slots and the tiers below; there is no whole-pool array.
            self.kv = KVCacheManager(self.config.num_pages, c.block_size, prefix_caching=c.prefix_caching)
            self.mesh = None
            if self.config.mesh_devices > 1:
                from gemini_jax import distributed

                self.mesh = distributed.make_mesh(self.config.mesh, model.cfg)
                self.params = distributed.shard_params(self.params, self.mesh)
            self.tiered = TieredKV(self)
            # Unused for calls (they go through the runner); built for its config checks.
            backend = paged_backend(model.cfg, "xla", self.config.sparse)
        elif c.kind == "paged":
            self.kv = KVCacheManager(self.config.num_pages, c.block_size, prefix_caching=c.prefix_caching)
            self.k_pool, self.v_pool = PagedKV.create_pool(model.cfg, self.config.num_pages,
                                                           c.block_size, self.cache_dtype)
            sp = self.config.sparse
            self.digests = None
            if sp.enabled:
                self.digest_dtype = jnp.dtype(sp.digest_dtype or self.cache_dtype)
                self.digests = digests.create(sp.digest, model.cfg.num_layers, model.cfg.num_kv_heads,
                                              self.config.num_pages, model.cfg.head_dim, self.digest_dtype)
            backend = paged_backend(model.cfg, self.config.attention_impl, sp)
            self.mesh = None
            if self.config.mesh_devices > 1:
                from gemini_jax import distributed

                self.mesh = distributed.make_mesh(self.config.mesh, model.cfg)
                self.params = distributed.shard_params(self.params, self.mesh)
                pool = distributed.pool_sharding(self.mesh)
                self.k_pool = jax.device_put(self.k_pool, pool)
                self.v_pool = jax.device_put(self.v_pool, pool)
                if self.digests is not None:
                    self.digests = jax.device_put(self.digests, pool)
        else:
            if self.config.mesh_devices > 1:
                raise ConfigError("a device mesh needs the paged cache (cache.kind='paged').")
            self.kv = None
            self.mesh = None
            backend = contiguous_backend(model.cfg)
        self._step = jax.jit(functools.partial(_run, self.graphdef, backend), donate_argnums=(1,))

    def tier_stats(self) -> dict:
        """Counters of the tiers (device slots, host, disk, bytes held per tier); {} without tiers."""
        return self.tiered.stats() if self.tiered is not None else {}

    def close(self) -> None:
        """Stop the tiers' I/O threads and flush pending disk writes (no-op without tiers)."""
        if self.tiered is not None and not getattr(self, "_closed", False):
            self.tiered.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- validation -----------------------------------------------------------------------
    def _check_request(self, prompt, params: SamplingParams, what: str) -> np.ndarray:
        toks = validate_tokens(prompt, self.model_cfg.vocab_size, what)
        need = len(toks) + params.max_new_tokens
        if need > self.config.max_seq_len:
            raise ContextLengthError(
                f"{what} has {len(toks)} tokens + max_new_tokens={params.max_new_tokens} = {need} > "
                f"EngineConfig.max_seq_len={self.config.max_seq_len}; shorten the prompt, lower "
                f"max_new_tokens or raise max_seq_len.")
        return toks

    # ---- generation -----------------------------------------------------------------------
    def generate(self, prompts, params: SamplingParams | None = None, *,
                 return_logits: bool = False) -> GenerateOutput:
        params = params or SamplingParams()
        single = _is_single(prompts)
        plist = [prompts] if single else list(prompts)
        checked = [self._check_request(p, params, "prompt" if single else f"prompts[{i}]")
                   for i, p in enumerate(plist)]
        stats = new_stats()
        tokens, logits, secs = [], [], {"prefill": 0.0, "decode": 0.0}
        mb = self.config.max_batch
        for g in range(0, len(checked), mb):
            t, lg = self._generate_group(checked[g:g + mb], params, g, stats, secs, return_logits)
            tokens += t
            logits += lg
        for k, v in stats.items():
            self.stats[k] += v
        return GenerateOutput(tokens[0] if single else tokens, stats,
                              (logits[0] if single else logits) if return_logits else None, secs)

    # ---- interruptible sessions (gemini_jax.session) --------------------------------------
    def start(self, prompt, params: SamplingParams | None = None, *, budget: int | None = None):
        """A `Session` over `prompt`: iterate it for tokens; interrupt, snapshot, resume."""
        from gemini_jax.session import Session

        params = params or SamplingParams()
        toks = self._check_request(prompt, params, "prompt")
        sess = Session(self, params, budget=budget)
        try:
            sess.feed(toks)
        except BaseException:
            sess.close()
            raise
        sess.prompt_len = len(toks)
        return sess

    def resume(self, path: str, instruction_tokens=(), rewind_to: int | None = None, *,
               params: SamplingParams | None = None, budget: int | None = None,
               audit_log: str | None = None, instruction_text: str | None = None):
        """Restore a snapshot, optionally rewind to `rewind_to` tokens, prefill the instruction,
        and return the live Session. Every check (fingerprint, context, budget, token ids) runs
        before any state changes; a refused resume leaves the engine as it was."""
        from gemini_jax.session import audit
        from gemini_jax.session.snapshot import restore_session

        sess = restore_session(self, path, params=params, budget=budget)
        try:
            instr = (validate_tokens(instruction_tokens, self.model_cfg.vocab_size, "instruction")
                     if len(instruction_tokens) else np.zeros(0, np.int32))
            keep = sess.position if rewind_to is None else int(rewind_to)
            if not 1 <= keep <= sess.position:
                raise ValueError(f"rewind_to={rewind_to} must be in [1, {sess.position}].")
            need = keep + len(instr) + sess.params.max_new_tokens
            if need > self.config.max_seq_len:
                raise ContextLengthError(
                    f"resume: {keep} tokens kept + {len(instr)} instruction tokens + max_new_tokens="
                    f"{sess.params.max_new_tokens} = {need} > max_seq_len={self.config.max_seq_len}.")
            L = self.model_cfg.num_layers
            cost = (L if rewind_to is not None else 0) + len(instr) * L
            sess._charge(cost, "resume (rewind + instruction prefill)")
            position = sess.position
            if rewind_to is not None:
                sess.rewind(keep)
            if len(instr):
                sess.feed(instr, what="instruction")
            sess.new_tokens = 0  # a resume starts a new turn: max_new_tokens counts from here
            sess.finished = False
        except BaseException:
            sess.close()
            raise
        if audit_log:
            audit.attach(sess, audit_log, snapshot=path, snapshot_hash=sess.snapshot_hash, position=position,
                         rewind_to=rewind_to, instruction_tokens=instr, instruction_text=instruction_text)
        return sess

    def score(self, prompts, continuations) -> GenerateOutput:
        """Teacher-forced log-probabilities of `continuations` after `prompts`, computed through
        the same prefill + decode path as generation (so cache, sparsity and tiers all apply).

        Returns GenerateOutput whose `tokens` holds, per prompt, f32[len(continuation)] log-probs.
        """
        single = _is_single(prompts)
        plist, clist = ([prompts], [continuations]) if single else (list(prompts), list(continuations))
        if len(plist) != len(clist):
            raise ValueError(f"{len(plist)} prompts but {len(clist)} continuations.")
        stats = new_stats()
        secs = {"prefill": 0.0, "decode": 0.0}
        out = []
        for i, (p, c) in enumerate(zip(plist, clist)):
            params = SamplingParams(max_new_tokens=len(c), stop_at_eos=False)
            toks = self._check_request(p, params, f"prompts[{i}]")
            forced = validate_tokens(c, self.model_cfg.vocab_size, f"continuations[{i}]")
            _, lg = self._generate_group([toks], params, i, stats, secs, True, forced=[forced])
            logp = jax.nn.log_softmax(jnp.asarray(lg[0]), axis=-1)
            out.append(np.asarray(jnp.take_along_axis(logp, jnp.asarray(forced)[:, None], -1)[:, 0]))
        for k, v in stats.items():
            self.stats[k] += v
        return GenerateOutput(out[0] if single else out, stats, None, secs)

    def _generate_group(self, prompts, params, first_seq_id, stats, secs, return_logits,
                        forced=None):
        cfg = self.model_cfg
        B = len(prompts)
        if self.tiered is not None:
            from gemini_jax.tiers.runner import TieredRunner as runner_cls
        else:
            runner_cls = _PagedRunner if self.kv is not None else _ContiguousRunner
        runner = runner_cls(self, B, stats)
        try:
            t0 = time.perf_counter()
            logits = jnp.concatenate([runner.prefill(row, toks) for row, toks in enumerate(prompts)])
            jax.block_until_ready(logits)
            secs["prefill"] += time.perf_counter() - t0

            t0 = time.perf_counter()
            sample_ids = np.arange(first_seq_id, first_seq_id + B)
            lengths = np.array([len(p) for p in prompts], np.int32)
            out = [[] for _ in range(B)]
            out_logits = [[] for _ in range(B)]
            done = np.zeros(B, bool)
            for i in range(params.max_new_tokens):
                if forced is not None:
                    nxt = np.array([f[i] for f in forced], np.int32)
                else:
                    nxt = np.asarray(sample_with(params, logits, sample_ids, lengths))
                host_logits = np.asarray(logits) if return_logits else None
                for b in range(B):
                    if not done[b]:
                        out[b].append(int(nxt[b]))
                        if return_logits:
                            out_logits[b].append(host_logits[b])
                        if params.stop_at_eos and cfg.eos_id is not None and nxt[b] == cfg.eos_id:
                            done[b] = True
                if done.all() or i == params.max_new_tokens - 1:
                    break
                logits = runner.decode(nxt, lengths)
                lengths = lengths + 1  # a new array: the runner may still read the old one (async)
                stats["decode_steps"] += 1
                stats["compute_units"] += B * cfg.num_layers
            jax.block_until_ready(logits)
            secs["decode"] += time.perf_counter() - t0
        finally:
            runner.close()
        lg = [np.stack(x) if x else np.zeros((0, cfg.vocab_size), np.float32) for x in out_logits]
        return out, lg

    def _prefill_chunks(self, toks: np.ndarray, start: int):
        """(padded chunk, positions, real length) pieces of toks[start:], padded to powers of two
        (so few shapes compile)."""
        chunk = self.config.prefill_chunk
        bounds = [(s, min(s + chunk, len(toks))) for s in range(start, len(toks), chunk)]
        sp = self.config.sparse
        alone = sp.enabled and sp.sparse_prefill and sp.last_token_alone
        if alone and bounds and bounds[-1][1] - bounds[-1][0] > 1:
            # The last token's logits give the first generated token: it selects pages for itself
            # rather than sharing the selection of a whole chunk's queries.
            s, e = bounds.pop()
            bounds += [(s, e - 1), (e - 1, e)]
        # Long prompts (minutes on a CPU) show a progress bar on stderr; short ones stay quiet.
        for s, e in tqdm(bounds, desc="prefill", unit="chunk", disable=len(bounds) < PREFILL_PROGRESS_CHUNKS,
                         leave=False):
            piece = toks[s:e]
            n = len(piece)
            width = min(_pow2_at_least(n, 16), max(chunk, n))
            padded = np.zeros(width, np.int32)
            padded[:n] = piece
            yield padded, np.arange(s, s + width, dtype=np.int32), n


class _ContiguousRunner:
    """A fresh [B, max_seq_len] dense cache per batch of prompts."""

    def __init__(self, eng: Engine, B: int, stats: dict):
        self.eng, self.stats, self.B = eng, stats, B
        self.cache = ContiguousKV.create(eng.model_cfg, B, eng.config.max_seq_len, eng.cache_dtype)

    def prefill(self, row, toks):
        e = self.eng
        logits = None
        for padded, pos, n in e._prefill_chunks(toks, 0):
            logits, self.cache = e._step(e.params, self.cache._replace(rows=jnp.asarray([row], jnp.int32)),
                                         jnp.asarray(padded[None]), jnp.asarray(pos[None]),
                                         jnp.asarray([n - 1], jnp.int32))
            self.stats["prefill_tokens_computed"] += n
            self.stats["compute_units"] += n * e.model_cfg.num_layers
        return logits

    def decode(self, nxt, lengths):
        e = self.eng
        logits, self.cache = e._step(e.params, self.cache._replace(rows=jnp.arange(self.B, dtype=jnp.int32)),
                                     jnp.asarray(nxt[:, None]), jnp.asarray(lengths[:, None]),
                                     jnp.zeros(self.B, jnp.int32))
        self.stats["kv_bytes_read"] += self.cache.bytes_per_read(self.B)
        return logits

    def close(self):
        self.cache = None


class _PrefillRunner:
    """Prompt and instruction prefill shared by the runners over the page pool (all-resident or
    tiered); a subclass supplies `_prefill_from(sid, toks, start)`."""

    def prefill(self, row, toks):
        """Add sequence `row` with prompt `toks` (reusing cached prefix pages); last logits."""
        e, sid = self.eng, self.ids[row]
        reused = e.kv.add_sequence(sid, toks)
        self.stats["prefill_tokens_reused"] += reused
        return self._prefill_from(sid, np.asarray(toks, np.int32), reused)

    def prefill_more(self, row, toks):
        """Append `toks` to sequence `row` (an instruction after an interrupt); last logits."""
        sid = self.ids[row]
        have = np.asarray(self.eng.kv.seqs[sid].tokens, np.int32)
        return self._prefill_from(sid, np.concatenate([have, np.asarray(toks, np.int32)]), len(have))


class _PagedRunner(_PrefillRunner):
    """Sequences in the engine's persistent page pool; freed (pages cached) on close."""

    def __init__(self, eng: Engine, B: int, stats: dict):
        self.eng, self.stats = eng, stats
        self.ids = [next(eng._seq_ids) for _ in range(B)]
        self.window = eng.model_cfg.max_window

    def _call(self, ids, tokens, positions, lengths, select):
        e = self.eng
        width = _call_width(e, ids, tokens.shape[1])
        cache = PagedKV(e.k_pool, e.v_pool, jnp.asarray(e.kv.block_tables(ids, width)),
                        jnp.asarray(lengths, jnp.int32), e.digests, jnp.zeros((), jnp.int32),
                        jnp.zeros((), jnp.int32))
        tokens, positions = jnp.asarray(tokens), jnp.asarray(positions)
        if e.mesh is not None:  # the batch goes over the mesh's data axis (when it divides)
            from gemini_jax.distributed import batch_sharding

            sh = batch_sharding(e.mesh, tokens.shape[0], 2)
            tokens, positions = jax.device_put(tokens, sh), jax.device_put(positions, sh)
        logits, cache = e._step(e.params, cache, tokens, positions, jnp.asarray(select, jnp.int32))
        e.k_pool, e.v_pool, e.digests = cache.k, cache.v, cache.digests
        # Device scalars, read (synced) by decode only.
        return logits, width, (cache.page_reads, cache.key_reads)

    def _prefill_from(self, sid, toks, start):
        e = self.eng
        logits = None
        for padded, pos, n in e._prefill_chunks(toks, start):
            end = int(pos[0]) + n
            e.kv.reserve(sid, end)
            logits, _, _ = self._call([sid], padded[None], pos[None], [end], [n - 1])
            e.kv.commit(sid, padded[:n])
            e.kv.drop_outside_window(sid, self.window)
            self.stats["prefill_tokens_computed"] += n
            self.stats["compute_units"] += n * e.model_cfg.num_layers
        return logits

    def decode(self, nxt, lengths):
        e = self.eng
        for sid, n in zip(self.ids, lengths):
            e.kv.reserve(sid, int(n) + 1)
        logits, width, (page_reads, key_reads) = self._call(self.ids, nxt[:, None], lengths[:, None], lengths + 1,
                                                            np.zeros(len(self.ids)))
        page_reads, key_reads = int(page_reads), int(key_reads)
        for sid, t in zip(self.ids, nxt):
            e.kv.commit(sid, [int(t)])
            e.kv.drop_outside_window(sid, self.window)
        cfg, S = e.model_cfg, e.config.cache.block_size
        # page_reads counts (page, kv head) pairs the attention read (K and V), over all layers;
        # key_reads the pairs whose keys alone were read to rerank candidates.
        self.stats["kv_bytes_read"] += (2 * page_reads + key_reads) * S * cfg.head_dim * e.cache_dtype.itemsize
        sp = e.config.sparse
        if sp.enabled:
            self.stats["pages_selected"] += page_reads
            sparse_layers = max(cfg.num_layers - sp.dense_layers, 0)
            rows = digests.ROWS[sp.digest]
            self.stats["digest_bytes_read"] += (sparse_layers * len(self.ids) * width * cfg.num_kv_heads
                                                * rows * cfg.head_dim * e.digest_dtype.itemsize)
        return logits

    def close(self):
        for sid in self.ids:
            if sid in self.eng.kv.seqs:
                self.eng.kv.free(sid)


def _call_width(eng, ids, T: int) -> int:
    """Block-table width of a call. Sparse prefill chunks all take the longest sequence's width:
    they read only the selected pages (and score every page from its small digest), so one
    compiled shape serves the whole prompt instead of one per width step."""
    c = eng.config
    if T > 1 and c.sparse.enabled and c.sparse.sparse_prefill:
        return c.pages_per_seq
    return _table_width(max(len(eng.kv.seqs[s].pages) for s in ids), c.pages_per_seq)


def _table_width(pages: int, cap: int) -> int:
    """Block-table width for a call: few distinct shapes (each compiles once) yet little padding.

    Up to 8 pages: powers of two. Beyond: steps of 1/16 of the enclosing power of two; since
    pages > p2 / 2, at most 12.5% of the pages read are padding (<= 16 shapes per doubling).
    Capped at the longest sequence the engine allows.
    """
    p2 = _pow2_at_least(pages)
    step = p2 if p2 <= 8 else max(1, p2 // 16)
    return min(-(-pages // step) * step, max(cap, pages))


def _run(graphdef, backend, params, cache, tokens, positions, select):
    """One jitted model call: tokens/positions [B, T] -> logits f32[B, V] at `select`, new cache."""
    model = nnx.merge(graphdef, params)
    logits, cache = model(tokens, positions, backend, cache, select=select)
    return logits[:, 0], cache


def _is_single(prompts) -> bool:
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)):
        # NOTE: [] counts as one (empty) prompt, so it is refused as such.
        return len(prompts) == 0 or isinstance(prompts[0], (int, np.integer))
    return False
