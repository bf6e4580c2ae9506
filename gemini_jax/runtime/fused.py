"""A sparse decode step over tiers as one device program: the layer loop stays on device and the
host is called back only for the pages a layer selects that are not in its device slots.

Per layer l, inside one jitted call (all layers unrolled):

    q, k, v   = layer l's first half; the new K/V into their slots; digests refreshed
    selected  = top-k pages from the digests (exactly the all-resident selection)
    missing   = selected pages whose `page_to_slot` entry is 0 (not on device)
    while any missing: host callback -> admit up to FETCH_BATCH of them into slots (LRU
        eviction, the layer's selection protected), read them through the prefetcher (staged ->
        hit, else a timed miss), and hand back (slots, pages, evicted pages, k, v); the program
        writes them into the slots and updates its copy of `page_to_slot`
    attention over the selected slots; layer l's second half
    (prefetch depth > 0) a callback hands the lookahead of layer l+depth (scored from layer l's
        input) to the prefetcher, which reads those pages in its threads while the device goes on

The host's bookkeeping for the step (LRU use of the selected pages, hot zone, the predictor's
history, full pages going down the tiers) runs once, after the program returns.

Exactness: the program does the layer path's math in the same order on the same pages, so its
logits are the all-resident ones up to rounding. It runs when the whole step fits: no dense
layer, one sequence's selection per layer fits the free slots, and no mesh (a mesh runs layer
by layer); `TieredRunner` falls back to the layer-by-layer path otherwise.
"""

from __future__ import annotations

import dataclasses
import functools
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx
from jax.experimental import io_callback

from gemini_jax.attention import kvquant
from gemini_jax.attention.select import compact_shift, select_step
from gemini_jax.attention.dispatch import AttentionImpl, attend_selected
from gemini_jax.attention.views import PageView, Selection, Span
from gemini_jax.attention.pool import write_layer
from gemini_jax.cache.store import DeviceKV
from gemini_jax.config import ModelConfig, SparseConfig
from gemini_jax.runtime.batch import CallArrays
from gemini_jax.runtime import lookahead
from gemini_jax.runtime.context import RunContext
from gemini_jax.tiers.errors import TierError
from gemini_jax.tiers.kv_store import TieredStore


# Pages one callback hands back. Small: a round trip without misses costs nothing, and the
# buffers (k and v of FETCH_BATCH pages) are copied on every trip that has some.
FETCH_BATCH = 16


@dataclasses.dataclass(frozen=True, kw_only=True)
class FusedSpec:
    """The static setting of one program: the model's shapes, selection, lookahead and sizes."""

    model_cfg: ModelConfig
    sp: SparseConfig
    sp_ahead: Optional[SparseConfig]  # the lookahead's selection (None: no lookahead)
    depth: int  # prefetch depth (layers ahead)
    block_size: int
    fetch_batch: int  # pages one callback hands back
    dtype: Any  # of the slots (a quantized format's pages arrive packed: kvquant.pack)
    # False: every page the step can read is in a slot, so the program has no host callback at
    # all, neither to bring pages nor to hand the prefetcher lookahead guesses (a program with
    # callbacks leaves jax's fast dispatch path, ~1 ms a step here).
    fetch: bool = True


