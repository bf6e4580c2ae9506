"""The engine over tiers (gemini_jax.runtime.tiered): device budgets and prefetch depths never
change the numbers; pages really move (counters); disk pages are verified on the way up."""

from __future__ import annotations

import pathlib

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.errors import ConfigError, IntegrityError
from gemini_jax import tiny
from gemini_jax.data import corpus
from gemini_jax.testing import contract_tolerance, logits_tolerance, random_model, random_prompts, tiny_config

BUDGETS = (1.0, 0.5, 0.25, 0.1)
DEPTHS = (0, 1, 2, 4)
# CI runs the cells the assertions below read (all resident; 10 % with prefetch off and on);
# `make test-slow` runs every budget x depth.
CORNERS = ((1.0, 0), (0.1, 0), (0.1, 2))
GRIDS = [pytest.param(tuple((f, d) for f in BUDGETS for d in DEPTHS), marks=pytest.mark.slow, id="every"),
         pytest.param(CORNERS, id="corners")]
GREEDY = SamplingParams(max_new_tokens=20, temperature=0.0)


# The contract (README, tiers): logits over tiers within 1e-5 × max(1, max|ref|) of the all-resident engine's.
CONTRACT = 1e-5


def tiered_bound(cfg, prompts, ref_logits) -> float:
    """The float bound of logits over tiers vs all-resident: the tiered programs sum attention over
    the context in their own order, layer after layer. The tests hold logits to the contract
    (CONTRACT × max(1, max|ref|)) or this, whichever is tighter (`contract_tolerance`)."""
    return logits_tolerance(cfg, context=max(map(len, prompts)) + GREEDY.max_new_tokens, reference=ref_logits)


def _base(sparse: bool, **over):
    sp = SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1) if sparse else SparseConfig()
    # Chunks of 32 tokens write 5 pages: with pins they fit the 12 slots of a 10% budget.
    return dict(max_seq_len=512, max_batch=2, prefill_chunk=32, cache=CacheConfig(block_size=8), sparse=sp, **over)


CASE_SEED = 11  # the model's and the prompts' seed in `case`


# Dense over tiers at every budget and depth runs in `make test-slow`; CI keeps the sparse case (the one
# prefetch changes most) and dense exactness through the disk-tier and session tests.
@pytest.fixture(scope="module", params=[pytest.param(("llama", False), marks=pytest.mark.slow), ("gemma2", True)],
                ids=["dense-llama", "sparse-gemma2"])
def case(request):
    family, sparse = request.param
    cfg = tiny_config(family)
    model = random_model(cfg, CASE_SEED)
    rng = np.random.default_rng(CASE_SEED)
    prompts = random_prompts(rng, cfg.vocab_size, [int(rng.integers(120, 200)), int(rng.integers(60, 120))])
    ref = gj.Engine(model, EngineConfig(**_base(sparse))).generate(prompts, GREEDY, return_logits=True)
    return model, sparse, prompts, ref


@pytest.mark.parametrize("grid", GRIDS)
def test_budgets_and_prefetch_depths_keep_the_numbers(case, grid):
    model, sparse, prompts, ref = case
    fetched = {}
    for frac, depth in grid:
        tier = TierConfig(enabled=True, device_fraction=frac, prefetch_depth=depth, hot_threshold=0)
        with gj.Engine(model, EngineConfig(**_base(sparse), tier=tier)) as eng:
            out = eng.generate(prompts, GREEDY, return_logits=True)
        where = f"device_fraction={frac}, prefetch_depth={depth}, seed={CASE_SEED}"
        assert out.tokens == ref.tokens, where
        # The layer-by-layer program rounds differently from the scanned one (f32 ulps): held to the
        # contract, 1e-5 of the all-resident engine, or the float bound where that is tighter.
        tol = contract_tolerance(tiered_bound(model.cfg, prompts, ref.logits), ref.logits, contract=CONTRACT)
        for a, b in zip(out.logits, ref.logits):
            np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=where)
        fetched[frac, depth] = {**out.stats, "fused": eng.tier_stats()["fused_decode_steps"]}
    # Sparse decode steps run as one device program where one layer's selection fits the slots.
    if sparse:
        assert fetched[1.0, 0]["fused"] > 0
    # The small budgets really evict and fetch; the full one never does; prefetch turns misses into hits.
    assert fetched[1.0, 0]["pages_fetched_host"] == 0
    assert fetched[0.1, 0]["pages_fetched_host"] > 0
    assert fetched[0.1, 0]["prefetch_hits"] == 0 and fetched[0.1, 2]["prefetch_hits"] > 0
    assert fetched[0.1, 2]["prefetch_misses"] < fetched[0.1, 0]["prefetch_misses"]


