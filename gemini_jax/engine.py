"""The engine: chunked prefill, batched decode, `generate`, counters.

Host code here decides what goes into each jitted call (which sequences, pages, positions);
the jitted functions are pure over (weights, cache, tokens, positions) and donate the cache.
The engine owns the KV store (`PooledStore`, or `TieredStore` over tiers) and the page manager,
whose pages and prefix index persist across calls, so a later request can reuse an earlier
prefix; the runners (`gemini_jax.runtime`) run each batch through them.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from dataclasses import dataclass, field
from typing import Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax import distributed
from gemini_jax.cache import contiguous_backend
from gemini_jax.cache.manager import KVCacheManager
from gemini_jax.attention.dispatch import paged_backend
from gemini_jax.cache.store import PooledStore
from gemini_jax.config import EngineConfig, SamplingParams, compat
from gemini_jax.errors import ConfigError, ContextLengthError
from gemini_jax.model import Decoder, unstack_layers, validate_tokens
from gemini_jax.encoders.prompt import Prompt, check_encoders
from gemini_jax.runtime import COUNTERS, RunContext, aligned, driver, make_runner, new_stats
from gemini_jax.runtime.context import model_call
from gemini_jax.runtime.sequences import SequenceCache
from gemini_jax.runtime.soft import SoftTable
from gemini_jax.session import Session, audit, restore_session
from gemini_jax.session.snapshot import fingerprint
from gemini_jax.tiers import PageSpec, SelectionObserver, TieredStore
from gemini_jax.tiers.prefix_store import PrefixStore, fingerprint_id
from gemini_jax.weights import params_sha256

__all__ = ["COUNTERS", "Engine", "GenerateOutput", "new_stats"]


@dataclass
class GenerateOutput:
    """`tokens`: generated ids (a list per prompt when a list of prompts was given).
    `logits`: per prompt f32[num_generated, vocab], the logits each token was chosen from
    (only with return_logits=True). `stats`: this call's counters. `seconds`: wall times."""

    tokens: list
    stats: dict
    logits: Optional[list] = None
    seconds: dict = field(default_factory=dict)


