"""Quantized KV (cache.dtype int8 / float8_e4m3fn): the stored vectors read back within their
rounding, and within one quantized dtype the exactness invariants hold as in float: paged ==
contiguous, sparse with a covering budget == dense, k tokens per call == one, snapshot / resume
== uninterrupted. Bytes read per step and snapshot sizes shrink by (D + 4) / (4 D)."""

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.attention import kvquant
from gemini_jax.errors import ConfigError
from gemini_jax.testing import float_tolerance, logits_tolerance, random_model, random_prompts, tiny_config

QUANT = ("int8", "float8_e4m3fn")
GREEDY = dict(temperature=0.0, stop_at_eos=False)


@pytest.fixture(scope="module")
def model():
    return random_model(tiny_config("llama"), 23)


_ENGINES = {}


def _engine(model, dtype, kind="paged", **over):
    """One engine per configuration for the whole module (compile once per shape)."""
    key = (id(model), dtype, kind, tuple(sorted((k, str(v)) for k, v in over.items())))
    if key not in _ENGINES:
        cfg = {"max_seq_len": 256, "prefill_chunk": 32, "max_batch": 2,
               "cache": dict(kind=kind, block_size=8, dtype=dtype), **over}
        _ENGINES[key] = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, cfg))
    return _ENGINES[key]


def _request(seed, vocab, n_prompt=70, n_cont=12):
    rng = np.random.default_rng(seed)
    return random_prompts(rng, vocab, (n_prompt,))[0], random_prompts(rng, vocab, (n_cont,))[0]


def _logprob_tolerance(cfg, ref) -> float:
    """Two float evaluations of teacher-forced log-probs over the same stored KV: the logits' bound
    (layers, the widest reduction or the context up to max_seq_len) and a log-sum-exp over the
    vocabulary on top."""
    return float_tolerance(depth=cfg.num_layers + 1, terms=max(cfg.intermediate_size, cfg.vocab_size, 256),
                           magnitude=np.abs(ref).max())


@pytest.mark.parametrize("dtype", QUANT)
def test_vectors_read_back_within_their_rounding(dtype):
    seed = 4
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(6, 5, 64)).astype(np.float32) * rng.uniform(0.01, 30, size=(6, 5, 1)).astype(np.float32)
    x[0, 0] = 0.0  # an all-zero vector (a fresh page's slot) reads back as zeros, not NaN
    q = kvquant.quantize(x, dtype)
    back = np.asarray(kvquant.read(q, np.float32))
    scale = np.asarray(q.scale)[..., None]
    assert q.dtype == np.dtype(dtype) and q.data.itemsize == 1 and q.scale.shape == x.shape[:-1]
    # The float32 divide (quantize) and multiply (read) round too, in proportion to |x|.
    float_part = np.abs(x) * float_tolerance(depth=2, magnitude=1.0)
    if dtype == "int8":
        bound = scale / 2 + float_part  # round to nearest step
    else:  # e4m3: 3 mantissa bits (relative 2^-4), subnormal steps of 2^-9 of the scale
        bound = np.abs(x) * 2.0 ** -4 + scale * 2.0 ** -9 + float_part
    assert np.all(np.abs(back - x) <= bound), f"seed={seed} max err {np.max(np.abs(back - x) - bound)}"
    assert np.all(back[0, 0] == 0) and np.isfinite(back).all()
    # The largest element of each vector is stored at full range, so nothing clips.
    assert np.allclose(np.max(np.abs(back), -1), np.max(np.abs(x), -1), rtol=2.0 ** -4)


@pytest.mark.parametrize("dtype", ["int8", pytest.param("float8_e4m3fn", marks=pytest.mark.slow)])
def test_paged_equals_contiguous_and_sparse_covering_equals_dense_within_a_dtype(model, dtype):
    """Invariants 1 and 2 within a quantized dtype: the same vectors are stored whichever cache
    holds them, so the numbers agree to float rounding. (float8 runs every path the same way but
    through its own read: its fast variant is the next test.)"""
    seed = 31
    prompt, cont = _request(seed, model.cfg.vocab_size)
    ref = np.asarray(_engine(model, dtype, "contiguous").score(prompt, cont).tokens)
    paged = np.asarray(_engine(model, dtype).score(prompt, cont).tokens)
    tol = _logprob_tolerance(model.cfg, ref)
    np.testing.assert_allclose(paged, ref, atol=tol, rtol=0, err_msg=f"seed={seed} paged vs contiguous, {dtype}")
    covering = _engine(model, dtype, sparse=dict(enabled=True, budget=256, sink_pages=1, local_pages=2))
    np.testing.assert_allclose(np.asarray(covering.score(prompt, cont).tokens), ref, atol=tol, rtol=0,
                               err_msg=f"seed={seed} sparse (covering budget) vs dense, {dtype}")
    p = gj.SamplingParams(max_new_tokens=9, **GREEDY)
    one = _engine(model, dtype, decode_steps_per_call=1).generate(prompt, p).tokens
    assert _engine(model, dtype).generate(prompt, p).tokens == one, f"seed={seed} k=8 vs k=1, {dtype}"