@pytest.mark.skipif(not tiny.available(), reason="needs the shipped tiny model (gemini_jax/assets/tiny)")
def test_lookahead_prefetch_turns_new_selections_into_hits():
    """Decode-only counters at 25 % / depth 2 with the shipped model on held-out text: history alone
    cannot predict a page a step selects for the first time; the lookahead (layer l+2 scored from
    layer l's input) fetches most of them before they are needed."""
    model = gj.load_tiny()
    _, held = corpus.load_split("heldout")
    seed = 1  # picks the held-out slice; the same slice on every run, named in the messages
    start = int(np.random.default_rng(seed).integers(0, len(held) - 5000))
    prompt = [int(x) for x in held[start:start + 4096]]
    where = f"seed={seed}: held-out bytes [{start}, {start + 4096})"
    sp = SparseConfig(enabled=True, budget=512, sink_pages=1, local_pages=2)
    counts, tokens = {}, {}
    for la in (False, True):
        tier = TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=2, lookahead=3 if la else 0, hot_threshold=0)
        ec = EngineConfig(max_seq_len=4096 + 32, max_batch=1, prefill_chunk=512,
                          cache=CacheConfig(block_size=16, prefix_caching=False), sparse=sp, tier=tier)
        runs = []
        for n in (1, 17):  # the same prefill; the difference is 16 decode steps
            with gj.Engine(model, ec) as eng:
                runs.append(eng.generate(prompt, SamplingParams(max_new_tokens=n, temperature=0.0)))
        counts[la] = {k: runs[1].stats[k] - runs[0].stats[k] for k in ("prefetch_hits", "prefetch_misses")}
        tokens[la] = runs[1].tokens
    assert tokens[True] == tokens[False], where
    off, on = counts[False], counts[True]
    rate = lambda c: c["prefetch_hits"] / max(1, c["prefetch_hits"] + c["prefetch_misses"])  # noqa: E731
    print("lookahead", on, rate(on), "history only", off, rate(off), where)
    assert on["prefetch_hits"] + on["prefetch_misses"] > 50, (where, on)  # pages really had to come up
    assert rate(on) >= 0.8 and rate(on) > rate(off) + 0.3, (where, on, off)


def _disk_engine(model, tmp_path, **tier):
    tier = TierConfig(enabled=True, device_fraction=0.1, host_pages=8, disk_path=str(tmp_path / "kv"),
                      prefetch_depth=2, hot_threshold=0, **tier)
    return gj.Engine(model, EngineConfig(**_base(True), tier=tier))


def test_disk_tier_exact_and_counted(tmp_path):
    seed = 1
    cfg = tiny_config("qwen3")
    model = random_model(cfg, 5)
    prompts = random_prompts(np.random.default_rng(seed), cfg.vocab_size, [230])
    ref = gj.Engine(model, EngineConfig(**_base(True))).generate(prompts, GREEDY, return_logits=True)
    with _disk_engine(model, tmp_path) as eng:
        out = eng.generate(prompts, GREEDY, return_logits=True)
        ts = eng.tier_stats()
    assert out.tokens == ref.tokens, f"seed={seed}"
    np.testing.assert_allclose(out.logits[0], ref.logits[0], rtol=0,
                               atol=contract_tolerance(tiered_bound(cfg, prompts, ref.logits), ref.logits, contract=CONTRACT), err_msg=f"seed={seed}")
    assert out.stats["pages_fetched_disk"] > 0, out.stats
    assert ts["disk_pages_written"] > 0 and ts["kv_bytes_disk"] > 0
    assert ts["host_pages"] <= 8


