"""The runner over tiers: KV pages in a bounded set of device slots, the rest in host RAM / on
disk (`gemini_jax.tiers.TieredStore`), run layer by layer so the host can make each layer's
pages resident before it attends.

One call (a prefill chunk or a decode step), for every layer l (docs/architecture.md §8):

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

A sparse decode step that fits (see `gemini_jax.runtime.fused`) runs instead as one device
program whose host callbacks bring only the missing pages; the layer loop above stays the path
for prefill, dense layers, meshes and selections larger than the slots.

Exactness: a page's bytes are the same in a slot, in host RAM and on disk, and digests live on
device for every page, so selection is the all-resident selection. Attention over one group is
the all-resident sparse attention over the same pages; over several groups (a dense layer
whose pages do not fit) it is the same softmax, summed in parts (equal to rounding).
"""

from __future__ import annotations

import functools
import time

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from gemini_jax.attention.select import compact_shift, select_step
from gemini_jax.attention.dispatch import AttentionImpl, attend_selected
from gemini_jax.attention.sparse import merge_parts
from gemini_jax.attention.views import PageView, Selection, Span
from gemini_jax.attention.pool import write_layer
from gemini_jax.cache.shapes import pow2_at_least
from gemini_jax.cache.store import DeviceKV
from gemini_jax.errors import CacheExhausted
from gemini_jax.model import layers
from gemini_jax.runtime.batch import CallArrays, LayerArrays, LayerProgram, StepBatch
from gemini_jax.runtime.chunking import call_width
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.counters import Counters
from gemini_jax.runtime.fused import FusedDecode
from gemini_jax.runtime import lookahead, soft
from gemini_jax.runtime.paged import SequenceRunner
from gemini_jax.tiers.errors import PageCorrupt
from gemini_jax.tiers.kv_store import TieredStore
from gemini_jax.tiers.write_log import WriteSpan


# ---- jitted pieces (pure; the host loop strings them together) --------------------------------
@functools.partial(jax.jit, static_argnums=0)
def _embed(prog: LayerProgram, params, tokens):
    return nnx.merge(prog.graphdef, params).embed_tokens(tokens)


@functools.partial(jax.jit, static_argnums=0)
def _finish(prog: LayerProgram, params, layer_index, h, attn):
    return nnx.merge(prog.graphdef, params).layer_finish(layer_index, h, attn)


@functools.partial(jax.jit, static_argnums=0)
def _logits(prog: LayerProgram, params, h, select):
    h = jnp.take_along_axis(h, select[:, None, None], axis=1)
    return nnx.merge(prog.graphdef, params).logits(h)[:, 0]


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sp",))
def _lookahead(prog: LayerProgram, params, target: LayerArrays, h, call: CallArrays, digests, *, sp):
    """Layer `target`'s selection predicted from an earlier layer's input `h`: what the prefetcher
    should bring before `target` runs."""
    return lookahead.guess(nnx.merge(prog.graphdef, params), sp, target.index, h, call, digests[target.index],
                           block_size=prog.block_size, window=target.window)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sp",))
def _lookahead_next(prog: LayerProgram, params, first: LayerArrays, logits, call: CallArrays, digests, *, sp):
    """The next step's layer-0 selection, guessed from the embedding of this step's argmax token
    (`call` holds the next step's positions)."""
    model = nnx.merge(prog.graphdef, params)
    h = model.embed_tokens(jnp.argmax(logits, axis=-1).astype(jnp.int32)[:, None])
    return lookahead.guess(model, sp, first.index, h, call, digests[first.index], block_size=prog.block_size,
                           window=first.window)


@functools.partial(jax.jit, static_argnums=0, static_argnames=("sp",), donate_argnums=(1,))
def _front(prog: LayerProgram, kv: DeviceKV, params, layer: LayerArrays, slot_table, h, call: CallArrays, *, sp):
    """A layer's first half in one call: q/k/v, the new K/V into their slots, digests refreshed, and
    (sp not None) the pages the queries select. One dispatch instead of three per layer.
    -> (q, kv, selected or None)."""
    q, k, v = nnx.merge(prog.graphdef, params).layer_qkv(layer.index, h, call.positions)
    k_slots, v_slots, dig = write_layer(kv.k, kv.v, kv.digests, layer.index, (k, v),
                                        Span(call.positions, call.lengths, slot_table, call.page_table),
                                        digest_kind=prog.digest_kind, unrope=call.unrope)
    selected = None
    if sp is not None:
        selected = select_step(sp, dig[layer.index], (q, call.positions), PageView(call.page_table, call.lengths),
                               block_size=prog.block_size, window=layer.window, inv_freq=call.unrope)
    return q, DeviceKV(k_slots, v_slots, dig), selected


