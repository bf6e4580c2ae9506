"""The engine over tiers: KV pages in a bounded set of device slots, the rest in host RAM / on
disk, run layer by layer so the host can make each layer's pages resident before it attends.

One call (a prefill chunk or a decode step), for every layer l (DESIGN.md §7):

    q, k, v   = layer l's first half                                   (device)
    write k/v into the slots of the pages they land in; refresh those pages' digests
    full pages go down the tiers (write-through: `TierStack.put`, disk write asynchronous)
    needed    = the pages the queries read: top-k from digests (sparse) or every page (dense)
    in groups that fit the free slots: admit (hits are free), fetch misses through the
        prefetcher (staged -> hit; else a timed synchronous read = stall), copy them into
        their slots, attend; groups merge by log-sum-exp
    predictor -> prefetcher: start fetching what layers l+1 .. l+depth read last step, and
        (lookahead, sparse decode) what layer l+depth (from layer 0: layers 1 .. depth) selects
        when scored with a query made from layer l's input — dispatched before layer l's
        selection, read after its attention; after the last layer, the next step's layer 0
        from the embedding of this step's argmax token
    h         = layer l's second half                                  (device)

A sparse decode step that fits (see `gemini_jax.tiers.fused`) runs instead as one device
program whose host callbacks bring only the missing pages; the layer loop above stays the path
for prefill, dense layers, meshes and selections larger than the slots.

Exactness: a page's bytes are the same in a slot, in host RAM and on disk, and digests live on
device for every page, so selection is the all-resident selection. Attention over one group is
the all-resident sparse attention over the same pages; over several groups (a dense layer
whose pages do not fit) it is the same softmax, summed in parts (equal to rounding).

`TieredKV` is the engine's persistent state (slots, digests, stores); `TieredRunner` runs one
batch of sequences through it, with the same interface as the engine's other runners.
"""

from __future__ import annotations

import dataclasses
import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.attention import digests as D
from gemini_jax.attention.select import compact_shift, select_step
from gemini_jax.attention.sparse import merge_parts, sparse_attention
from gemini_jax.cache.paged import write_pages
from gemini_jax.engine import _call_width, _PrefillRunner
from gemini_jax.errors import CacheExhausted
from gemini_jax.model import layers as L
from gemini_jax.tiers.errors import TierError
from gemini_jax.tiers.fused import FusedDecode
from gemini_jax.tiers.page import PageSpec
from gemini_jax.tiers.prefetch import Predictor, Prefetcher
from gemini_jax.tiers.residency import DeviceSlots, HotZone
from gemini_jax.tiers.sharded import ShardedTierStack
from gemini_jax.tiers.stack import TierStack


def _pow2(n: int) -> int:
    b = 1
    while b < n:
        b *= 2
    return b


# ---- jitted pieces (pure; the host loop strings them together) --------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _embed(graphdef, params, tokens):
    return nnx.merge(graphdef, params).embed_tokens(tokens)




@functools.partial(jax.jit, static_argnums=0)
def _finish(graphdef, params, layer, h, attn):
    return nnx.merge(graphdef, params).layer_finish(layer, h, attn)


@functools.partial(jax.jit, static_argnums=0)
def _logits(graphdef, params, h, select):
    h = jnp.take_along_axis(h, select[:, None, None], axis=1)
    return nnx.merge(graphdef, params).logits(h)[:, 0]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sp", "block_size"))
def _lookahead(graphdef, params, layer, h, positions, digests, page_table, window, unrope=None, *, sp, block_size):
    """Layer `layer`'s selection predicted from an earlier layer's input `h` (its q projection of
    `h` instead of its own input): what the prefetcher should bring before `layer` runs."""
    q, _, _ = nnx.merge(graphdef, params).layer_qkv(layer, h, positions)
    return select_step(sp, digests[layer], q, positions, page_table, block_size=block_size, window=window,
                       inv_freq=unrope)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sp", "block_size"))
def _lookahead_next(graphdef, params, logits, positions, digests, page_table, window, unrope=None, *, sp,
                    block_size):
    """The next step's layer-0 selection, guessed from the embedding of this step's argmax token."""
    model = nnx.merge(graphdef, params)
    h = model.embed_tokens(jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])
    q, _, _ = model.layer_qkv(0, h, positions)
    return select_step(sp, digests[0], q, positions, page_table, block_size=block_size, window=window,
                       inv_freq=unrope)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("kind", "sp", "block_size"), donate_argnums=(1, 2, 3))