def _program(graphdef, host, spec: FusedSpec):
    """The jitted step for one static setting (built once per `FusedDecode` and batch shape)."""
    cfg, sp, sp_ahead, depth = spec.model_cfg, spec.sp, spec.sp_ahead, spec.depth
    L, block_size, M = cfg.num_layers, spec.block_size, spec.fetch_batch
    K, S, D = cfg.num_kv_heads, spec.block_size, cfg.head_dim
    windows = tuple(int(w) for w in cfg.layer_windows)
    attention = AttentionImpl.of(cfg, "xla")  # over tiers: the XLA path (EngineConfig refuses "pallas")

    def run(kv: DeviceKV, params, tokens, call: CallArrays, page_to_slot):
        model = nnx.merge(graphdef, params)
        k_slots, v_slots, digests = kv
        positions, bt, ends = call.positions, call.page_table, call.lengths
        inv_freq, unrope = call.inv_freq, call.unrope  # unrope: digests of keys before rope
        h = model.embed_tokens(tokens)
        sels = []
        ids = jax.ShapeDtypeStruct((M,), jnp.int32)
        quantized = kvquant.is_quantized(spec.dtype)
        # Pages arrive as the tiers store them: a quantized page packed with its scales.
        page = jax.ShapeDtypeStruct((M, K, S, D + kvquant.SCALE_BYTES) if quantized else (M, K, S, D),
                                    jnp.uint8 if quantized else spec.dtype)
        fetch_shapes = (jax.ShapeDtypeStruct((), jnp.bool_), ids, ids, ids, page, page)  # ok, slots, pages, evicted, k, v

        for layer in range(L):
            if sp_ahead is not None:
                for j in lookahead.targets(layer, depth, L):  # no dense layers in this program
                    guess = lookahead.guess(model, sp_ahead, j, h, call, digests[j], block_size=block_size,
                                            window=windows[j])
                    io_callback(functools.partial(host.speculate, j), None, guess, ordered=False)
            slot_table = page_to_slot[layer][bt]
            q, k, v = model.layer_qkv(layer, h, positions)
            k_slots, v_slots, digests = write_layer(k_slots, v_slots, digests, layer, (k, v),
                                                    Span(positions, ends, slot_table, bt), digest_kind=sp.digest,
                                                    unrope=unrope)
            sel = select_step(sp, digests[layer], (q, positions), PageView(bt, ends), block_size=block_size,
                              window=windows[layer], inv_freq=unrope)
            phys = jnp.where(sel >= 0, jnp.take_along_axis(bt[:, None, :], jnp.maximum(sel, 0), axis=2), 0)

            def missing(page_to_slot, phys=phys, layer=layer):
                return (phys != 0) & (page_to_slot[layer][phys] == 0)

            def bring(carry, phys=phys, layer=layer, missing=missing):
                # Up to M missing pages per round trip; a step without misses never enters.
                k_slots, v_slots, page_to_slot, _ = carry
                ok, slots, pages, evicted, kd, vd = io_callback(
                    functools.partial(host.serve, layer), fetch_shapes, phys, missing(page_to_slot), ordered=False)
                # Padding: slot n_slots + 1 and page num_pages are out of range, so dropped.
                if quantized:
                    kd, vd = kvquant.unpack(kd, spec.dtype), kvquant.unpack(vd, spec.dtype)
                at = (layer, slice(None), slots)  # [M, K, S, D] (numpy indexing)
                k_slots = kvquant.write(k_slots, at, kd, mode="drop")
                v_slots = kvquant.write(v_slots, at, vd, mode="drop")
                page_to_slot = page_to_slot.at[layer, evicted].set(0, mode="drop").at[layer, pages].set(slots, mode="drop")
                return k_slots, v_slots, page_to_slot, ok

            # The host stops the loop (ok = False) on an error, which the step raises afterwards.
            # The loop sits behind a cond: an idle while loop still costs a pass over its carry.
            def bring_all(k_slots, v_slots, page_to_slot, missing=missing, bring=bring):
                return jax.lax.while_loop(lambda c: c[3] & jnp.any(missing(c[2])), bring,
                                          (k_slots, v_slots, page_to_slot, jnp.bool_(True)))[:3]

            if spec.fetch:
                k_slots, v_slots, page_to_slot = jax.lax.cond(jnp.any(missing(page_to_slot)), bring_all,
                                                              lambda *c: c, k_slots, v_slots, page_to_slot)
            shift = compact_shift(sel, block_size) if sp.positions == "compact" else None
            out = attend_selected(attention, (q, positions), (k_slots[layer], v_slots[layer]),
                                  PageView(page_to_slot[layer][bt], ends), Selection(sel, shift, None if shift is None else inv_freq),
                                  windows[layer])
            h = model.layer_finish(layer, h, out.astype(q.dtype))
            sels.append(sel)
        logits = model.logits(h)[:, -1]
        return logits, DeviceKV(k_slots, v_slots, digests), jnp.stack(sels)

    return jax.jit(run, donate_argnums=(0,))