def _attend_selected(prog: LayerProgram, kv: DeviceKV, layer: LayerArrays, q, view: tuple, sel: Selection, *,
                     return_lse=False):
    """Attention of `q` over the selected pages of `layer`'s slots. `view` = (call, slot_table)."""
    call, slot_table = view
    return attend_selected(prog.attention, (q, call.positions), (kv.k[layer.index], kv.v[layer.index]),
                           PageView(slot_table, call.lengths), sel, layer.window, return_lse=return_lse)


@functools.partial(jax.jit, static_argnums=0)
def _back(prog: LayerProgram, kv: DeviceKV, params, layer: LayerArrays, view: tuple, q, h, sel: Selection):
    """A layer's second half in one call when its pages fit the slots at once: attention, then the
    output projection and MLP. `view` = (call, slot_table)."""
    out = _attend_selected(prog, kv, layer, q, view, sel)
    return nnx.merge(prog.graphdef, params).layer_finish(layer.index, h, out.astype(q.dtype))


@functools.partial(jax.jit, static_argnums=0)
def _attend(prog: LayerProgram, kv: DeviceKV, layer: LayerArrays, q, view: tuple, sel: Selection, acc):
    """Attention over one group of pages, merged into `acc` = (out, lse) of the groups before
    (None: the first group)."""
    out, lse = _attend_selected(prog, kv, layer, q, view, sel, return_lse=True)
    if acc is None:  # the first group: nothing to merge with
        return out.astype(q.dtype), lse
    return merge_parts(acc[0], acc[1], out, lse)