def test_corrupt_disk_page_raises_integrity_error(tmp_path):
    cfg = tiny_config("llama")
    model = random_model(cfg, 6)
    prompt = random_prompts(np.random.default_rng(2), cfg.vocab_size, [240])[0]
    with _disk_engine(model, tmp_path) as eng:
        eng.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))
        eng.store.stack.flush()
        files = [p for p in pathlib.Path(tmp_path / "kv").rglob("*") if p.is_file() and p.stat().st_size > 1000]
        assert files
        for p in files:  # flip bytes in the middle of every page file
            data = bytearray(p.read_bytes())
            mid = len(data) // 2
            data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
            p.write_bytes(bytes(data))
        # The same prompt again: its full pages come back from the prefix cache, most from disk.
        with pytest.raises(IntegrityError, match="layer"):
            eng.generate(prompt, SamplingParams(max_new_tokens=2, temperature=0.0))


def test_unwritable_disk_path_fails_at_construction(tmp_path):
    blocker = tmp_path / "a_file"
    blocker.write_text("not a directory")  # a path below a regular file can never be created
    cfg = tiny_config("llama")
    with pytest.raises(gj.errors.GeminiJaxError, match="a_file"):
        gj.Engine(random_model(cfg, 1), EngineConfig(**_base(False), tier=TierConfig(
            enabled=True, device_fraction=0.5, disk_path=str(blocker / "kv"))))


@pytest.mark.parametrize("over, field", [
    (dict(attention_impl="pallas"), "attention_impl"),
    (dict(cache=CacheConfig(kind="contiguous")), "cache.kind"),
])
def test_tier_config_conflicts_name_the_field(over, field):
    base = dict(max_seq_len=256, max_batch=1, tier=TierConfig(enabled=True, device_fraction=0.5))
    with pytest.raises(ConfigError, match=field.split(".")[0]):
        EngineConfig(**{**base, **over})
    with pytest.raises(ConfigError, match="pin_local_pages"):
        EngineConfig(**{**base, "tier": TierConfig(enabled=True, device_fraction=0.5, pin_local_pages=0)})


