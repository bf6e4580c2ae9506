"""Scheduling policy on a fake executor: no model, no device, milliseconds per test.

The scheduler sees an engine through four things: its configs, its counters, `engine.sequences`
(the page pool's allocation API) and `engine.runner(...)` (the executor). Here the pool is the
real `KVCacheManager` under a `SequenceCache` with a store that holds no bytes, and the executor
is `FakeRunner`: it keeps the page bookkeeping a real runner keeps (reserve, commit) and answers
each row with logits whose argmax is a hash of the row's tokens so far. So every request has a
solo answer known in advance (`solo`), and a test checks both the policy (who runs, who is
preempted, in which order) and that no decision changed a request's tokens.
"""

from __future__ import annotations

import time
from types import SimpleNamespace

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.cache.manager import KVCacheManager
from gemini_jax.config import CacheConfig, EngineConfig, ModelConfig, ServeConfig
from gemini_jax.runtime import new_stats
from gemini_jax.runtime.context import RunContext
from gemini_jax.runtime.sequences import SequenceCache
from gemini_jax.serve import Phase, Request, Scheduler

V = 97  # vocabulary of the fake model
MCFG = ModelConfig(vocab_size=V, hidden_size=8, intermediate_size=8, num_layers=2, num_heads=1, num_kv_heads=1,
                   head_dim=8, eos_id=None)


def next_token(tokens) -> int:
    """The fake model's greedy answer after `tokens`."""
    h = 7
    for t in tokens:
        h = (h * 31 + int(t)) % 1_000_003
    return h % V


def solo(prompt, n: int) -> list:
    toks, out = list(prompt), []
    for _ in range(n):
        out.append(next_token(toks))
        toks.append(out[-1])
    return out


class NoBytesStore:
    """The store half of `SequenceCache` without device memory: images carry zeros."""

    supports_padding = True
    layerwise = False
    device = type("Device", (), {"digests": None})()

    def gather(self, pages):
        return np.zeros((1, 1, len(pages), 1, 1), np.float32), np.zeros((1, 1, len(pages), 1, 1), np.float32), None

    def scatter(self, pages, k, v, digests=None, *, partial=()):
        pass

    def copy_pages(self, src, dst):
        pass


class FakeRunner:
    """The executor: the calls the scheduler makes of a runner, with a real runner's page bookkeeping."""

    def __init__(self, kv: KVCacheManager, log: list):
        self.pages, self.ids, self.log = kv, [], log

    def _logits(self, sids):
        out = np.zeros((len(sids), V), np.float32)
        for i, s in enumerate(sids):
            out[i, next_token(self.pages.seqs[s].tokens)] = 10.0
        return out

    def add(self, sid, toks):
        return self.pages.add_sequence(sid, toks)

    def prefill_piece(self, sid, padded, pos, n):
        self.pages.reserve(sid, int(pos[0]) + n)
        self.pages.commit(sid, padded[:n])
        self.log.append(("prefill", sid, n))
        return self._logits([sid])

    def decode(self, tokens, lengths, ids, pad=0):
        real = ids[:len(ids) - pad]
        for sid, tok, n in zip(real, tokens, lengths):
            self.pages.reserve(sid, int(n) + 1)
            self.pages.commit(sid, [int(tok)])
        self.log.append(("decode", tuple(real)))
        return np.concatenate([self._logits(real), np.zeros((pad, V), np.float32)])

    multistep = True

    def decode_many(self, inp, spec, *, commit=True, ids=None, pad=0):
        """Up to `inp.n` tokens per row: write, answer, stop a row at EOS (as `decode_loop` does)."""
        ids = list(ids)
        real = ids[:len(ids) - pad]
        tok = [int(t) for t in inp.tok[:len(real)]]
        done = np.asarray(inp.done[:len(real)], bool).copy()
        sampled = []
        steps = 0
        while steps < int(inp.n) and not done.all():
            nxt = []
            for b, sid in enumerate(real):
                n0 = int(inp.lengths[b]) + steps
                self.pages.reserve(sid, n0 + 1)
                self.pages.commit(sid, [tok[b]])
                nxt.append(next_token(self.pages.seqs[sid].tokens))
            sampled.append(nxt)
            tok = nxt
            steps += 1
            if spec.eos_id is not None:
                done |= np.asarray(nxt) == spec.eos_id
        self.log.append(("decode_many", tuple(real), steps))
        return SimpleNamespace(tokens=np.asarray(sampled, np.int32).T.reshape(len(real), steps), steps=steps)

    def close(self):
        pass