def test_float8_paged_equals_contiguous(model):
    seed = 35
    prompt, cont = _request(seed, model.cfg.vocab_size)
    ref = np.asarray(_engine(model, "float8_e4m3fn", "contiguous").score(prompt, cont).tokens)
    paged = np.asarray(_engine(model, "float8_e4m3fn").score(prompt, cont).tokens)
    np.testing.assert_allclose(paged, ref, atol=_logprob_tolerance(model.cfg, ref), rtol=0,
                               err_msg=f"seed={seed} paged vs contiguous, float8")


def test_quantized_logits_stay_near_float_and_a_read_without_scales_is_caught(model, monkeypatch):
    seed = 32
    prompt, cont = _request(seed, model.cfg.vocab_size)
    ref = np.asarray(_engine(model, None).score(prompt, cont).tokens)
    errs = {dt: float(np.max(np.abs(np.asarray(_engine(model, dt).score(prompt, cont).tokens) - ref)))
            for dt in QUANT}
    # Random weights and tokens: a log-prob moves by a few hundredths at most (fp8 rounds coarser).
    assert errs["int8"] < 0.02 and errs["float8_e4m3fn"] < 0.1 and errs["int8"] < errs["float8_e4m3fn"], \
        f"seed={seed} {errs}"
    assert min(errs.values()) > 0, "quantized KV read back bit-equal to float: nothing was quantized"

    def no_scale(x, dtype):  # planted bug: the stored integers read as the values
        return x.data.astype(dtype) if isinstance(x, kvquant.QuantPages) else x.astype(dtype)

    monkeypatch.setattr(kvquant, "read", no_scale)
    fresh = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=256, prefill_chunk=32, cache=dict(block_size=8, dtype="int8"))))
    bad = float(np.max(np.abs(np.asarray(fresh.score(prompt, cont).tokens) - ref)))
    assert bad > 10 * errs["int8"], f"seed={seed} a read without scales went unnoticed ({bad} vs {errs['int8']})"


@pytest.mark.parametrize("dtype", QUANT)
def test_snapshot_resume_in_another_engine_equals_the_uninterrupted_run(model, dtype, tmp_path):
    """Invariant 5 within a dtype: the snapshot holds the stored bytes and scales, so a second engine
    resumes with the very numbers the first one would have continued with."""
    seed = 33
    prompt, _ = _request(seed, model.cfg.vocab_size, n_prompt=45)
    eng = _engine(model, dtype)
    sess = eng.start(prompt, gj.SamplingParams(max_new_tokens=16, **GREEDY))
    head = [next(sess) for _ in range(5)]
    sess.interrupt()
    path = str(tmp_path / "snap")
    sess.snapshot(path)
    sess.close()
    full = eng.generate(prompt, gj.SamplingParams(max_new_tokens=16, **GREEDY), return_logits=True)
    other = gj.Engine(model, eng.config)
    resumed = other.resume(path, [], params=gj.SamplingParams(max_new_tokens=11, **GREEDY))
    # The logits the 6th token is chosen from, restored from the snapshot's pages and logits.
    tol = logits_tolerance(model.cfg, context=len(prompt) + 16, reference=full.logits[5])
    np.testing.assert_allclose(np.asarray(resumed.logits[0]), np.asarray(full.logits[5]), atol=tol, rtol=0,
                               err_msg=f"seed={seed} {dtype}")
    tail = resumed.run()
    assert head + tail == full.tokens, f"seed={seed} {dtype}"
    resumed.close()
    assert (tmp_path / "snap" / "arrays").exists()