class FusedDecode:
    """Host side of the one-program decode step over an engine's `TieredStore`: builds the programs
    (one per batch shape, kept for the engine's life: `RunContext.program`) and serves their
    callbacks for the step running (the runner does the step's bookkeeping afterwards)."""

    def __init__(self, store: TieredStore, ctx: RunContext):
        self.store = store
        self.ctx = ctx
        self._programs: dict = {}
        self._error: Exception | None = None
        self.batch = FETCH_BATCH
        self._bt = self._ends = None  # the running step's block tables and lengths (for callbacks)
        self.fetching = True  # whether the last step could miss pages (False: all in slots, no prefetch)

    def usable(self, B: int) -> bool:
        """Whether a step of B sequences runs as one program (else: layer by layer)."""
        ctx, store = self.ctx, self.store
        sp = ctx.config.sparse
        # Quantized pools run layer by layer: XLA's CPU compiler crashed (SIGSEGV) once compiling
        # the one-program step over int8 slots, and the crash did not recur in three reruns; this
        # path stays off until that is understood.
        if not (sp.enabled and sp.dense_layers == 0 and store.mesh is None and store.tc.fused_decode
                and store.selection_edit is None and not store.quantized):
            return False
        # One layer's selection (every kv head may pick different pages) plus the pinned pages
        # must fit its slots at once.
        pins = max(store.slots.pinned_count(layer) for layer in range(ctx.model_cfg.num_layers))
        return B * ctx.model_cfg.num_kv_heads * (sp.budget // store.S) + pins <= store.slots.capacity

    # ---- callbacks (run on the host while the program waits) ---------------------------------
    def serve(self, layer: int, phys, missing):
        """Admit and read the missing pages of `layer`; padded to the program's static size."""
        store = self.store
        M = self.batch
        # Callbacks may receive jax arrays: index them as numpy (a jax boolean index is an eager
        # op with a data-dependent shape, compiled anew on every call).
        phys, missing = np.asarray(phys), np.asarray(missing)
        K, S, D = store.cfg.num_kv_heads, store.S, store.spec.row  # pages as stored
        slots = np.full(M, store.n_slots + 1, np.int32)
        pages = np.full(M, store.num_pages, np.int32)
        evicted = np.full(M, store.num_pages, np.int32)
        ks = np.zeros((M, K, S, D), store.np_dtype)
        vs = np.zeros((M, K, S, D), store.np_dtype)
        if self._error is not None:
            return np.bool_(False), slots, pages, evicted, ks, vs
        try:
            protect = frozenset((layer, int(p)) for p in np.unique(phys) if p != 0)
            for i, p in enumerate(np.unique(phys[missing])[:M]):
                key = (layer, int(p))
                page = store.read_below(key)
                a = store.slots.admit(key, protect=protect)
                store.place(a)
                if a.evicted is not None:
                    evicted[i] = a.evicted[1]
                slots[i], pages[i] = a.slot, int(p)
                ks[i], vs[i] = page.k, page.v
            if not (pages < store.num_pages).any():
                raise TierError(f"layer {layer}: the device program reported missing pages but none could be "
                                f"brought in (internal residency mismatch).")
        except Exception as err:  # raised by the step once the program returns (typed, not wrapped)
            self._error = err
            return np.bool_(False), slots, pages, evicted, ks, vs
        return np.bool_(True), slots, pages, evicted, ks, vs

    def speculate(self, layer: int, guess) -> None:
        """A lookahead guess for `layer` of this step: start fetching its pages now."""
        store = self.store
        if self._error is not None:
            return
        try:
            store.predictor.speculate(layer, self._bt, np.asarray(guess), self._ends)
            store.prefetch(store.predictor.lookahead_keys(layer))
        except Exception as err:
            self._error = err

    # ---- the step ----------------------------------------------------------------------------
    def program(self, B: int, W: int, fetch: bool = True):
        ctx, store = self.ctx, self.store
        sp = ctx.config.sparse
        key = (B, W, fetch)
        if key not in self._programs:
            spec = FusedSpec(model_cfg=ctx.model_cfg, sp=sp,
                             # Nothing missing also means nothing to prefetch: no lookahead either.
                             sp_ahead=lookahead.selection(sp, store.tc) if fetch else None,
                             depth=store.tc.prefetch_depth, block_size=store.S, fetch_batch=self.batch,
                             dtype=jnp.dtype(store.dtype), fetch=fetch)
            self._programs[key] = _program(ctx.graphdef, self, spec)
        return self._programs[key]

    def __call__(self, tokens_d, call: CallArrays, bt, ends):
        """Run the step (`bt`, `ends`: the call's block tables and lengths as numpy, for the
        callbacks); returns (logits, selections i32[L, B, K, k] as numpy)."""
        store = self.store
        self._error = None
        self._bt, self._ends = bt, ends
        # Every page of the step's tables in a slot of every layer (nothing can be missing): the
        # program without callbacks.
        used = bt[bt != 0]
        self.fetching = bool(used.size) and not np.all(store.page_to_slot[:, used])
        run = self.program(*bt.shape, fetch=self.fetching)

        def step(kv):
            logits, kv, sels = run(kv, self.ctx.params, tokens_d, call, np.array(store.page_to_slot))
            return kv, (logits, sels)

        logits, sels = store.update(step)
        sels = np.asarray(sels)  # waits for the program (and so for every callback)
        if self._error is not None:
            err, self._error = self._error, None
            raise err
        return logits, sels