class Engine:
    """Runs a `Decoder` with a KV cache. `generate` takes one prompt or a list of prompts."""

    def __init__(self, model: Decoder, config: EngineConfig | None = None, *,
                 observer: SelectionObserver | None = None):
        """`observer`: research hooks on sparse selection (`gj.SelectionObserver`: record every
        selection, or edit it before pages are read); they run on the tiered store only."""
        self.model = model
        self.model_cfg = model.cfg
        self.config = config or EngineConfig()
        graphdef, params = nnx.split(model)
        c = self.config.cache
        compat.check_model(self.config, model.cfg)  # which features run with this model
        aligned.check_language(self.config)
        self.cache_dtype = jnp.dtype(c.dtype or model.cfg.dtype)
        self.stats = new_stats()  # cumulative over the engine's life (read it like a dict)
        self.pages = None  # host page bookkeeping (paged caches)
        self.store = None  # the one owner of device KV (paged caches)
        self._closed = False
        mesh = None
        if self.config.mesh_devices > 1:
            mesh = distributed.make_mesh(self.config.mesh, model.cfg)
            params = distributed.shard_params(params, mesh)
        if self.config.layer_weights == "per_layer":
            params = unstack_layers(params)
        if c.kind == "paged":
            self.pages = KVCacheManager(self.config.num_pages, c.block_size, prefix_caching=c.prefix_caching)
            # Built for its config checks too (compact positions refuse a second rope).
            backend = paged_backend(model.cfg, self.config.attention_impl, self.config.sparse,
                                    kernel_platform=self.config.kernel_platform)
            if self.config.tier.enabled:
                self.store = TieredStore(model.cfg, self._store_config(), self.cache_dtype, mesh, observer=observer)
            else:
                if observer is not None:
                    raise ConfigError("a selection observer runs on the tiered store (tier.enabled=true, "
                                      "e.g. tier.device_fraction=1.0): the all-resident step selects on device.")
                self.store = PooledStore(model.cfg, self._store_config(), self.cache_dtype, mesh)
        else:
            backend = contiguous_backend(model.cfg)
        forward = functools.partial(model_call, graphdef, backend)
        soft = SoftTable(model.cfg.vocab_size, model.cfg.hidden_size, model.cfg.dtype, self.config.max_soft_tokens)
        self.ctx = RunContext(graphdef=graphdef, params=params, model_cfg=model.cfg, config=self.config,
                              step=jax.jit(forward, donate_argnums=(1,)), forward=forward,
                              pages=self.pages, store=self.store, mesh=mesh, soft=soft)
        self.prefixes = None
        if self.config.tier.persistent:
            self.prefixes = self._open_prefixes()
            self.ctx = dataclasses.replace(self.ctx, prefixes=self.prefixes)
        # What sessions, the scheduler, snapshots and benchmarks use to hold sequences (None: contiguous).
        self.sequences = SequenceCache(self.ctx) if self.pages is not None else None

    def runner(self, batch: int, stats=None):
        """A runner over this engine's cache for `batch` rows (`gemini_jax.runtime`): prefill,
        decode, k-step decode; the engine's own counters unless `stats` is given. Close it after."""
        return make_runner(self.ctx, batch, self.stats if stats is None else stats)

    @property
    def stored_prefixes(self) -> int:
        """Pages held by the persistent prefix store (0 without `tier.persistent`)."""
        return 0 if self.prefixes is None else len(self.prefixes)

    def set_link(self, link) -> None:
        """Emulate `link` (a `gj.tiers` link model, None: real transfers) on the tiers from now on."""
        if not self.config.tier.enabled:
            raise ConfigError("set_link: the engine has no tiers (tier.enabled=false).")
        self.store.set_link(link)

    @property
    def mesh(self):
        """The device mesh (None: one device)."""
        return self.ctx.mesh

    @property
    def params(self):
        """The model's weights as the engine runs them (sharded on a mesh)."""
        return self.ctx.params

    @functools.cached_property
    def weights_sha256(self) -> str:
        """sha256 over every weight (computed once per engine)."""
        return params_sha256(self.ctx.params)

    def _store_config(self) -> EngineConfig:
        """The config the KV store runs with. With tier.persistent, disk_path is shared by engines of
        different layouts, so the tiers' own pages (meaningful to this engine only) go to a
        subdirectory per layout; the persistent prefixes sit beside them in `prefixes/`."""
        tc = self.config.tier
        if not (tc.enabled and tc.persistent):
            return self.config
        layout = {"model": dataclasses.asdict(self.model_cfg), "block_size": self.config.cache.block_size,
                  "cache_dtype": self.cache_dtype.name}
        scratch = os.path.join(tc.disk_path, f"tiers-{fingerprint_id(layout)}")
        return dataclasses.replace(self.config, tier=dataclasses.replace(tc, disk_path=scratch))

    def _open_prefixes(self) -> PrefixStore:
        """The persistent prefix store of this engine's fingerprint under tier.disk_path."""
        cfg, dig = self.model_cfg, self.store.device.digests
        spec = PageSpec(num_layers=cfg.num_layers, num_pages=1, kv_heads=cfg.num_kv_heads,
                        block_size=self.config.cache.block_size, head_dim=cfg.head_dim, dtype=self.cache_dtype.name)
        shape = None if dig is None else (dig.shape[0], dig.shape[1], *dig.shape[3:])
        return PrefixStore(os.path.join(self.config.tier.disk_path, "prefixes"), fingerprint(self), spec,
                           digest_shape=shape, digest_dtype=None if dig is None else dig.dtype,
                           fsync=self.config.tier.disk_fsync)

    def tier_stats(self) -> dict:
        """Counters of the tiers (device slots, host, disk, bytes held per tier); {} without tiers."""
        return self.store.stats() if self.store is not None else {}

    def close(self) -> None:
        """Stop the tiers' I/O threads and flush pending disk writes (no-op without tiers)."""
        if self.store is not None and not self._closed:
            self.store.close()
        if self.prefixes is not None:
            self.prefixes.close()
        self._closed = True

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # ---- validation -----------------------------------------------------------------------
    @property
    def soft(self) -> SoftTable:
        """The soft-token table: encoder outputs of the prompts so far (`gj.Prompt`)."""
        return self.ctx.soft

    def token_ids(self, prompt, what: str = "prompt") -> np.ndarray:
        """int32 ids of `prompt`: token ids (ids past the vocabulary must name soft-token rows of this
        engine), or a `gj.Prompt`, whose images are encoded and registered here. TokenError otherwise."""
        if isinstance(prompt, Prompt):
            prompt = prompt.resolve(self.model_cfg, self.ctx.soft)
        return validate_tokens(prompt, self.model_cfg.vocab_size + len(self.ctx.soft), what)

    def _check_request(self, prompt, params: SamplingParams, what: str) -> np.ndarray:
        toks = self.token_ids(prompt, what)
        need = len(toks) + params.max_new_tokens
        if need > self.config.max_seq_len:
            raise ContextLengthError(
                f"{what} has {len(toks)} tokens + max_new_tokens={params.max_new_tokens} = {need} > "
                f"EngineConfig.max_seq_len={self.config.max_seq_len}; shorten the prompt, lower "
                f"max_new_tokens or raise max_seq_len.")
        if self.config.cache.align != "none":  # padding slots count too: refused before any work
            aligned.check_length(self.config, aligned.slot_tokens(self.config, toks), len(toks), params.max_new_tokens)
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
        self.stats.add(stats)
        return GenerateOutput(tokens[0] if single else tokens, stats.as_dict(),
                              (logits[0] if single else logits) if return_logits else None, secs)

    # ---- interruptible sessions (gemini_jax.session) --------------------------------------
    def start(self, prompt, params: SamplingParams | None = None, *, budget: int | None = None):
        """A `Session` over `prompt`: iterate it for tokens; interrupt, snapshot, resume."""
        params = params or SamplingParams()
        self._refuse_aligned_sessions("start")
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
        self._refuse_aligned_sessions("resume")
        sess = restore_session(self, path, params=params, budget=budget)
        try:
            check_encoders(instruction_tokens, sess.soft_sources, f"snapshot {path!r}")
            instr = (self.token_ids(instruction_tokens, "instruction")
                     if isinstance(instruction_tokens, Prompt) or len(instruction_tokens) else np.zeros(0, np.int32))
            keep = sess.position if rewind_to is None else int(rewind_to)
            if not 1 <= keep <= sess.position:
                raise ValueError(f"rewind_to={rewind_to} must be in [1, {sess.position}].")
            need = keep + len(instr) + sess.params.max_new_tokens
            if need > self.config.max_seq_len:
                raise ContextLengthError(
                    f"resume: {keep} tokens kept + {len(instr)} instruction tokens + max_new_tokens="
                    f"{sess.params.max_new_tokens} = {need} > max_seq_len={self.config.max_seq_len}.")
            layers = self.model_cfg.num_layers
            cost = (layers if rewind_to is not None else 0) + len(instr) * layers
            sess.charge(cost, "resume (rewind + instruction prefill)")
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

    def _refuse_aligned_sessions(self, what: str) -> None:
        compat.check_use("sessions", self.config, f"Engine.{what}: ")

    def score(self, prompts, continuations) -> GenerateOutput:
        """Teacher-forced log-probabilities of `continuations` after `prompts`, computed through
        the same prefill + decode path as generation (so cache, sparsity and tiers all apply).
        Consecutive requests whose continuations have the same length share decode steps, up to
        `max_batch` at a time (each row's numbers are its own: rows never mix).

        Returns GenerateOutput whose `tokens` holds, per prompt, f32[len(continuation)] log-probs.
        """
        single = _is_single(prompts)
        plist, clist = ([prompts], [continuations]) if single else (list(prompts), list(continuations))
        if len(plist) != len(clist):
            raise ValueError(f"{len(plist)} prompts but {len(clist)} continuations.")
        checked = []
        for i, (p, c) in enumerate(zip(plist, clist)):
            params = SamplingParams(max_new_tokens=len(c), stop_at_eos=False)
            checked.append((self._check_request(p, params, f"prompts[{i}]"),
                            validate_tokens(c, self.model_cfg.vocab_size, f"continuations[{i}]")))
        stats = new_stats()
        secs = {"prefill": 0.0, "decode": 0.0}
        out = []
        start = 0
        while start < len(checked):
            end = start + 1
            while (end < len(checked) and end - start < self.config.max_batch
                   and len(checked[end][1]) == len(checked[start][1])):
                end += 1
            group = checked[start:end]
            params = SamplingParams(max_new_tokens=len(group[0][1]), stop_at_eos=False)
            forced = [f for _, f in group]
            _, lgs = self._generate_group([t for t, _ in group], params, start, stats, secs, True, forced=forced)
            for lg, f in zip(lgs, forced):
                logp = jax.nn.log_softmax(jnp.asarray(lg), axis=-1)
                out.append(np.asarray(jnp.take_along_axis(logp, jnp.asarray(f)[:, None], -1)[:, 0]))
            start = end
        self.stats.add(stats)
        return GenerateOutput(out[0] if single else out, stats.as_dict(), None, secs)

    def _generate_group(self, prompts, params, first_seq_id, stats, secs, return_logits,
                        forced=None):
        cfg = self.model_cfg
        B = len(prompts)
        runner = make_runner(self.ctx, B, stats)
        try:
            t0 = time.perf_counter()
            logits = jnp.concatenate([runner.prefill(row, toks) for row, toks in enumerate(prompts)])
            jax.block_until_ready(logits)
            secs["prefill"] += time.perf_counter() - t0

            t0 = time.perf_counter()
            rows = driver.DecodeRows.start(np.arange(first_seq_id, first_seq_id + B), [len(p) for p in prompts])
            req = driver.DecodeRequest(params=params, eos_id=cfg.eos_id, num_layers=cfg.num_layers,
                                       return_logits=return_logits, forced=forced,
                                       steps_per_call=self.config.decode_steps_per_call)
            logits = driver.decode(runner, logits, rows, req, stats)
            jax.block_until_ready(logits)
            secs["decode"] += time.perf_counter() - t0
        finally:
            runner.close()
        out, out_logits = rows.out, rows.out_logits
        lg = [np.stack(x) if x else np.zeros((0, cfg.vocab_size), np.float32) for x in out_logits]
        return out, lg


def _is_single(prompts) -> bool:
    if isinstance(prompts, Prompt):
        return True
    if isinstance(prompts, np.ndarray):
        return prompts.ndim == 1
    if isinstance(prompts, (list, tuple)):
        # NOTE: [] counts as one (empty) prompt, so it is refused as such.
        return len(prompts) == 0 or isinstance(prompts[0], (int, np.integer))
    return False