def _front(graphdef, k_slots, v_slots, digests, params, layer, h, positions, slot_table, page_table, lengths, window,
           unrope=None, *, kind, sp, block_size):
    """A layer's first half in one call: q/k/v, the new K/V into their slots, digests refreshed, and
    (sp not None) the pages the queries select. One dispatch instead of three per layer. `unrope`:
    the rope's inv_freq when `sparse.score_distance` digests keys before rope."""
    q, k, v = nnx.merge(graphdef, params).layer_qkv(layer, h, positions)
    k_slots, v_slots = write_pages(k_slots, v_slots, layer, k, v, positions, slot_table, lengths)
    if kind is not None:
        digests = D.update(kind, digests, k_slots, layer, positions, slot_table, lengths, digest_tables=page_table,
                           unrope=unrope)
    selected = None
    if sp is not None:
        selected = select_step(sp, digests[layer], q, positions, page_table, block_size=block_size, window=window,
                               lengths=lengths, inv_freq=unrope)
    return q, k_slots, v_slots, digests, selected


@functools.partial(jax.jit, static_argnums=0, static_argnames=("scale", "cap"))
def _back(graphdef, params, layer, h, q, positions, k_slots, v_slots, slot_table, lengths, selected, window,
          page_shift=None, inv_freq=None, *, scale, cap):
    """A layer's second half in one call when its pages fit the slots at once: attention, then the
    output projection and MLP."""
    out = sparse_attention(q, positions, k_slots[layer], v_slots[layer], slot_table, lengths, selected,
                           scale=scale, cap=cap, window=window, page_shift=page_shift, inv_freq=inv_freq)
    return nnx.merge(graphdef, params).layer_finish(layer, h, out.astype(q.dtype))






@functools.partial(jax.jit, donate_argnums=(0, 1))
def _fill(k_slots, v_slots, layer, slots, k, v):
    """Pages k, v [n, K, S, D] into `slots` [n] of `layer` (out-of-range slots: padding, dropped)."""
    return (k_slots.at[layer, :, slots].set(k, mode="drop"), v_slots.at[layer, :, slots].set(v, mode="drop"))


@jax.jit
def _read(k_slots, v_slots, layer, slots):
    """Pages in `slots` [n] of `layer` -> k, v [n, K, S, D]."""
    return jnp.moveaxis(k_slots[layer][:, slots], 1, 0), jnp.moveaxis(v_slots[layer][:, slots], 1, 0)


@functools.partial(jax.jit, static_argnames=("scale", "cap"))
def _attend(q, positions, k_slots, v_slots, layer, slot_table, lengths, selected, window, acc, acc_lse,
            page_shift=None, inv_freq=None, *, scale, cap):
    out, lse = sparse_attention(q, positions, k_slots[layer], v_slots[layer], slot_table, lengths, selected,
                                scale=scale, cap=cap, window=window, return_lse=True, page_shift=page_shift,
                                inv_freq=inv_freq)
    if acc is None:  # the first group: nothing to merge with
        return out.astype(q.dtype), lse
    return merge_parts(acc, acc_lse, out, lse)