class FakeEngine:
    def __init__(self, num_pages: int, max_batch: int, block_size: int = 8, steps_per_call: int = 1):
        self.config = EngineConfig(max_seq_len=(num_pages - 1) * block_size, max_batch=max_batch, prefill_chunk=16,
                                   decode_steps_per_call=steps_per_call,
                                   cache=CacheConfig(block_size=block_size, prefix_caching=False, num_pages=num_pages))
        self.model_cfg = MCFG
        self.stats = new_stats()
        self.pages = KVCacheManager(num_pages, block_size, prefix_caching=False)
        ctx = RunContext(graphdef=None, params=None, model_cfg=MCFG, config=self.config, step=None, pages=self.pages,
                         store=NoBytesStore())
        self.sequences = SequenceCache(ctx)
        self.log: list = []

    def runner(self, batch, stats=None):
        return FakeRunner(self.pages, self.log)


def _request(rid, rng, n_prompt, n_new, **kw):
    prompt = rng.integers(0, V, n_prompt).tolist()
    return Request(rid, prompt, gj.SamplingParams(max_new_tokens=n_new), **kw), prompt


def _live_sets(eng):
    return eng.live_sets


def _exact(reqs, prompts, seed):
    for r, p in zip(reqs, prompts):
        assert r.generated == solo(p, r.params.max_new_tokens), (seed, r.rid, r.preemptions)


def test_admission_is_best_first_and_waits_for_pages():
    """Queued requests enter by priority, then arrival; one whose pages are not free holds none
    and waits (nobody ranked after it overtakes it) until pages come back."""
    t0, seed = time.perf_counter(), 11
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 5, max_batch=3)  # room for two requests' pages (2 each), not three
    sched = Scheduler(eng, ServeConfig(step_tokens=64))
    made = [_request(f"r{i}", rng, 10, 6, priority=p) for i, p in enumerate([3, 1, 2, 1])]
    reqs, prompts = zip(*made)
    for r in reqs:
        sched.submit(r)
    entered = []
    eng.live_sets = []
    while sched.step():
        eng.live_sets.append({r.rid for r in sched.live if eng.sequences.num_tokens(r.seq_id)})
        for r in sched.live:
            if r.rid not in entered:
                entered.append(r.rid)
    assert entered == ["r1", "r3", "r2", "r0"], (seed, entered)
    _exact(reqs, prompts, seed)
    assert max(len(x) for x in _live_sets(eng)) == 2, (seed, "at most two requests' pages fit")
    assert eng.sequences.usage()["sequences"] == 0 and eng.sequences.free_pages == 5
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


@pytest.mark.parametrize("preempt,k", [("swap", 1), ("recompute", 1), ("swap", 4)])
def test_preemption_when_allocate_slots_returns_none(preempt, k):
    """A pool too small for every live request's next token: the decode step's `allocate_slots`
    returns None, the worst-ranked request is preempted (and only then), and every request still
    gets its solo tokens."""
    t0, seed = time.perf_counter(), 12
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 5, max_batch=4, steps_per_call=k)  # 3 requests of 3 pages each
    calls = []
    real = eng.sequences.allocate_slots

    def allocate_slots(sid, n):
        got = real(sid, n)
        calls.append(got is None)
        return got

    eng.sequences.allocate_slots = allocate_slots
    sched = Scheduler(eng, ServeConfig(step_tokens=64, preempt=preempt))
    made = [_request(f"r{i}", rng, 7, 12, priority=i) for i in range(3)]
    reqs, prompts = zip(*made)
    for r in reqs:
        sched.submit(r)
    first_victim = None
    while sched.step():
        if first_victim is None and sched.preemptions:
            first_victim = next(r.rid for r in reqs if r.preemptions)
            assert any(calls), (seed, "preempted before any allocation failed")
    assert first_victim == "r2", (seed, first_victim)
    assert (k > 1) == any(e[0] == "decode_many" for e in eng.log), (seed, k)
    assert reqs[0].preemptions == 0
    _exact(reqs, prompts, seed)
    assert eng.sequences.usage()["sequences"] == 0
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