# CI resumes the sparse case; dense decode over a disk tier is exact in test_tiers_recompute and test_mesh.
@pytest.mark.parametrize("sparse", [pytest.param(False, marks=pytest.mark.slow), True], ids=["dense", "sparse"])
def test_sessions_over_tiers_resume_exactly(tmp_path, sparse):
    """Interrupt / snapshot / resume (with and without a rewind) over tiers — device 25 %, host
    bounded, disk — equal a fresh all-resident run on prompt + generated[:t] (+ rewind) + instruction;
    the snapshot restores on an all-resident engine and back."""
    cfg = tiny_config("gemma2" if sparse else "llama")
    model = random_model(cfg, 4)
    rng = np.random.default_rng(3)
    prompt, instr = random_prompts(rng, cfg.vocab_size, [int(rng.integers(150, 200)), int(rng.integers(3, 9))])
    tier = TierConfig(enabled=True, device_fraction=0.25, host_pages=12, disk_path=str(tmp_path / "kv"),
                      prefetch_depth=2, hot_threshold=0)
    resident = gj.Engine(model, EngineConfig(**_base(sparse)))
    n = 6
    with gj.Engine(model, EngineConfig(**_base(sparse), tier=tier)) as tiered:
        sess = tiered.start(prompt, SamplingParams(max_new_tokens=20, temperature=0.0))
        gen = [next(sess) for _ in range(int(rng.integers(3, 9)))]
        sess.interrupt()
        sess.snapshot(str(tmp_path / "snap"))
        sess.close()
        assert tiered.tier_stats()["kv_bytes_disk"] > 0  # the snapshot read pages from below the device
        for eng_resume in (tiered, resident):
            for rewind in (None, int(rng.integers(len(prompt) - 20, len(prompt) + len(gen)))):
                r = eng_resume.resume(str(tmp_path / "snap"), instr, rewind_to=rewind,
                                      params=SamplingParams(max_new_tokens=n, temperature=0.0))
                assert r.stats["prefill_tokens_computed"] == len(instr) + (rewind is not None)
                ours = r.run()
                r.close()
                prefix = (prompt + gen)[:rewind] + instr if rewind is not None else prompt + gen + instr
                ref = resident.generate(prefix, SamplingParams(max_new_tokens=n, temperature=0.0))
                assert ours == ref.tokens, (eng_resume is tiered, rewind)
        # A snapshot taken all-resident restores over tiers too.
        sess = resident.start(prompt, SamplingParams(max_new_tokens=4, temperature=0.0))
        gen2 = sess.run()
        sess.snapshot(str(tmp_path / "snap2"))
        sess.close()
        r = tiered.resume(str(tmp_path / "snap2"), instr, params=SamplingParams(max_new_tokens=n, temperature=0.0))
        assert r.run() == resident.generate(prompt + gen2 + instr, SamplingParams(max_new_tokens=n, temperature=0.0)).tokens
        r.close()


def test_too_small_budget_is_cache_exhausted_not_wrong():
    cfg = tiny_config("llama")
    eng = gj.Engine(random_model(cfg, 3), EngineConfig(
        max_seq_len=512, max_batch=1, prefill_chunk=256, cache=CacheConfig(block_size=8),
        tier=TierConfig(enabled=True, device_pages=8)))
    with eng, pytest.raises(gj.errors.CacheExhausted, match="device_pages"):
        eng.generate([i % 90 + 1 for i in range(300)], SamplingParams(max_new_tokens=2))


# CI runs distance 0; a scored distance over tiers, layer by layer, is the fused test's `(2, False)` step.
@pytest.mark.parametrize("distance", [0, pytest.param(24, marks=pytest.mark.slow)])
def test_compact_positions_over_tiers_match_all_resident(distance):
    seed = 4
    cfg = tiny_config("qwen2")
    model = random_model(cfg, 8)
    prompts = random_prompts(np.random.default_rng(seed), cfg.vocab_size, [210, 170])
    sp = SparseConfig(enabled=True, budget=48, sink_pages=1, local_pages=1, positions="compact",
                      sparse_prefill=True, score_queries=8, score_distance=distance)
    base = dict(_base(True), sparse=sp)
    ref = gj.Engine(model, EngineConfig(**base)).generate(prompts, GREEDY, return_logits=True)
    tier = TierConfig(enabled=True, device_fraction=0.1, prefetch_depth=2, hot_threshold=0)
    with gj.Engine(model, EngineConfig(**base, tier=tier)) as eng:
        out = eng.generate(prompts, GREEDY, return_logits=True)
    assert out.tokens == ref.tokens, f"seed={seed}"
    tol = contract_tolerance(tiered_bound(cfg, prompts, ref.logits), ref.logits, contract=CONTRACT)
    for a, b in zip(out.logits, ref.logits):
        np.testing.assert_allclose(a, b, atol=tol, rtol=0, err_msg=f"seed={seed}")
    assert out.stats["pages_fetched_host"] > 0


def _fused_base(**sparse):
    sp = SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1, **sparse)
    return dict(max_seq_len=512, max_batch=1, prefill_chunk=32, cache=CacheConfig(block_size=8), sparse=sp)