class TieredKV:
    """Device slots, all-page digests and the stores below: the engine's KV state under tiers.

    Owners: `slots` (which page of which layer sits in which slot), `page_to_slot` (the same
    map as an array, for building slot tables), `below` (pages whose current content is stored
    in a tier below; only those may be evicted or prefetched), `stack` / `prefetcher`.
    """

    def __init__(self, eng):
        cfg, ec = eng.model_cfg, eng.config
        tc, S = ec.tier, ec.cache.block_size
        self.cfg, self.tc, self.S = cfg, tc, S
        self.num_pages = ec.num_pages
        self.dtype = eng.cache_dtype
        L = cfg.num_layers
        self.n_slots = tc.device_slots(self.num_pages)
        self.slots = DeviceSlots(L, self.n_slots + 1, reserved=(0,))  # slot 0: null, never written
        shape = (L, cfg.num_kv_heads, self.n_slots + 1, S, cfg.head_dim)
        # On a mesh the slots and digests are sharded by kv head over `model` (as the all-resident
        # pool is), pages cross to the device already split by head (`_page_sharding`), and each
        # shard of heads has its own stores below (`ShardedTierStack`).
        self.mesh = eng.mesh
        pool = None
        self._page_sharding = None
        if self.mesh is not None:
            from jax.sharding import NamedSharding, PartitionSpec

            from gemini_jax import distributed

            pool = distributed.pool_sharding(self.mesh)
            self._page_sharding = NamedSharding(self.mesh, PartitionSpec(None, "model", None, None))
        # zeros: masked reads of unfilled slots stay finite
        self.k = jnp.zeros(shape, self.dtype, device=pool)
        self.v = jnp.zeros(shape, self.dtype, device=pool)
        sp = ec.sparse
        self.digests = None
        if sp.enabled:
            ddt = jnp.dtype(sp.digest_dtype or self.dtype)
            self.digests = D.create(sp.digest, L, cfg.num_kv_heads, self.num_pages, cfg.head_dim, ddt)
            if pool is not None:
                self.digests = jax.device_put(self.digests, pool)
        self.page_to_slot = np.zeros((L, self.num_pages), np.int32)
        self.spec = PageSpec(num_layers=L, num_pages=self.num_pages, kv_heads=cfg.num_kv_heads, block_size=S,
                             head_dim=cfg.head_dim, dtype=jnp.dtype(self.dtype).name)
        shards = 1 if self.mesh is None else self.mesh.shape["model"]
        self.stack = TierStack(self.spec, tc) if shards == 1 else ShardedTierStack(self.spec, tc, shards)
        self.prefetcher = Prefetcher(self.stack, capacity=tc.staging_pages, workers=tc.io_workers)
        self.predictor = Predictor(tc, L, block_size=S)
        self.hot = HotZone(tc, L)
        self.below: set = set()
        self.fused_steps = 0  # decode steps run as one device program (tiers.fused)
        self.fused_program_seconds = 0.0  # time in those programs (their host callbacks included)
        self.np_dtype = self.spec.np_dtype
        # Research hook: set to a list to record every sparse selection ({"layer", "decode",
        # "positions", "selected": logical ids [B, K, k]}); None records nothing.
        self.selection_log: list | None = None
        # Research hook: a function (layer, decode, positions [B, T], selected [B, K, k]) -> selected
        # of the same shape (logical ids, ascending, -1 padded) that replaces a sparse selection
        # before the pages are read (e.g. an oracle that forces chosen pages in); None changes
        # nothing. Set, it runs decode steps layer by layer (the one-program step selects on device).
        self.selection_edit = None
        # Device scalars made once: creating one per layer per call is a dispatch each time.
        self.layer_ids = [jnp.int32(layer) for layer in range(L)]
        self.windows = [jnp.int32(w) for w in cfg.layer_windows]

    # ---- residency ---------------------------------------------------------------------------
    def forget(self, pages) -> None:
        """Pages (re)allocated by the cache: whatever a slot or a tier holds for them is stale."""
        for p in pages:
            for layer in range(self.cfg.num_layers):
                key = (layer, int(p))
                if self.slots.release(key) is not None:
                    self.page_to_slot[layer, p] = 0
                self.stack.discard(key)
                self.prefetcher.invalidate(key)
                self.below.discard(key)

    def admit(self, layer: int, pages, *, fetch=True) -> None:
        """Make `pages` of `layer` resident together. Misses are read from below when `fetch` is
        True or (a set) holds the page; the others are fresh pages about to be written."""
        keys = [(layer, int(p)) for p in pages]
        adms = self.slots.ensure(keys)
        missing_keys, missing_slots = [], []
        for a in adms:
            self.place(a)
            if not a.hit and (fetch is True or (fetch is not False and a.key[1] in fetch)):
                missing_keys.append(a.key)
                missing_slots.append(a.slot)
        if missing_keys:
            self._fill(layer, missing_keys, missing_slots)

    def place(self, a) -> None:
        """Record an `Admission` in `page_to_slot` (the evicted key, if any, leaves its slot)."""
        if a.evicted is not None:
            self.page_to_slot[a.evicted] = 0
        self.page_to_slot[a.key] = a.slot

    def read_below(self, key):
        """A page the device needs now, from the prefetcher (staged hit or timed miss)."""
        if key not in self.below:
            raise TierError(f"page (layer={key[0]}, page={key[1]}) is needed on device but no tier holds "
                            f"its current content (a partial page must stay pinned: tier.pin_local_pages).")
        page = self.prefetcher.get(key)
        if page is None:  # on_corrupt="recompute": the stack refused a bad page
            raise TierError(f"page (layer={key[0]}, page={key[1]}) failed verification and recomputing "
                            f"pages is not supported by the engine; set tier.on_corrupt='raise'.")
        return page

    def prefetch(self, keys) -> None:
        """Start fetching the keys (most wanted first) that are stored below and not in a slot."""
        self.prefetcher.schedule(key for key in keys if key in self.below and self.page_to_slot[key] == 0)

    def _fill(self, layer, keys, slots) -> None:
        ks, vs = [], []
        for key in keys:
            page = self.read_below(key)
            ks.append(page.k)
            vs.append(page.v)
        n = _pow2(len(keys))
        pad = n - len(keys)
        if pad:  # padded slots are out of range: dropped by the scatter
            ks += [ks[0]] * pad
            vs += [vs[0]] * pad
        idx = np.full(n, self.n_slots + 1, np.int32)
        idx[:len(slots)] = slots
        self._fill_slots(layer, idx, np.stack(ks), np.stack(vs))

    def _fill_slots(self, layer, idx, k, v) -> None:
        """Pages k, v [n, K, S, D] (numpy) into slots `idx` [n] of `layer`. On a mesh each device
        receives only its heads of the pages."""
        if self._page_sharding is not None:
            k, v = jax.device_put(k, self._page_sharding), jax.device_put(v, self._page_sharding)
        self.k, self.v = _fill(self.k, self.v, self.layer_ids[layer], idx, k, v)

    def put_below(self, layer: int, pages) -> None:
        """Full pages of `layer` (resident) go down the tiers."""
        pages = [int(p) for p in pages]
        if not pages:
            return
        n = _pow2(len(pages))
        idx = np.zeros(n, np.int32)
        idx[:len(pages)] = self.page_to_slot[layer, pages]
        k, v = _read(self.k, self.v, self.layer_ids[layer], idx)
        k, v = np.asarray(k), np.asarray(v)
        for i, p in enumerate(pages):
            key = (layer, p)
            self.prefetcher.invalidate(key)
            self.stack.put(key, k[i], v[i])
            self.below.add(key)

    # ---- whole pages in and out (sessions: snapshot, restore, rewind) ---------------------------
    def gather(self, pages):
        """Every layer's KV and digests of physical `pages`, wherever each lives -> k, v
        [L, K, n, S, D] (numpy), digests [L, K, n, R, D] or None. The null page reads as zeros;
        pages from disk are verified (IntegrityError names a corrupt one)."""
        cfg, L = self.cfg, self.cfg.num_layers
        pages = [int(p) for p in pages]
        k = np.zeros((L, cfg.num_kv_heads, len(pages), self.S, cfg.head_dim), self.np_dtype)
        v = np.zeros_like(k)
        for layer in range(L):
            on_device = [(i, p) for i, p in enumerate(pages) if p != 0 and self.page_to_slot[layer, p] != 0]
            if on_device:
                idx = np.asarray([self.page_to_slot[layer, p] for _, p in on_device], np.int32)
                kk, vv = (np.asarray(a) for a in _read(self.k, self.v, self.layer_ids[layer], idx))
                for j, (i, _) in enumerate(on_device):
                    k[layer, :, i], v[layer, :, i] = kk[j], vv[j]
            for i, p in enumerate(pages):
                if p == 0 or self.page_to_slot[layer, p] != 0:
                    continue
                page = self.stack.get((layer, p)) if (layer, p) in self.below else None
                if page is None:
                    raise TierError(f"page (layer={layer}, page={p}) is neither on device nor in a tier below.")
                k[layer, :, i], v[layer, :, i] = page.k, page.v
        dig = None if self.digests is None else np.asarray(self.digests[:, :, np.asarray(pages, np.int32)])
        return k, v, dig

    def scatter(self, pages, k, v, digests=None, *, partial=()) -> None:
        """Write whole pages (physical ids; k, v [L, K, n, S, D], digests [L, K, n, R, D]) into
        the tiers: full pages go below the device (as a filled page would); pages in `partial`
        (not full yet, so never stored below) go into device slots."""
        pages = [int(p) for p in pages]
        partial = {int(p) for p in partial}
        self.forget(pages)  # whatever a slot or a tier held for these ids is stale
        for layer in range(self.cfg.num_layers):
            part = []
            for i, p in enumerate(pages):
                if p in partial:
                    part.append((i, p))
                else:
                    self.stack.put((layer, p), np.asarray(k[layer, :, i]), np.asarray(v[layer, :, i]))
                    self.below.add((layer, p))
            if part:
                self.admit(layer, [p for _, p in part], fetch=False)
                idx = np.asarray([self.page_to_slot[layer, p] for _, p in part], np.int32)
                self._fill_slots(layer, idx, np.stack([np.asarray(k[layer, :, i]) for i, _ in part]),
                                 np.stack([np.asarray(v[layer, :, i]) for i, _ in part]))
        if digests is not None and self.digests is not None:
            self.digests = self.digests.at[:, :, np.asarray(pages, np.int32)].set(
                jnp.asarray(digests, self.digests.dtype))

    def copy_page(self, src: int, dst: int) -> None:
        """A private copy of partial page `src` at `dst` (a rewind's copy-on-write)."""
        k, v, dig = self.gather([src])
        self.scatter([dst], k, v, dig, partial=[dst])

    def stats(self) -> dict:
        """Tier counters: device slots, host and disk stores, KV bytes held per tier."""
        held = self.stack.bytes_held()
        per_device = sum(a.addressable_shards[0].data.nbytes for a in (self.k, self.v))
        out = {"device_slots_per_layer": self.n_slots, "device_hits": self.slots.hits,
               "device_misses": self.slots.misses, "device_evictions": self.slots.evictions,
               "kv_bytes_device": int(self.k.nbytes + self.v.nbytes), "kv_bytes_per_device": int(per_device),
               "kv_bytes_host": held["host"], "fused_decode_steps": self.fused_steps,
               "fused_program_seconds": self.fused_program_seconds,
               **self.stack.stats(), **{k: v for k, v in self.prefetcher.stats.items()}}
        if held["disk"] is not None:
            out["kv_bytes_disk"] = held["disk"]
        if self.digests is not None:
            out["digest_bytes_device"] = int(self.digests.nbytes)
        return out

    def close(self) -> None:
        self.prefetcher.close()
        self.stack.close()


