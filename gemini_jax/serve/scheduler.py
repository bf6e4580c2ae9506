"""Continuous batching over the engine's page pool: requests join and leave between decode steps.

    sched = Scheduler(engine, ServeConfig())
    sched.submit(Request("r1", prompt, SamplingParams(max_new_tokens=64), sink=on_token))
    while sched.step(): ...          # or a `Worker` thread runs it for the HTTP server

One step: (1) admit waiting requests, best first (priority, then the tenant holding fewer
live requests, then arrival), while the batch has room (`EngineConfig.max_batch`) and pages; a
tenant below its share of the batch (max_batch / tenants) takes a slot from the tenant above it; (2) one decode call over every decoding request (its
pending token written, the next one sampled with the request's own sampling parameters);
(3) prefill chunks of joining requests while `ServeConfig.step_tokens` lasts. When pages run out
the worst-ranked request (highest `priority`, latest arrival) is preempted: `swap` copies its pages
to host memory and restores the same bytes later, `recompute` frees them and prefills its tokens
again. A client never sees `CacheExhausted`: a request that cannot fit even alone is refused
at submit.

Each device call is planned, run, then applied (`serve.plan`): `plan_decode` / the prefill loop
decide the rows, tokens and pages (preempting when `allocate_slots` says None), the `Executor`
runs the `StepPlan` on the engine's runner, and `update` changes the requests from its
`StepOutput` (sample, send, finish).

Every request gets the tokens a solo `Engine.generate` gives it: prefill uses the same chunks
(`chunking.prefill_pieces`), sampling the same keys (seed, sample index 0, position), and a
swapped request resumes from its own bytes.
"""

from __future__ import annotations

import time
from collections import Counter, deque
from typing import Optional

import numpy as np

from gemini_jax.config import SamplingParams, ServeConfig, compat
from gemini_jax.errors import CacheExhausted, ContextLengthError
from gemini_jax.model import validate_tokens
from gemini_jax.runtime import Counters, driver
from gemini_jax.runtime.chunking import prefill_pieces
from gemini_jax.serve.executor import Executor
from gemini_jax.serve.plan import DecodeWork, PrefillWork, StepOutput, StepPlan
from gemini_jax.serve.request import FINISH_REASONS, Phase, Request