# The layer-by-layer path at depth 0 is the budgets test's; CI compares it here at depth 2 only.
FUSED_PLANS = [pytest.param(((0, True), (2, True), (0, False), (2, False)), marks=pytest.mark.slow, id="every"),
               pytest.param(((0, True), (2, True), (2, False)), id="ci")]


@pytest.mark.parametrize("plan", FUSED_PLANS)
@pytest.mark.parametrize("family, positions, distance", [("gemma2", "true", 0),
                                                        # compact at distance 0 over tiers: the test above
                                                        pytest.param("llama", "compact", 0, marks=pytest.mark.slow),
                                                        ("llama", "compact", 40)])
def test_fused_decode_steps_bring_missing_pages_exactly(family, positions, distance, plan):
    """Decode steps as one device program (tier.fused_decode): pages missing from the slots are
    brought in by the program's host callback, and the numbers are the all-resident ones — and
    the layer-by-layer path's — for prefetch depths 0 and 2 (gemma2: sliding windows, soft caps)."""
    cfg = tiny_config(family)
    model = random_model(cfg, 21)
    seed = 5
    rng = np.random.default_rng(seed)
    prompts = random_prompts(rng, cfg.vocab_size, [int(rng.integers(330, 420))])
    base = _fused_base(positions=positions, score_distance=distance)
    ref = gj.Engine(model, EngineConfig(**base)).generate(prompts, GREEDY, return_logits=True)
    for depth, fused in plan:
        tier = TierConfig(enabled=True, device_pages=24, prefetch_depth=depth, hot_threshold=0, fused_decode=fused)
        with gj.Engine(model, EngineConfig(**base, tier=tier)) as eng:
            out = eng.generate(prompts, GREEDY, return_logits=True)
            ts = eng.tier_stats()
        where = f"depth={depth}, fused={fused}, seed={seed}"
        assert out.tokens == ref.tokens, where
        np.testing.assert_allclose(out.logits[0], ref.logits[0], rtol=0,
                                   atol=contract_tolerance(tiered_bound(cfg, prompts, ref.logits), ref.logits, contract=CONTRACT), err_msg=where)
        # Every decode step ran as one program (one layer's selection fits the 24 slots).
        assert ts["fused_decode_steps"] == (out.stats["decode_steps"] if fused else 0), where
        assert out.stats["pages_fetched_host"] > 0 and ts["device_evictions"] > 0, where


def test_fused_decode_raises_integrity_error_for_a_corrupt_page(tmp_path):
    """A corrupt disk page read by a fused step's host callback surfaces as IntegrityError
    (typed, naming the page), not as a runtime error of the device program."""
    cfg = tiny_config("llama")
    model = random_model(cfg, 8)
    prompt = random_prompts(np.random.default_rng(6), cfg.vocab_size, [400])[0]
    tier = TierConfig(enabled=True, device_pages=24, host_pages=4, disk_path=str(tmp_path / "kv"), prefetch_depth=0,
                      hot_threshold=0)
    with gj.Engine(model, EngineConfig(**_fused_base(), tier=tier)) as eng:
        sess = eng.start(prompt, SamplingParams(max_new_tokens=40, temperature=0.0, stop_at_eos=False))
        for _ in range(3):
            next(sess)
        assert eng.tier_stats()["fused_decode_steps"] > 0
        eng.store.stack.flush()
        for p in pathlib.Path(tmp_path / "kv").rglob("*"):
            if p.is_file() and p.stat().st_size > 1000:
                data = bytearray(p.read_bytes())
                mid = len(data) // 2
                data[mid:mid + 8] = bytes(b ^ 0xFF for b in data[mid:mid + 8])
                p.write_bytes(bytes(data))
        with pytest.raises(IntegrityError, match="layer"):
            for _ in range(37):
                next(sess)