@pytest.mark.parametrize("k", [1, 4])
def test_each_call_is_planned_then_run_as_planned(k):
    """The scheduler plans every device call (`StepPlan`) before the executor runs it: planning
    calls no runner, a decode plan lists its rows best first with the requests it preempted (all
    ranked after every row), a k-step plan's rows share their sampling parameters, and the runner
    sees exactly the planned calls, in order."""
    t0, seed = time.perf_counter(), 17
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 5, max_batch=4, steps_per_call=k)  # 3 requests of 3 pages: preemptions
    sched = Scheduler(eng, ServeConfig(step_tokens=64))
    made = [_request(f"r{i}", rng, 7, 12, priority=i) for i in range(3)]
    reqs, prompts = zip(*made)
    for r in reqs:
        sched.submit(r)
    plans, run = [], sched.executor.run

    def run_logged(plan):
        assert len(eng.log) == sum(1 for _ in plans), (seed, "a runner call before its plan was run")
        plans.append(plan)
        return run(plan)

    sched.executor.run = run_logged
    sched.run_until_idle()
    assert len(eng.log) == len(plans) and any(p.preempted for p in plans), (seed, len(plans))
    for plan, call in zip(plans, eng.log):
        if plan.prefill is not None:
            assert call == ("prefill", plan.prefill.request.seq_id, plan.prefill.tokens), (seed, call)
            continue
        rows = plan.decode.rows
        assert [r.rank for r in rows] == sorted(r.rank for r in rows), seed
        assert all(v.rank > r.rank for v in plan.preempted for r in rows), seed
        assert call[0] == ("decode" if plan.decode.steps == 1 else "decode_many"), (seed, call)
        assert call[1] == tuple(r.seq_id for r in rows), (seed, call)
        assert plan.decode.steps == 1 or (len({r.params for r in rows}) == 1 and plan.decode.steps <= k), seed
    _exact(reqs, prompts, seed)
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


def test_a_k_step_call_that_does_not_fit_takes_one_token_a_row_instead_of_preempting():
    """Three requests fill the pool's three pages, each with room for 2 more tokens in its page:
    one token a row fits, 4 a row would need 3 new pages. The decode call takes one token a row and
    preempts nobody; later calls preempt only when one token a row does not fit either."""
    t0, seed = time.perf_counter(), 23
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 3, max_batch=4, steps_per_call=4)
    sched = Scheduler(eng, ServeConfig(step_tokens=64))
    made = [_request(f"r{i}", rng, 6, 6, priority=i) for i in range(3)]
    reqs, prompts = zip(*made)
    for r in reqs:
        sched.submit(r)
    plans, run = [], sched.executor.run

    def run_logged(plan):
        if plan.decode is not None:
            rows = plan.decode.rows
            plans.append((plan, sched._pages_for(list(rows), 4), sched._pages_for(list(rows), 1),
                          eng.sequences.free_pages))
        return run(plan)

    sched.executor.run = run_logged
    sched.run_until_idle()
    first, need4, need1, free = plans[0]
    assert len(first.decode.rows) == 3 and need4 > free >= need1, (seed, need4, need1, free)
    assert first.decode.steps == 1 and not first.preempted, (seed, first.decode.steps, first.preempted)
    assert any(p.decode.steps > 1 for p, *_ in plans), (seed, "k-step calls once the pool has room")
    _exact(reqs, prompts, seed)
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


def test_decode_takes_one_token_a_call_while_a_request_waits_or_prefills():
    """A k-step decode call runs before the step's prefill, so it would hold a new request's first
    token back k steps: while any request waits or prefills, decode calls take one token a row;
    once every request decodes, k."""
    t0, seed = time.perf_counter(), 29
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 64, max_batch=4, steps_per_call=4)
    sched = Scheduler(eng, ServeConfig(step_tokens=20))  # a 40-token prompt prefills over 3 steps
    made = [_request(f"r{i}", rng, 40, 16) for i in range(3)]
    reqs, prompts = zip(*made)
    seen, run = [], sched.executor.run

    def run_logged(plan):
        if plan.decode is not None:
            busy = bool(sched.waiting) or any(r.phase is Phase.PREFILL for r in sched.live)
            seen.append((busy, plan.decode.steps))
        return run(plan)

    sched.executor.run = run_logged
    sched.submit(reqs[0])
    for _ in range(3):
        sched.step()
    for r in reqs[1:]:  # they arrive while r0 decodes
        sched.submit(r)
    sched.run_until_idle()
    assert any(busy for busy, _ in seen), (seed, "the test meant decode calls during prefill")
    assert all(steps == 1 for busy, steps in seen if busy), (seed, seen)
    assert any(steps > 1 for busy, steps in seen if not busy), (seed, seen)
    _exact(reqs, prompts, seed)
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