def test_bytes_read_per_step_and_snapshot_size_shrink_by_the_stored_width(tmp_path):
    """head_dim 64: a token's K in one kv head is 64 int8 + a 4-byte scale = 68 bytes vs 256."""
    seed = 34
    model = random_model(tiny_config("llama", head_dim=64), seed)
    prompt, _ = _request(seed, model.cfg.vocab_size, n_prompt=60)
    p = gj.SamplingParams(max_new_tokens=6, **GREEDY)
    read, size = {}, {}
    for dt in (None, *QUANT):
        eng = gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
            max_seq_len=128, prefill_chunk=32, cache=dict(block_size=8, dtype=dt))))
        sess = eng.start(prompt, p)
        sess.run()
        read[dt] = sess.stats["kv_bytes_read"]
        sess.snapshot(str(tmp_path / str(dt)))
        sess.close()
        size[dt] = sum(f.stat().st_size for f in (tmp_path / str(dt)).rglob("*") if f.is_file())
    for dt in QUANT:
        assert read[dt] / read[None] == pytest.approx(68 / 256), (dt, read)
        # Orbax adds metadata and the logits ([V] f32) to both sides; the KV is what shrinks.
        assert size[dt] / size[None] <= 0.35, (dt, size)


@pytest.mark.parametrize("dtype", QUANT)
def test_tiers_return_quantized_pages_and_scales_bit_exactly(tmp_path, dtype):
    """Pages written into the tiered store come back with the very bytes and scales: full pages
    from host RAM and (past its 4 pages) from disk, partial ones from device slots."""
    from gemini_jax.tiers.kv_store import TieredStore

    seed = 37
    rng = np.random.default_rng(seed)
    mcfg = tiny_config("llama", head_dim=64)
    cfg = gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=256, max_batch=1, cache=dict(block_size=8, dtype=dtype),
                                                    tier=dict(enabled=True, device_fraction=0.25, host_pages=4,
                                                              disk_path=str(tmp_path / "kv"))))
    L, K, S, D = mcfg.num_layers, mcfg.num_kv_heads, 8, mcfg.head_dim
    pages, partial = list(range(1, 11)), [10]
    x = rng.normal(size=(2, L, K, len(pages), S, D)).astype(np.float32) * rng.uniform(0.1, 9, (2, L, K, len(pages), S, 1))
    k, v = (kvquant.to_host(kvquant.quantize(x[i], dtype)) for i in range(2))
    store = TieredStore(mcfg, cfg, np.dtype(dtype))
    try:
        store.scatter(pages, k, v, partial=partial)
        store.stack.flush()
        ts = store.stats()
        assert ts["disk_pages_written"] > 0 and ts["host_pages"] <= 4, ts
        gk, gv, _ = store.gather(pages)
    finally:
        store.close()
    for name, got, want in (("k", gk, k), ("v", gv, v)):
        assert isinstance(got, kvquant.QuantPages) and got.data.dtype == want.data.dtype, (name, got)
        assert np.array_equal(got.data, want.data), f"seed={seed} {dtype} {name} data"
        assert np.array_equal(got.scale.view(np.uint32), want.scale.view(np.uint32)), f"seed={seed} {dtype} {name} scale"