def t_digest_itemsize(t: TieredKV) -> int:
    return 0 if t.digests is None else t.digests.dtype.itemsize


class TieredRunner(_PrefillRunner):
    """Sequences of one `generate` batch, run layer by layer over `TieredKV`."""

    def __init__(self, eng, B: int, stats: dict):
        self.eng, self.stats = eng, stats
        self.t: TieredKV = eng.tiered
        self.ids = [next(eng._seq_ids) for _ in range(B)]
        self.window = eng.model_cfg.max_window
        self.inv_freq = jnp.asarray(L.inv_frequencies(eng.model_cfg.rope, eng.model_cfg.head_dim))
        sp = eng.config.sparse
        # sparse.score_distance: digests of keys before rope, queries turned to that distance.
        self.unrope = self.inv_freq if sp.enabled and sp.score_distance > 0 else None
        self.fused = FusedDecode(self)

    # ---- the engine's runner interface (prefill / prefill_more: _PrefillRunner) ---------------
    def _prefill_from(self, sid, toks, start):
        e = self.eng
        logits = None
        for padded, pos, n in e._prefill_chunks(toks, start):
            first, end = int(pos[0]), int(pos[0]) + n
            self._reserve(sid, end)
            logits, _ = self._call([sid], padded[None], pos[None], np.array([first]), np.array([end]),
                                   np.array([n - 1]), decode=False)
            e.kv.commit(sid, padded[:n])
            self._drop_window(sid)
            self.stats["prefill_tokens_computed"] += n
            self.stats["compute_units"] += n * e.model_cfg.num_layers
        return logits

    def decode(self, nxt, lengths):
        e = self.eng
        for sid, n in zip(self.ids, lengths):
            self._reserve(sid, int(n) + 1)
        width = _call_width(e, self.ids, 1)  # the call's block-table width (digests scored)
        logits, reads = self._call(self.ids, nxt[:, None], lengths[:, None], np.asarray(lengths),
                                   np.asarray(lengths) + 1, np.zeros(len(self.ids), np.int32), decode=True)
        for sid, tok in zip(self.ids, nxt):
            e.kv.commit(sid, [int(tok)])
            self._drop_window(sid)
        cfg, S = e.model_cfg, e.config.cache.block_size
        self.stats["kv_bytes_read"] += reads * 2 * S * cfg.head_dim * e.cache_dtype.itemsize
        sp = e.config.sparse
        if sp.enabled:
            self.stats["pages_selected"] += reads
            # Selection scored every page of the block table in every sparse layer, from digests.
            self.stats["digest_bytes_read"] += (max(cfg.num_layers - sp.dense_layers, 0) * len(self.ids) * width
                                                * cfg.num_kv_heads * D.ROWS[sp.digest] * cfg.head_dim
                                                * t_digest_itemsize(self.t))
        return logits

    def close(self):
        for sid in self.ids:
            if sid in self.eng.kv.seqs:
                self.eng.kv.free(sid)  # pages stay valid (prefix cache) until reallocated

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _reserve(self, sid, total):
        seq = self.eng.kv.seqs[sid]
        before = len(seq.pages)
        self.eng.kv.reserve(sid, total)
        self.t.forget(seq.pages[before:])

    def _drop_window(self, sid):
        self.eng.kv.drop_outside_window(sid, self.window)

    def _pins(self, bt, starts, ends):
        t, S, kv = self.t, self.t.S, self.eng.kv
        # Every live sequence of the batch keeps its sink and last pages (its partial page among
        # them) pinned, not only the ones in this call: prefill runs one sequence at a time.
        # A call continues the partial page that was the last before it and pins the pages after it.
        live = [s for s in self.ids if s in kv.seqs]
        width = max(len(kv.seqs[s].pages) for s in live)
        fixed = t.hot.fixed(kv.block_tables(live, width), [kv.seqs[s].num_tokens for s in live], block_size=S)
        fixed |= t.hot.fixed(bt, starts, block_size=S) | t.hot.fixed(bt, ends, block_size=S)
        t.slots.set_pins("fixed", fixed)

    # ---- one call, layer by layer -----------------------------------------------------------------
    def _call(self, ids, tokens, positions, starts, ends, select, *, decode: bool):
        e, t = self.eng, self.t
        cfg, sp = e.model_cfg, e.config.sparse
        S, L = t.S, cfg.num_layers
        width = _call_width(e, ids, tokens.shape[1])
        bt = e.kv.block_tables(ids, width)  # page ids, 0 = null
        self._pins(bt, starts, ends)
        B, T = tokens.shape
        # Copies: jax may alias host buffers, and callers reuse theirs while our calls still run.
        tokens_d, pos_d = jnp.array(tokens, jnp.int32, copy=True), jnp.array(positions, jnp.int32, copy=True)
        ends_d, bt_d = jnp.array(ends, jnp.int32, copy=True), jnp.array(bt, copy=True)
        windows = cfg.layer_windows
        before = dict(t.prefetcher.stats)
        reads = 0
        # Pages written by this call, and those it fills (which then go below), per row.
        written = [list(range(int(s) // S, (int(en) - 1) // S + 1)) for s, en in zip(starts, ends)]
        filled = [[p for p in w if (p + 1) * S <= int(en)] for w, en in zip(written, ends)]
        # A row's first written page holds earlier tokens unless the call starts on a page boundary.
        continued = sorted({int(bt[b, w[0]]) for b, (w, s) in enumerate(zip(written, starts)) if int(s) % S})
        fresh = sorted({int(bt[b, p]) for b in range(B) for p in written[b]} - set(continued))
        fill_pages_ids = sorted({int(bt[b, p]) for b in range(B) for p in filled[b]})
        if decode and self.fused.usable(B):
            t.fused_steps += 1
            return self._call_fused(bt, bt_d, tokens_d, pos_d, positions, ends, ends_d, continued, fresh,
                                    fill_pages_ids, before)
        h = _embed(e.graphdef, e.params, tokens_d)
        depth = t.tc.prefetch_depth
        ahead_on = decode and sp.enabled and depth > 0 and t.tc.lookahead > 0
        # The lookahead guesses roughly: it selects `lookahead` x the budget.
        sp_ahead = dataclasses.replace(sp, budget=sp.budget * t.tc.lookahead) if ahead_on else None
        for layer in range(L):
            lyr = t.layer_ids[layer]
            window = int(windows[layer])
            # Lookahead targets: layer l+depth; layer 0 also covers 1 .. depth-1 (no earlier input
            # exists in this step). Dispatched now, read after this layer attends.
            targets = range(1, depth + 1) if layer == 0 else (layer + depth,)
            ahead = {j: _lookahead(e.graphdef, e.params, t.layer_ids[j], h, pos_d, t.digests, bt_d, t.windows[j],
                                   self.unrope, sp=sp_ahead, block_size=S)
                     for j in targets if ahead_on and sp.dense_layers <= j < L}
            # The pages written here: fresh ones need no fetch; a continued partial page is pinned.
            try:
                t.admit(layer, continued + fresh, fetch=set(continued))
            except CacheExhausted as err:
                raise CacheExhausted(
                    f"this call writes {len(continued + fresh)} pages per layer, which with the pinned pages "
                    f"do not fit {t.slots.capacity} device slots: lower prefill_chunk or max_batch, or raise "
                    f"tier.device_pages / device_fraction. ({err})") from None
            slot_table = t.page_to_slot[layer][bt]  # fresh array: passed as is (no eager device_put)
            sparse_here = sp.enabled and layer >= sp.dense_layers and (T == 1 or sp.sparse_prefill)
            q, t.k, t.v, t.digests, sel_d = _front(
                e.graphdef, t.k, t.v, t.digests, e.params, lyr, h, pos_d, slot_table, bt_d, ends_d, t.windows[layer],
                self.unrope, kind=sp.digest if sp.enabled else None, sp=sp if sparse_here else None, block_size=S)
            t.put_below(layer, fill_pages_ids)
            # Which pages the queries read.
            shift = None
            if sparse_here:
                selected = np.asarray(sel_d)
                if t.selection_edit is not None:
                    selected = np.asarray(t.selection_edit(layer, decode, np.array(positions), selected), np.int32)
                if sp.positions == "compact":  # from the whole selection, before it splits into groups
                    shift = compact_shift(selected, S)
                if t.selection_log is not None:
                    t.selection_log.append({"layer": layer, "decode": decode, "selected": selected,
                                            "positions": np.array(positions)})
            else:
                selected = self._dense_needed(bt, positions, ends, window)
            reads += int(np.sum(selected >= 0)) * (cfg.num_kv_heads if selected.shape[1] == 1 else 1)
            if selected.shape[1] == 1:
                selected = np.broadcast_to(selected, (B, cfg.num_kv_heads, selected.shape[2]))
            if decode:
                t.hot.record((layer, int(bt[b, p])) for b in range(B) for p in np.unique(selected[b])
                             if p >= 0 and bt[b, p] != 0)
            t.predictor.observe(layer, bt, selected, ends)
            h = self._attend_groups(layer, q, pos_d, bt, ends_d, selected, window, shift, h)
            t.prefetcher.release_layer(layer)
            for j, sel_j in ahead.items():
                t.predictor.speculate(j, bt, np.asarray(sel_j), ends)
            t.prefetch(t.predictor.predict(layer))
        logits = _logits(e.graphdef, e.params, h, np.asarray(select, np.int32))
        if ahead_on and sp.dense_layers == 0:
            self._guess_next_layer0(logits, pos_d, bt, bt_d, ends)
            t.prefetch(t.predictor.lookahead_keys(0))
        if decode:
            hot = t.hot.end_step()
            t.slots.set_pins("hot", hot)
        self._count_prefetch(before)
        return logits, reads

    def _guess_next_layer0(self, logits, pos_d, bt, bt_d, ends) -> None:
        """The next step's layer 0 has no earlier layer to guess from: score its digests with the
        embedding of this step's argmax token (when the next token still fits the block table)."""
        e, t = self.eng, self.t
        if int(np.max(ends)) >= bt.shape[1] * t.S:
            return
        sp = e.config.sparse
        sp_ahead = dataclasses.replace(sp, budget=sp.budget * t.tc.lookahead)
        nxt = _lookahead_next(e.graphdef, e.params, logits, pos_d + 1, t.digests, bt_d, t.windows[0],
                              self.unrope, sp=sp_ahead, block_size=t.S)
        t.predictor.speculate(0, bt, np.asarray(nxt), np.asarray(ends) + 1)

    def _count_prefetch(self, before: dict) -> None:
        """Add the prefetcher's counters since `before` (a copy of its stats) to the run's."""
        now = self.t.prefetcher.stats
        for key in ("prefetch_hits", "prefetch_misses", "pages_fetched_host", "pages_fetched_disk", "stall_seconds"):
            self.stats[key] += now[key] - before[key]

    def _call_fused(self, bt, bt_d, tokens_d, pos_d, positions, ends, ends_d, continued, fresh, fill_pages_ids,
                    before):
        """A sparse decode step as one device program (`gemini_jax.tiers.fused`); the host's
        bookkeeping for the step runs after it."""
        t, L = self.t, self.eng.model_cfg.num_layers
        for layer in range(L):  # the pages this step writes: resident before the program runs
            t.admit(layer, continued + fresh, fetch=set(continued))
        t0 = time.perf_counter()
        logits, sels = self.fused(tokens_d, pos_d, bt, bt_d, ends, ends_d)
        t.fused_program_seconds += time.perf_counter() - t0
        reads = 0
        for layer in range(L):
            selected = sels[layer]
            if t.selection_log is not None:
                t.selection_log.append({"layer": layer, "decode": True, "selected": selected,
                                        "positions": np.array(positions)})
            reads += int(np.sum(selected >= 0))
            phys = np.take_along_axis(bt[:, None, :], np.maximum(selected, 0), axis=2)[selected >= 0]
            keys = [(layer, int(p)) for p in np.unique(phys) if p != 0]
            for key in keys:  # the program read them: they are the layer's most recently used
                t.slots.touch(key)
            t.hot.record(keys)
            if t.tc.prefetch_depth > 0:  # history feeds only the prefetcher
                t.predictor.observe(layer, bt, selected, ends)
            t.put_below(layer, fill_pages_ids)
            t.prefetcher.release_layer(layer)
        if t.tc.prefetch_depth > 0 and t.tc.lookahead > 0:
            self._guess_next_layer0(logits, pos_d, bt, bt_d, ends)
        for layer in range(L):  # the next step's guesses (layer 0's lookahead first)
            t.prefetch(t.predictor.predict(layer))
        t.slots.set_pins("hot", t.hot.end_step())
        self._count_prefetch(before)
        return logits, reads

    def _dense_needed(self, bt, positions, ends, window):
        """Every page a dense layer reads: [B, 1, n] logical ids, -1 padded (window-aware)."""
        S = self.t.S
        rows = []
        for b in range(bt.shape[0]):
            n_pages = -(-int(ends[b]) // S)
            p = np.arange(n_pages)
            keep = bt[b, :n_pages] != 0
            if window > 0:  # pages wholly outside every query's window are never read
                keep &= (p + 1) * S - 1 > int(positions[b, 0]) - window
            rows.append(p[keep])
        n = max(1, max(len(r) for r in rows))
        out = np.full((bt.shape[0], 1, n), -1, np.int32)
        for b, r in enumerate(rows):
            out[b, 0, :len(r)] = r
        return out

    def _attend_groups(self, layer, q, pos_d, bt, ends_d, selected, window, shift, h):
        """Layer `layer`'s second half: attention over `selected` [B, K, n] in column groups whose
        pages fit the free slots (`shift` [B, K, n]: compact positions' per-page position change, or
        None), then the rest of the layer on `h`. Returns the layer's output."""
        t, cfg = self.t, self.eng.model_cfg
        B, K, n = selected.shape
        pinned = {p for (l, p) in t.slots._pinned if l == layer and t.page_to_slot[l, p] != 0}  # resident pins

        def pages_of(cols):
            s = selected[:, :, cols]
            # Page id 0 is the null page (a padded prefill chunk may select past the sequence's
            # end): its slot 0 holds zeros, masked by the lengths, and it is never admitted.
            return {int(bt[b, p]) for b in range(B) for p in np.unique(s[b]) if p >= 0} - {0}

        # The largest power-of-two split of the columns whose every group fits.
        groups = 1
        while True:
            size = -(-n // groups)
            parts = [slice(i, min(i + size, n)) for i in range(0, n, size)]
            sets = [pages_of(c) for c in parts]
            if all(len(s | pinned) <= t.slots.capacity for s in sets):
                break
            if size == 1:
                raise CacheExhausted(
                    f"layer {layer}: one column of the selection needs {max(len(s) for s in sets)} pages but "
                    f"{t.slots.capacity} device slots, {len(pinned)} of them pinned, cannot hold them; "
                    f"raise tier.device_pages / device_fraction or lower the batch, prefill_chunk or pins.")
            groups *= 2
        e = self.eng
        if len(parts) == 1:  # the common case: one fused call
            t.admit(layer, sorted(sets[0]), fetch=True)
            return _back(e.graphdef, e.params, t.layer_ids[layer], h, q, pos_d, t.k, t.v, t.page_to_slot[layer][bt],
                         ends_d, selected, t.windows[layer], shift, None if shift is None else self.inv_freq,
                         scale=cfg.scale, cap=cfg.attn_softcap)
        acc = acc_lse = None
        for cols, pages in zip(parts, sets):
            t.admit(layer, sorted(pages), fetch=True)
            sel = selected[:, :, cols]
            sh = None if shift is None else shift[:, :, cols]
            if len(parts) > 1:  # pad to a power of two: few shapes compile
                pad = ((0, 0), (0, 0), (0, _pow2(sel.shape[2]) - sel.shape[2]))
                sel = np.pad(sel, pad, constant_values=-1)
                sh = None if sh is None else np.pad(sh, pad)
            slot_table = t.page_to_slot[layer][bt]
            acc, acc_lse = _attend(q, pos_d, t.k, t.v, t.layer_ids[layer], slot_table, ends_d, sel,
                                   t.windows[layer], acc, acc_lse,
                                   sh, None if sh is None else self.inv_freq,
                                   scale=cfg.scale, cap=cfg.attn_softcap)
        return _finish(e.graphdef, e.params, t.layer_ids[layer], h, acc)