class Scheduler:
    """Owns the live requests and one runner over the engine's store; single-threaded (a `Worker`
    calls it from one thread; other threads only set a request's `*_requested` flags)."""

    def __init__(self, engine, config: ServeConfig | None = None, stats: Counters | None = None):
        compat.check_use("serving", engine.config)
        self.engine = engine
        self.config = config or ServeConfig()
        self.stats = engine.stats if stats is None else stats  # the engine's counters, live
        self.seqs = engine.sequences  # the pool's pages, asked through its allocation API
        self.runner = engine.runner(0, self.stats)
        self.executor = Executor(self.runner, self.seqs, pad_batch=self.config.pad_batch,
                                 steps_per_call=engine.config.decode_steps_per_call, eos_id=engine.model_cfg.eos_id)
        self.waiting: list[Request] = []
        self.live: list[Request] = []  # PREFILL or DECODE, holding pages
        self.arrivals = 0
        self.preemptions = 0  # every preemption (pages ran out, or a tenant's fair share)
        self.fair_preemptions = 0
        self.steps = 0
        self.decode_rows = 0  # sum over decode calls of their batch size
        self.decode_calls = 0  # device calls that decoded (one token per row, or up to k: `_steps_for`)
        self._eos = engine.model_cfg.eos_id
        self._layers = engine.model_cfg.num_layers
        self._preempted: list[Request] = []  # preempted while planning the current call

    # ---- requests in ------------------------------------------------------------------------------
    def check(self, tokens, params: SamplingParams, what: str = "prompt") -> np.ndarray:
        """Refuse a request that could never run: token ids out of range (TokenError), longer
        than the context (ContextLengthError) or than the whole pool holds."""
        toks = validate_tokens(tokens, self.engine.model_cfg.vocab_size, what)
        cfg = self.engine.config
        need = len(toks) + params.max_new_tokens
        if need > cfg.max_seq_len:
            raise ContextLengthError(
                f"{what} has {len(toks)} tokens + max_tokens={params.max_new_tokens} = {need} > the context "
                f"of {cfg.max_seq_len} tokens; shorten the prompt or lower max_tokens.")
        pages = -(-need // cfg.cache.block_size)
        if pages > self.seqs.capacity_pages:
            raise ContextLengthError(
                f"{what} needs {pages} KV pages ({need} tokens) but the pool holds "
                f"{self.seqs.capacity_pages}; shorten the request or raise cache.num_pages.")
        return toks

    def submit(self, req: Request) -> Request:
        """Queue `req` (checked first: a refused request changes nothing)."""
        toks = self.check(req.tokens, req.params)
        req.tokens = [int(t) for t in toks]
        req.prompt_len = req.prompt_len or len(req.tokens)
        req.arrival = self.arrivals
        self.arrivals += 1
        req.phase = Phase.WAITING
        self.waiting.append(req)
        return req

    @property
    def idle(self) -> bool:
        return not self.waiting and not self.live

    @property
    def preempted(self) -> int:
        """Requests waiting to come back after a preemption."""
        return sum(1 for r in self.waiting if r.preemptions)

    # ---- one step ---------------------------------------------------------------------------------
    def step(self) -> bool:
        """Run one scheduler step; False when there was nothing to do."""
        self._apply_requests()
        self._admit()
        if not self.live:
            return False
        self.steps += 1
        plan = self.plan_decode()
        if plan is not None:
            self.update(plan, self.executor.run(plan))
        self._prefill()
        return True

    def run_until_idle(self, max_steps: Optional[int] = None) -> None:
        n = 0
        while self.step():
            n += 1
            if max_steps is not None and n >= max_steps:
                return

    # ---- cancel / interrupt (flags set by other threads) -------------------------------------------
    def _apply_requests(self) -> None:
        for r in list(self.waiting) + list(self.live):
            if r.cancel_requested and not r.finished:
                self._finish(r, "cancelled")

    # ---- admission --------------------------------------------------------------------------------
    def _order(self, reqs) -> list:
        """Best first: priority, then the tenant holding fewer live requests (one tenant's burst
        never starves another's), then arrival (first come, first served)."""
        held = Counter(r.tenant for r in self.live)
        return sorted(reqs, key=lambda r: (r.priority, held[r.tenant], r.arrival))

    def _admit(self) -> None:
        while self.waiting:
            r = self._order(self.waiting)[0]
            if len(self.live) >= self.engine.config.max_batch and not self._fair_preempt(r):
                return
            # Room for what it brings back, and for one more page per decoding request next step.
            reserve = sum(1 for x in self.live if x.phase is Phase.DECODE)
            if not self.seqs.can_admit(self._pages_to_enter(r) + reserve) and self.live:
                return  # it waits for pages (nobody overtakes it)
            self.waiting.remove(r)
            try:
                self._enter(r)
            except CacheExhausted:  # shared pages counted as free were not: try again next step
                self.waiting.append(r)
                return

    def _fair_share_victim(self, r: Request) -> Optional[Request]:
        """With the batch full: a request of the tenant holding the most slots, when `r`'s tenant
        holds fewer than its share (max_batch / tenants) and that one more (of equal or lower priority)."""
        held = Counter(x.tenant for x in self.live)
        tenants = set(held) | {r.tenant}
        if len(tenants) < 2:
            return None
        share = max(1, self.engine.config.max_batch // len(tenants))
        heavy, most = held.most_common(1)[0]
        if held[r.tenant] >= share or most <= share or heavy == r.tenant:
            return None
        victims = [x for x in self.live if x.tenant == heavy and x.priority >= r.priority]
        return max(victims, key=lambda x: x.rank) if victims else None

    def _fair_preempt(self, r: Request) -> bool:
        victim = self._fair_share_victim(r)
        if victim is None:
            return False
        self._preempt(victim)
        self.fair_preemptions += 1
        return True

    def _pages_to_enter(self, r: Request) -> int:
        S = self.engine.config.cache.block_size
        if r.image is not None:
            return r.image.num_pages + (r.resume is not None)  # a rewind copies its partial page
        first = r.pieces[0] if r.pieces else None
        return -(-(int(first[1][0]) + first[2]) // S) if first is not None else -(-len(r.tokens) // S)

    def _enter(self, r: Request) -> None:
        """Give `r` a sequence in the pool: its image back (swap, or a resumed session's turn), or
        its tokens to prefill."""
        if r.seq_id is None:
            r.seq_id = self.seqs.new_id()
        if r.image is not None:
            self.seqs.swap_in(r.seq_id, r.image)
            r.image = None
            r.phase = Phase.DECODE if r.pending is not None else Phase.PREFILL
            if r.resume is not None:
                self.live.append(r)
                self._sync_ids()
                self._start_turn(r)
                return
        else:
            toks = r.prompt_array()
            r.pending = None  # recompute: a pending token is prefilled with the rest
            reused = self.runner.add(r.seq_id, toks)
            r.pieces = deque(prefill_pieces(self.engine.config, toks, reused))
            r.phase = Phase.PREFILL
        self.live.append(r)
        self._sync_ids()

    def _start_turn(self, r: Request) -> None:
        """A resumed session over its restored pages: rewind, then prefill the instruction, in the
        calls `Engine.resume` makes (the rewound token alone, then the instruction's chunks)."""
        keep, rewind = r.resume
        r.resume = None
        toks = r.prompt_array()
        pieces = []
        if rewind:
            self.seqs.truncate(r.seq_id, keep - 1)
            pieces += prefill_pieces(self.engine.config, toks[:keep], keep - 1)
        if len(toks) > keep:
            pieces += prefill_pieces(self.engine.config, toks, keep)
        r.pieces = deque(pieces)
        if r.pieces:
            r.phase = Phase.PREFILL
        else:  # nothing new: the next token comes from the logits the interrupt kept
            r.phase = Phase.DECODE
            self._after_logits([r], np.asarray(r.logits)[None])

    def _sync_ids(self) -> None:
        # The runner's rows are every live sequence (tiers pin each one's sink and last pages).
        self.runner.ids = [r.seq_id for r in self.live]

    # ---- pages ------------------------------------------------------------------------------------
    def _make_room(self, need: int, for_rank: tuple) -> bool:
        """Preempt live requests ranked after `for_rank`, worst first, until `need` pages are free."""
        while not self.seqs.can_admit(need):
            victims = [r for r in self.live if r.rank >= for_rank]
            if not victims:
                return False
            self._preempt(max(victims, key=lambda r: r.rank))
        return True

    def _allocate_rows(self, rows: list, n: int = 1) -> None:
        """Page slots for the `n` tokens every decode row writes next (its pending token first),
        best row first. When the pool cannot
        give one (`allocate_slots` is None), the worst-ranked live request is preempted, and the
        row tries again; a preempted row leaves `rows`. The best row always fits alone (checked
        at submit)."""
        for r in list(rows):
            if r not in rows:  # preempted for a better row
                continue
            while self.seqs.allocate_slots(r.seq_id, n) is None:
                victim = max(self.live, key=lambda x: x.rank)
                if victim in rows:
                    rows.remove(victim)
                self._preempt(victim)
                if victim is r:
                    break

    def _preempt(self, r: Request) -> None:
        if self.config.preempt == "swap":
            r.image = self.seqs.swap_out(r.seq_id)
        else:
            r.pieces = deque()
        self.seqs.release(r.seq_id)
        self.live.remove(r)
        self._sync_ids()
        r.phase = Phase.WAITING
        r.preemptions += 1
        self.preemptions += 1
        self.waiting.append(r)
        self._preempted.append(r)

    # ---- decode ----------------------------------------------------------------------------------
    def plan_decode(self) -> Optional[StepPlan]:
        """The decode call of this step: every decoding row, best first, with page slots for the
        tokens it writes (worse rows preempted when `allocate_slots` says None); None when no row
        decodes."""
        self._preempted = []
        rows = sorted((r for r in self.live if r.phase is Phase.DECODE), key=lambda r: r.rank)
        if not rows:
            return None
        n = self._steps_for(rows)
        if n > 1 and self._pages_for(rows, n) > self.seqs.free_pages:
            # k tokens a row do not fit the pool: one token a row, then. A k-step call saves
            # dispatches; a preemption costs a swap or a recompute.
            n = 1
        self._allocate_rows(rows, n)
        if not rows:
            return None
        if n > 1:
            n = min(n, self._steps_for(rows))  # the rows left may end sooner
        return StepPlan(decode=DecodeWork(tuple(rows), n), preempted=tuple(self._preempted))

    def _pages_for(self, rows: list, n: int) -> int:
        """New pages the rows need for their next `n` tokens each."""
        return sum(self.seqs.pages_to_write(r.seq_id, self.seqs.num_tokens(r.seq_id) + n) for r in rows)

    def update(self, plan: StepPlan, out: StepOutput) -> None:
        """Apply what a planned call returned: count it, then sample / send / finish its rows."""
        if plan.prefill is not None:
            w = plan.prefill
            r = w.request
            r.pieces.popleft()
            r.compute_units += w.tokens * self._layers
            if not r.pieces:
                self.seqs.persist_prefix(r.seq_id)
                r.phase = Phase.DECODE
                self._after_logits([r], out.logits)
            return
        rows = plan.decode.rows
        self.stats.decode_steps += out.steps
        self.stats.compute_units += len(rows) * self._layers * out.steps
        self.decode_rows += len(rows)
        self.decode_calls += 1
        for r in rows:
            r.pending = None
            r.compute_units += self._layers * out.steps
        if out.tokens is None:
            self._after_logits(list(rows), out.logits)
            return
        for i, r in enumerate(rows):
            self._take_tokens(r, out.tokens[i])

    def _steps_for(self, rows: list) -> int:
        """Tokens the next decode call makes per row: up to `EngineConfig.decode_steps_per_call` in
        one k-step program (`runtime.multistep`) when the runner has one, every row samples with
        the same parameters (one program per setting), no row is to be interrupted (an interrupt
        keeps the logits after the last token written, which only the one-token call returns),
        no request is waiting or prefilling (its prefill runs after this call: a k-step call
        would hold its first token back k steps), and no further than the row closest to its
        `max_new_tokens`. Else 1."""
        k = self.engine.config.decode_steps_per_call
        if k <= 1 or not self.executor.multistep or len({r.params for r in rows}) > 1 \
                or any(r.interrupt_requested for r in rows) or self.waiting \
                or any(r.phase is Phase.PREFILL for r in self.live):
            return 1
        return max(1, min(k, *(r.params.max_new_tokens - r.new_tokens for r in rows)))

    def _take_tokens(self, r: Request, toks) -> None:
        """Send `r` the tokens a k-step call sampled for it, up to its end (EOS or max_new_tokens)."""
        now = time.perf_counter()
        for tok in toks:
            if r.finished:
                return
            self._send(r, int(tok), now)

    def _after_logits(self, rows: list, logits: np.ndarray) -> None:
        """Rows whose KV is complete, with their next-token logits f32[B, V]: interrupt, or sample,
        send, and finish or keep the token pending."""
        keep = [i for i, r in enumerate(rows) if not r.interrupt_requested]
        for i, r in enumerate(rows):
            if r.interrupt_requested:
                r.logits = logits[i]
                self._finish(r, "interrupted")
        if not keep:
            return
        toks = self._sample([rows[i] for i in keep], logits[keep])
        now = time.perf_counter()
        for i, tok in zip(keep, toks):
            self._send(rows[i], int(tok), now)

    def _send(self, r: Request, tok: int, now: float) -> None:
        """`tok` was sampled for `r`: append and stream it; it stays pending (its KV is written by
        the next decode call) or ends the request."""
        r.generated.append(tok)
        r.tokens.append(tok)
        r.t_first = r.t_first or now
        r.t_last = now
        if r.sink is not None:
            r.sink(r, tok)
        if r.wants_more(self._eos):
            r.pending = tok
        else:
            self._finish(r, "stop" if driver.is_stop(r.params, self._eos, tok) else "length")

    def _sample(self, rows: list, logits: np.ndarray) -> np.ndarray:
        """Each row with its own sampling parameters, keyed like a solo run (seed, sample index,
        position), so batching never changes what a request draws."""
        return driver.sample_each([r.params for r in rows], logits, [r.sample_index for r in rows],
                                  [self.seqs.num_tokens(r.seq_id) for r in rows])

    # ---- prefill ----------------------------------------------------------------------------------
    def _prefill(self) -> None:
        budget = self.config.step_tokens - sum(1 for r in self.live if r.phase is Phase.DECODE)
        ran = False
        for r in self._order(r for r in self.live if r.phase is Phase.PREFILL):
            while r.pieces and r.phase is Phase.PREFILL:
                padded, pos, n = r.pieces[0]
                if ran and n > budget:
                    return
                self._preempted = []
                if not self._room_for_piece(r, int(pos[0]) + n):
                    break  # it waits for pages; a better-ranked request may still prefill
                plan = StepPlan(prefill=PrefillWork(r, r.pieces[0]), preempted=tuple(self._preempted))
                self.update(plan, self.executor.run(plan))
                budget -= n
                ran = True

    def _room_for_piece(self, r: Request, end: int) -> bool:
        need = self.seqs.pages_to_write(r.seq_id, end)
        if need <= 0:
            return True
        if not self.seqs.can_admit(need):
            others = [x for x in self.live if x is not r]
            worse = [x for x in others if x.rank > r.rank]
            if not worse:
                return False
            self._make_room(need, (r.rank[0], r.rank[1] + 1))
        return self.seqs.can_admit(need)

    # ---- the end ----------------------------------------------------------------------------------
    def _finish(self, r: Request, reason: str, error: Optional[str] = None) -> None:
        """End `r`: its pages go back to the pool (full ones stay cached for prefix reuse), unless
        it was interrupted, when its image is kept on the request for a resume."""
        if reason not in FINISH_REASONS:
            raise ValueError(f"finish reason {reason!r} must be one of {FINISH_REASONS}.")
        if r in self.live:
            if reason == "interrupted":
                r.image = self.seqs.swap_out(r.seq_id)
            self.seqs.release(r.seq_id)
            self.live.remove(r)
            self._sync_ids()
        if r in self.waiting:
            self.waiting.remove(r)
        r.phase = Phase.FINISHED
        r.finish_reason = reason
        r.error = error
        r.pieces = deque()
        if r.sink is not None:
            r.sink(r, None)

    def fail_all(self, error: str) -> None:
        """End every queued and running request with `error` (a step raised: the engine's state
        for them cannot be trusted); their pages go back to the pool."""
        for r in list(self.waiting) + list(self.live):
            self._finish(r, "error", error)

    def close(self) -> None:
        """Cancel everything still queued or running."""
        for r in list(self.waiting) + list(self.live):
            self._finish(r, "cancelled")