class TieredRunner(SequenceRunner):
    """Sequences of one batch, run layer by layer over a `TieredStore`."""

    def __init__(self, ctx: RunContext, batch: int, stats: Counters):
        super().__init__(ctx, batch, stats)
        self.store: TieredStore = ctx.store
        cfg, sp = ctx.model_cfg, ctx.config.sparse
        # Over tiers attention runs on the XLA path (EngineConfig refuses "pallas" with tiers).
        self.prog = LayerProgram(graphdef=ctx.graphdef, attention=AttentionImpl.of(cfg, "xla"),
                                 digest_kind=sp.digest if sp.enabled else None, block_size=self.store.S)
        self.inv_freq = jnp.asarray(layers.inv_frequencies(cfg.rope, cfg.head_dim))
        # sparse.score_distance: digests of keys before rope, queries turned to that distance.
        self.unrope = self.inv_freq if sp.enabled and sp.score_distance > 0 else None
        self.layer_args = [LayerArrays(i, w) for i, w in zip(self.store.layer_ids, self.store.windows)]
        # One per engine, like its programs: a runner per `generate` call must not compile the
        # one-program step again (it did: ~1.5 s of every tiered `generate`).
        self.fused = ctx.program(("fused_decode",), lambda: FusedDecode(self.store, ctx))
        self._replaying = 0  # >0 while `_recompute` replays calls (they are already in the write log)

    # ---- bookkeeping ----------------------------------------------------------------------------
    def _reserve(self, sid, total):
        seq = self.ctx.pages.seqs[sid]
        before = len(seq.pages)
        self.ctx.pages.reserve(sid, total)
        self.store.forget(seq.pages[before:])

    def _pins(self, bt, starts, ends):
        store, S, kv = self.store, self.store.S, self.ctx.pages
        # Every live sequence of the batch keeps its sink and last pages (its partial page among
        # them) pinned, not only the ones in this call: prefill runs one sequence at a time.
        # A call continues the partial page that was the last before it and pins the pages after it.
        live = [s for s in self.ids if s in kv.seqs]
        width = max(len(kv.seqs[s].pages) for s in live)
        fixed = store.hot.fixed(kv.block_tables(live, width), [kv.seqs[s].num_tokens for s in live], block_size=S)
        fixed |= store.hot.fixed(bt, starts, block_size=S) | store.hot.fixed(bt, ends, block_size=S)
        store.slots.set_pins("fixed", fixed)

    # ---- one call, rebuilding pages that fail verification -----------------------------------------
    def _call(self, batch: StepBatch):
        """Run one call. With `tier.on_corrupt="recompute"`, a page that fails verification below
        the device (`PageCorrupt`) is rebuilt by replaying the calls that wrote it, and the call
        runs again: its state changes repeat exactly (K/V written at the same positions, digests
        recomputed from the pages' contents), so the retry's result is a clean run's."""
        if not self._replaying:
            for sid, start, end in zip(batch.ids, batch.starts, batch.ends):
                self.store.writes.record(self.ctx.pages.seqs[sid].pages,
                                         WriteSpan(int(start), int(end - start), batch.width, batch.decode))
        rebuilt = set()
        while True:
            try:
                return self._call_once(batch)
            except PageCorrupt as err:
                if self.store.tc.on_corrupt != "recompute" or err.key in rebuilt:
                    raise  # a page rebuilt within this call failed again: the disk keeps corrupting it
                self._recompute(err.key)
                rebuilt.add(err.key)

    def _recompute(self, key) -> None:
        """Rebuild page `key` (all its layers): replay, one sequence at a time, the calls that wrote
        it. A page read by a replay that is corrupt too is rebuilt first (the replay's own `_call`)."""
        ctx, layer, page = self.ctx, *key
        found = self.store.writes.spans(page)
        holder = None if found is None else next(
            (sid for sid, seq in ctx.pages.seqs.items()
             if len(seq.pages) > found[0] and seq.pages[found[0]] == page and seq.num_tokens >= (found[0] + 1) * self.store.S),
            None)
        if holder is None:
            raise PageCorrupt(f"page (layer={layer}, page={page}) failed verification below the device and cannot "
                              f"be recomputed: no call of this engine wrote it (it was restored from a snapshot or "
                              f"copied on a rewind). Restore the snapshot again.", key)
        toks = np.asarray(ctx.pages.seqs[holder].tokens, np.int32)
        self._replaying += 1
        try:
            for sp in found[1]:
                padded = np.zeros(sp.width, np.int32)
                padded[:sp.n] = toks[sp.start:sp.start + sp.n]
                self._call(StepBatch(ids=(holder,), tokens=padded[None],
                                     positions=np.arange(sp.start, sp.start + sp.width, dtype=np.int32)[None],
                                     starts=np.array([sp.start], np.int32), ends=np.array([sp.start + sp.n], np.int32),
                                     select=np.array([sp.n - 1], np.int32), decode=sp.decode))
        finally:
            self._replaying -= 1
        if (layer, page) not in self.store.below:  # the replay's last call fills the page and stores it below
            raise PageCorrupt(f"page (layer={layer}, page={page}): replaying its calls did not refill it.", key)
        self.stats.pages_recomputed += 1

    # ---- one call, layer by layer -----------------------------------------------------------------
    def _call_once(self, batch: StepBatch):
        ctx, store = self.ctx, self.store
        cfg, sp = ctx.model_cfg, ctx.config.sparse
        S, L = store.S, cfg.num_layers
        width = call_width(ctx.config, ctx.pages, batch.ids, batch.width)
        bt = ctx.pages.block_tables(batch.ids, width)  # page ids, 0 = null
        starts, ends, positions = batch.starts, batch.ends, batch.positions
        self._pins(bt, starts, ends)
        B, T = batch.tokens.shape
        fused = batch.decode and self.fused.usable(B)
        # Copies: jax may alias host buffers, and callers reuse theirs while our calls still run. The
        # one-program step takes fresh numpy copies (its one dispatch moves them); the layer loop
        # passes them to several calls per layer, so they go to the device once, here.
        copy = np.array if fused else functools.partial(jnp.array, copy=True)
        tokens_d = copy(batch.tokens, np.int32)
        call = CallArrays(copy(positions, np.int32), copy(bt, np.int32), copy(ends, np.int32), self.inv_freq,
                          self.unrope)
        windows = cfg.layer_windows
        before = dict(store.prefetcher.stats)
        reads = 0
        # Pages written by this call, and those it fills (which then go below), per row.
        written = [list(range(int(s) // S, (int(en) - 1) // S + 1)) for s, en in zip(starts, ends)]
        filled = [[p for p in w if (p + 1) * S <= int(en)] for w, en in zip(written, ends)]
        # A row's first written page holds earlier tokens unless the call starts on a page boundary.
        continued = sorted({int(bt[b, w[0]]) for b, (w, s) in enumerate(zip(written, starts)) if int(s) % S})
        fresh = sorted({int(bt[b, p]) for b in range(B) for p in written[b]} - set(continued))
        fill_pages_ids = sorted({int(bt[b, p]) for b in range(B) for p in filled[b]})
        if fused:
            store.fused_steps += 1
            writes = (continued, fresh, fill_pages_ids)
            logits, reads = self._call_fused(batch, bt, tokens_d, call, writes, before)
            return logits, (reads, 0, width)
        h = soft.model_input(ctx, batch.tokens)  # embeddings when the call holds soft tokens
        h = _embed(self.prog, ctx.params, tokens_d) if h is None else h
        depth = store.tc.prefetch_depth
        sp_ahead = lookahead.selection(sp, store.tc) if batch.decode else None
        for layer in range(L):
            here = self.layer_args[layer]
            window = int(windows[layer])
            # Dispatched now, read after this layer attends.
            targets = lookahead.targets(layer, depth, L, first=sp.dense_layers) if sp_ahead is not None else ()
            ahead = {j: _lookahead(self.prog, ctx.params, self.layer_args[j], h, call, store.device.digests, sp=sp_ahead)
                     for j in targets}
            # The pages written here: fresh ones need no fetch; a continued partial page is pinned.
            try:
                store.admit(layer, continued + fresh, fetch=set(continued))
            except CacheExhausted as err:
                raise CacheExhausted(
                    f"this call writes {len(continued + fresh)} pages per layer, which with the pinned pages "
                    f"do not fit {store.slots.capacity} device slots: lower prefill_chunk or max_batch, or raise "
                    f"tier.device_pages / device_fraction. ({err})") from None
            slot_table = store.page_to_slot[layer][bt]  # fresh array: passed as is (no eager device_put)
            sparse_here = sp.enabled and layer >= sp.dense_layers and (T == 1 or sp.sparse_prefill)

            def front(kv, here=here, slot_table=slot_table, h=h, sp_here=sp if sparse_here else None):
                q, kv, selected = _front(self.prog, kv, ctx.params, here, slot_table, h, call, sp=sp_here)
                return kv, (q, selected)

            q, sel_d = store.update(front)
            store.put_below(layer, fill_pages_ids)
            # Which pages the queries read.
            shift = None
            if sparse_here:
                selected = np.asarray(sel_d)
                if store.selection_edit is not None:
                    selected = np.asarray(store.selection_edit(layer, batch.decode, np.array(positions), selected),
                                          np.int32)
                if sp.positions == "compact":  # from the whole selection, before it splits into groups
                    shift = compact_shift(selected, S)
                if store.selection_log is not None:
                    store.selection_log.append({"layer": layer, "decode": batch.decode, "selected": selected,
                                            "positions": np.array(positions)})
            else:
                selected = self._dense_needed(bt, positions, ends, window)
            reads += int(np.sum(selected >= 0)) * (cfg.num_kv_heads if selected.shape[1] == 1 else 1)
            if selected.shape[1] == 1:
                selected = np.broadcast_to(selected, (B, cfg.num_kv_heads, selected.shape[2]))
            if batch.decode:
                store.hot.record((layer, int(bt[b, p])) for b in range(B) for p in np.unique(selected[b])
                             if p >= 0 and bt[b, p] != 0)
            store.predictor.observe(layer, bt, selected, ends)
            h = self._attend_groups(layer, q, (call, bt), Selection(selected, shift, None if shift is None
                                                                    else self.inv_freq), h)
            store.prefetcher.release_layer(layer)
            for j, sel_j in ahead.items():
                store.predictor.speculate(j, bt, np.asarray(sel_j), ends)
            store.prefetch(store.predictor.predict(layer))
        logits = _logits(self.prog, ctx.params, h, np.asarray(batch.select, np.int32))
        if sp_ahead is not None and sp.dense_layers == 0:
            self._guess_next_layer0(logits, call, bt, ends)
            store.prefetch(store.predictor.lookahead_keys(0))
        if batch.decode:
            hot = store.hot.end_step()
            store.slots.set_pins("hot", hot)
        self._count_prefetch(before)
        return logits, (reads, 0, width)

    def _guess_next_layer0(self, logits, call: CallArrays, bt, ends) -> None:
        """The next step's layer 0 has no earlier layer to guess from: score its digests with the
        embedding of this step's argmax token (when the next token still fits the block table)."""
        store = self.store
        if int(np.max(ends)) >= bt.shape[1] * store.S:
            return
        sp_ahead = lookahead.selection(self.ctx.config.sparse, store.tc)
        nxt = _lookahead_next(self.prog, self.ctx.params, self.layer_args[0], logits,
                              call._replace(positions=call.positions + 1), store.device.digests, sp=sp_ahead)
        store.predictor.speculate(0, bt, np.asarray(nxt), np.asarray(ends) + 1)

    def _count_prefetch(self, before: dict) -> None:
        """Add the prefetcher's counters since `before` (a copy of its stats) to the run's."""
        now = self.store.prefetcher.stats
        for key in ("prefetch_hits", "prefetch_misses", "pages_fetched_host", "pages_fetched_disk", "stall_seconds"):
            setattr(self.stats, key, getattr(self.stats, key) + now[key] - before[key])

    def _call_fused(self, batch: StepBatch, bt, tokens_d, call: CallArrays, writes: tuple, before: dict):
        """A sparse decode step as one device program (`gemini_jax.runtime.fused`); the host's
        bookkeeping for the step runs after it. `writes` = (continued, fresh, filled) page ids."""
        store, L = self.store, self.ctx.model_cfg.num_layers
        continued, fresh, fill_pages_ids = writes
        for layer in range(L):  # the pages this step writes: resident before the program runs
            store.admit(layer, continued + fresh, fetch=set(continued))
        t0 = time.perf_counter()
        logits, sels = self.fused(tokens_d, call, bt, np.asarray(batch.ends))
        store.fused_program_seconds += time.perf_counter() - t0
        valid = sels >= 0  # [L, B, K, k] logical ids, -1 padded
        reads = int(valid.sum())
        # Physical page ids the program read, every layer at once (0: padding or the null page).
        phys = np.where(valid, np.take_along_axis(bt[None, :, None, :], np.maximum(sels, 0), axis=3), 0)
        hot_on = store.tc.hot_threshold > 0
        prefetching = store.tc.prefetch_depth > 0 and self.fused.fetching
        for layer in range(L):
            if store.selection_log is not None:
                store.selection_log.append({"layer": layer, "decode": True, "selected": sels[layer],
                                            "positions": np.array(batch.positions)})
            pages = np.unique(phys[layer]).tolist()
            if pages and pages[0] == 0:
                pages = pages[1:]
            store.slots.touch_many(layer, pages)  # the program read them: the layer's most recently used
            if hot_on:
                store.hot.record((layer, p) for p in pages)
            # History feeds only the prefetcher; with every page in a slot there is nothing to fetch.
            if prefetching:
                store.predictor.observe(layer, bt, sels[layer], batch.ends)
            store.put_below(layer, fill_pages_ids)
            store.prefetcher.release_layer(layer)
        if prefetching and store.tc.lookahead > 0:
            self._guess_next_layer0(logits, call, bt, batch.ends)
        for layer in range(L if prefetching else 0):  # the next step's guesses (layer 0's lookahead first)
            store.prefetch(store.predictor.predict(layer))
        store.slots.set_pins("hot", store.hot.end_step())
        self._count_prefetch(before)
        return logits, reads

    def _dense_needed(self, bt, positions, ends, window):
        """Every page a dense layer reads: [B, 1, n] logical ids, -1 padded (window-aware)."""
        S = self.store.S
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

    def _attend_groups(self, layer, q, where: tuple, sel: Selection, h):
        """Layer `layer`'s second half: attention over `sel.pages` [B, K, n] in column groups whose
        pages fit the free slots, then the rest of the layer on `h`. `where` = (call, block
        tables). Returns the layer's output."""
        store, ctx = self.store, self.ctx
        call, bt = where
        selected, shift, inv_freq = sel
        B, K, n = selected.shape
        pinned = store.pinned_resident(layer)

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
            if all(len(s | pinned) <= store.slots.capacity for s in sets):
                break
            if size == 1:
                raise CacheExhausted(
                    f"layer {layer}: one column of the selection needs {max(len(s) for s in sets)} pages but "
                    f"{store.slots.capacity} device slots, {len(pinned)} of them pinned, cannot hold them; "
                    f"raise tier.device_pages / device_fraction or lower the batch, prefill_chunk or pins.")
            groups *= 2
        here = self.layer_args[layer]
        if len(parts) == 1:  # the common case: one fused call
            store.admit(layer, sorted(sets[0]), fetch=True)
            return _back(self.prog, store.device, ctx.params, here, (call, store.page_to_slot[layer][bt]), q, h, sel)
        acc = None
        for cols, pages in zip(parts, sets):
            store.admit(layer, sorted(pages), fetch=True)
            part = selected[:, :, cols]
            sh = None if shift is None else shift[:, :, cols]
            pad = ((0, 0), (0, 0), (0, pow2_at_least(part.shape[2]) - part.shape[2]))  # few shapes compile
            part = np.pad(part, pad, constant_values=-1)
            sh = None if sh is None else np.pad(sh, pad)
            acc = _attend(self.prog, store.device, here, q, (call, store.page_to_slot[layer][bt]), Selection(part, sh, inv_freq),
                          acc)
        return _finish(self.prog, ctx.params, here.index, h, acc[0])