def test_tiered_quantized_decode_matches_the_pool_and_holds_a_quarter_of_the_bytes(tmp_path):
    """int8 pages evicted to host RAM and disk and brought back during decode: the tokens of the
    all-resident pool, and what the tiers hold shrinks by (D + 4) / (4 D) against float32.
    Quantized pools decode layer by layer even with `fused_decode` on (runtime/fused.py says why).

    The logits agree to 1e-3, not 1e-5 as in float: the tiered programs compute K to within float
    rounding of the pool's (attention merged over groups of slots, other fusions), and a key an ulp
    from an int8 rounding boundary lands on the other step (max|k| / 127), which later layers carry.
    That the tiers themselves change no byte is the test above."""
    seed = 36
    model = random_model(tiny_config("llama", head_dim=64), seed)
    prompt, _ = _request(seed, model.cfg.vocab_size, n_prompt=120)  # 15 pages a layer > 12 slots
    p = gj.SamplingParams(max_new_tokens=6, **GREEDY)
    # 10%: 12 slots a layer, room for 2 kv heads x 4 selected pages + pins (a one-program step).
    sp = dict(enabled=True, budget=32, sink_pages=1, local_pages=1)
    base = dict(max_seq_len=512, prefill_chunk=32, max_batch=2, sparse=sp)
    pool = _engine(model, "int8", **base).generate(prompt, p, return_logits=True)
    held = {}
    for dt in ("int8", None):
        tier = dict(enabled=True, device_fraction=0.1, host_pages=8, disk_path=str(tmp_path / f"kv-{dt}"),
                    prefetch_depth=2, hot_threshold=0)
        cfg = gj.config.from_dict(gj.EngineConfig, dict(base, cache=dict(block_size=8, dtype=dt), tier=tier))
        with gj.Engine(model, cfg) as eng:
            out = eng.generate(prompt, p, return_logits=True)
            ts = eng.tier_stats()
        held[dt] = (ts["kv_bytes_host"], ts["kv_bytes_disk"], ts["disk_pages_written"])
        if dt == "int8":
            assert out.tokens == pool.tokens, f"seed={seed}"
            # The contract (README, quantized KV): 1e-3. Not a float-rounding bound: an int8 step flip.
            np.testing.assert_allclose(out.logits, pool.logits, atol=1e-3, rtol=0, err_msg=f"seed={seed}")
            assert out.stats["pages_fetched_disk"] > 0, out.stats  # pages really went down and came back
            assert ts["fused_decode_steps"] == 0, ts["fused_decode_steps"]
    assert held["int8"][2] == held[None][2] > 0, held  # the same pages went down
    assert held["int8"][0] / held[None][0] == pytest.approx(68 / 256), held
    assert held["int8"][1] / held[None][1] == pytest.approx(68 / 256), held


def test_quantized_kv_on_a_mesh_shards_scales_with_their_data():
    """int8 KV on a (1 x 2) mesh (2 fake CPU devices, a subprocess), all-resident and over tiers:
    each device holds half the pool's data and half its scales, and decodes the single-device
    tokens. Logits to 1e-3, not 1e-5: the mesh sums the heads' outputs in another order, and a key
    an ulp from an int8 rounding boundary then lands on the other step (see the tiers test)."""
    import json
    import os
    import subprocess
    import sys

    seed = 38
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "kvquant_mesh_check.py")
    out = subprocess.run([sys.executable, script, str(seed)], capture_output=True, text=True, timeout=900)
    line = [x for x in out.stdout.splitlines() if x.startswith("REPORT ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    r = json.loads(line[0][len("REPORT "):])
    assert r["devices"] == 2 and r["single"]["data_share"] == r["single"]["scale_share"] == 1.0, r
    for name in ("mesh", "mesh_tiers"):
        assert r[name]["data_share"] == r[name]["scale_share"] == 0.5, (name, r)
        assert r[name]["tokens"] == r["single"]["tokens"], (name, f"seed={seed}", r)
        assert r[name]["max_err"] <= 1e-3, (name, f"seed={seed}", r[name]["max_err"])  # the contract (README)
    assert r["mesh_tiers"]["fetched"] > 0, r  # pages went below and came back


def test_an_unknown_kv_dtype_is_refused_by_name():
    with pytest.raises(ConfigError, match="cache.dtype='int4'"):
        gj.config.CacheConfig(dtype="int4")


@pytest.mark.parametrize("sparse", [False, True])
def test_pallas_kernels_decode_quantized_pages_as_the_xla_path_does(model, sparse):
    """attention_impl=pallas (the kernels in interpret mode on CPU) reads int8 pages and their
    scales: the XLA path's tokens, logits to 1e-3 (the kernel sums in another order, and a key an
    ulp from an int8 step boundary can land on the other step; see the tiers test)."""
    seed = 39
    prompt, _ = _request(seed, model.cfg.vocab_size, n_prompt=40)
    p = gj.SamplingParams(max_new_tokens=4, **GREEDY)
    over = dict(sparse=dict(enabled=True, budget=24, sink_pages=1, local_pages=1)) if sparse else {}
    xla = _engine(model, "int8", **over).generate(prompt, p, return_logits=True)
    pallas = _engine(model, "int8", attention_impl="pallas", **over).generate(prompt, p, return_logits=True)
    assert pallas.tokens == xla.tokens, f"seed={seed} sparse={sparse}"
    # The contract (README, quantized KV): 1e-3, for the same reason as over tiers.
    np.testing.assert_allclose(pallas.logits, xla.logits, atol=1e-3, rtol=0, err_msg=f"seed={seed} sparse={sparse}")