def test_a_tenant_below_its_share_takes_a_slot():
    """Tenant A fills the batch; tenant B's request preempts A's worst at once (its fair share is
    max_batch / 2), rather than waiting for A's requests to finish."""
    t0, seed = time.perf_counter(), 13
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 64, max_batch=4)
    sched = Scheduler(eng, ServeConfig(step_tokens=256))
    made = [_request(f"a{i}", rng, 6, 20, tenant="A") for i in range(6)]
    for r, _ in made:
        sched.submit(r)
    sched.step()
    assert {r.tenant for r in sched.live} == {"A"} and len(sched.live) == 4
    b, bp = _request("b", rng, 6, 5, tenant="B")
    sched.submit(b)
    sched.step()
    assert b in sched.live and sched.fair_preemptions == 1, (seed, sched.fair_preemptions)
    victim = max((r for r, _ in made[:4]), key=lambda r: r.rank)
    assert victim.preemptions == 1, (seed, [(r.rid, r.preemptions) for r, _ in made])
    sched.run_until_idle()
    _exact([*(r for r, _ in made), b], [*(p for _, p in made), bp], seed)
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


def test_priorities_run_first_and_are_preempted_last():
    """One batch slot free and two low-priority requests queued before it: a priority-0 request
    takes the slot at the next step, and when pages run out it is never the one preempted."""
    t0, seed = time.perf_counter(), 14
    rng = np.random.default_rng(seed)
    eng = FakeEngine(num_pages=1 + 8, max_batch=4)  # 3 pages a request when done: pages run out
    sched = Scheduler(eng, ServeConfig(step_tokens=64))
    low = [_request(f"low{i}", rng, 8, 16, priority=5) for i in range(5)]
    for r, _ in low[:3]:
        sched.submit(r)
    sched.step()
    assert len(sched.live) == 3, seed
    for r, _ in low[3:]:
        sched.submit(r)
    hi, hp = _request("hi", rng, 8, 16, priority=0)
    sched.submit(hi)
    sched.step()
    assert hi in sched.live and all(r.phase is Phase.WAITING for r, _ in low[3:]), seed
    while sched.step():
        assert hi.preemptions == 0, seed
    assert sched.preemptions > 0, (seed, "the pool was meant to run out")
    _exact([hi, *(r for r, _ in low)], [hp, *(p for _, p in low)], seed)
    assert time.perf_counter() - t0 < 10.0, (seed, "no waits: a fake engine runs this in ~0.05 s")


def test_percentile_ratio_interval_covers_a_known_ratio():
    """`load.percentile_ratio_ci` on TTFT-like samples where the truth is known: B under load is
    B alone scaled by 1.8, so every percentile's ratio is 1.8 and its bootstrap interval covers it;
    with 100 draws a side the interval is narrower than [1.3, 2.5]; the same seed gives the same interval."""
    from gemini_jax.serve.load import percentile_ratio_ci

    seed = 19
    rng = np.random.default_rng(seed)
    alone = rng.lognormal(mean=-2.0, sigma=0.4, size=100)
    under = 1.8 * rng.lognormal(mean=-2.0, sigma=0.4, size=100)
    for q in (50, 90):
        got = percentile_ratio_ci(list(under), list(alone), q, seed=seed)
        lo, hi = got["ci95"]
        assert lo < 1.8 < hi and 1.3 < lo and hi < 2.5, (seed, q, got["ratio"], lo, hi)
        assert got["n_under"] == got["n_alone"] == 100
        assert percentile_ratio_ci(list(under), list(alone), q, seed=seed)["ci95"] == [lo, hi]
    assert percentile_ratio_ci([], list(alone), 90)["ratio"] is None