def test_selection_edit_hook_replaces_the_selection():
    """The research hook (`gj.SelectionObserver`, given to the engine): an identity edit keeps the numbers (and runs decode layer by layer); an
    edit that forces a page in is what the attention reads (the log shows it, the logits move)."""
    seed = 7
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    model = random_model(cfg, int(rng.integers(100)))
    prompt = random_prompts(rng, cfg.vocab_size, [int(rng.integers(150, 250))])
    base = {**_base(True), "sparse": SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1,
                                                  sparse_prefill=True)}
    ecfg = EngineConfig(**base, tier=TierConfig(enabled=True, device_fraction=1.0))
    params = SamplingParams(max_new_tokens=4, temperature=0.0, stop_at_eos=False)
    with gj.Engine(model, ecfg) as eng:
        plain = eng.generate(prompt, params, return_logits=True)
        assert eng.tier_stats()["fused_decode_steps"] > 0
    seen = []

    def identity(layer, decode, positions, selected):
        seen.append(decode)
        return selected

    with gj.Engine(model, ecfg, observer=gj.SelectionObserver(edit=identity)) as eng:
        same = eng.generate(prompt, params, return_logits=True)
        assert eng.tier_stats()["fused_decode_steps"] == 0
    assert any(seen) and not all(seen)  # prompt calls and decode steps both went through it
    tol = contract_tolerance(tiered_bound(cfg, prompt, plain.logits), plain.logits, contract=CONTRACT)  # layer by layer vs the one-program step
    np.testing.assert_allclose(same.logits[0], plain.logits[0], atol=tol, rtol=0, err_msg=f"seed={seed}")

    log = []
    force = gj.SelectionObserver(log=log, edit=lambda layer, decode, positions, sel: np.where(
        (np.arange(sel.shape[-1]) == 1) & decode, 2, sel))  # column 1 reads logical page 2 at decode
    with gj.Engine(model, ecfg, observer=force) as eng:
        forced = eng.generate(prompt, params, return_logits=True)
    rows = [r["selected"] for r in log if r["decode"]]
    assert rows and all(np.all(r[..., 1] == 2) for r in rows)
    moved_by = np.abs(forced.logits[0][1:] - plain.logits[0][1:]).max()
    assert moved_by > 10 * tol, f"seed={seed}: the forced page moved the logits by {moved_by:.3g} only"


def test_an_observer_needs_the_tiered_store():
    """Selection hooks run on the tiered store's host path; an all-resident engine refuses them by name."""
    cfg = tiny_config("llama")
    with pytest.raises(ConfigError, match="tiered store"):
        gj.Engine(random_model(cfg, 3), EngineConfig(**_base(True)), observer=gj.SelectionObserver(log=[]))


def test_tiered_generate_compiles_once_per_shape():
    """A runner per `generate` call shares the engine's one-program decode step: a second call of
    the same shapes compiles nothing (each call compiled it again before, ~1.5 s a call)."""
    from jax import monitoring

    seed = 9
    rng = np.random.default_rng(seed)
    cfg = tiny_config("llama")
    model = random_model(cfg, seed)
    prompt = random_prompts(rng, cfg.vocab_size, [int(rng.integers(330, 420))])
    tier = TierConfig(enabled=True, device_pages=24, prefetch_depth=2, hot_threshold=0)
    params = SamplingParams(max_new_tokens=6, temperature=0.0, stop_at_eos=False)
    compiles = []
    monitoring.register_event_duration_secs_listener(
        lambda name, secs, **kw: compiles.append(name) if name == "/jax/core/compile/backend_compile_duration" else None)
    with gj.Engine(model, EngineConfig(**_fused_base(), tier=tier)) as eng:
        first = eng.generate(prompt, params)
        assert eng.tier_stats()["fused_decode_steps"] > 0, seed
        before = len(compiles)
        again = eng.generate(prompt, params)
        assert len(compiles) == before, f"seed={seed}: the second generate compiled {len(compiles) - before} programs"
    assert again.tokens == first.tokens, seed
