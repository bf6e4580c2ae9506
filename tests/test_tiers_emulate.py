"""Emulating a hardware tier here: its device / host / disk split of a reference workload's KV
(gemini_jax.tiers.emulate) applied to this machine's run, and the numbers stay exact."""

from __future__ import annotations

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, HardwareConfig, SamplingParams, SparseConfig
from gemini_jax.errors import ConfigError
from gemini_jax.tiers.emulate import cap_engine, min_device_fraction, proportions
from gemini_jax.testing import contract_tolerance, logits_tolerance, random_model, random_prompts, tiny_config

REF = gj.ModelConfig(family="llama", vocab_size=1000, hidden_size=256, intermediate_size=512, num_layers=4,
                     num_heads=4, num_kv_heads=2, head_dim=64)


def _hw(**over):
    base = dict(name="box", device_memory_gb=1.0, host_memory_gb=2.0, device_reserve_gb=0.0, host_reserve_gb=0.0,
                dtype="float32")
    return HardwareConfig(**{**base, **over})


def test_split_follows_the_memory_left_after_weights_and_reserves():
    kv_per_token = 2 * 4 * 2 * 64 * 4  # layers x kv heads x head_dim x (k, v) x fp32
    context = 1_000_000
    weights = REF.num_params() * 4
    p = proportions(_hw(device_reserve_gb=0.25, host_reserve_gb=0.5), REF, context)
    assert p.kv_bytes == kv_per_token * context
    assert p.device_fraction == pytest.approx((0.75e9 - weights) / p.kv_bytes)
    assert p.host_fraction == pytest.approx(1.5e9 / p.kv_bytes)
    assert p.device_fraction + p.host_fraction + p.disk_fraction == pytest.approx(1.0)
    # Eight model-parallel devices hold eight times the KV; a short context fits the device whole.
    p8 = proportions(_hw(mesh={"data": 1, "model": 8}), REF, context)
    assert p8.device_kv_bytes == pytest.approx(8e9 - weights)
    assert proportions(_hw(), REF, 1000).device_fraction == 1.0
    # More host RAM than the rest of the KV: nothing on disk.
    assert proportions(_hw(host_memory_gb=1e4), REF, context).disk_fraction == 0.0


def test_hardware_config_rejects_bad_reserves():
    with pytest.raises(ConfigError, match="device_reserve_gb"):
        _hw(device_reserve_gb=1.5)
    with pytest.raises(ConfigError, match="reference_context"):
        _hw(reference_context=0)


def _sparse_engine(max_seq_len=1024, **over):
    return EngineConfig(max_seq_len=max_seq_len, max_batch=1, prefill_chunk=256, cache=CacheConfig(block_size=8),
                        sparse=SparseConfig(enabled=True, budget=64, sink_pages=1, local_pages=1), **over)


def test_cap_engine_sizes_tiers_and_says_what_it_raised(tmp_path):
    e = _sparse_engine()
    p = proportions(_hw(device_memory_gb=0.6, host_memory_gb=1.0), REF, 4_000_000)
    assert 0 < p.device_fraction < 0.2 and p.disk_fraction > 0
    capped, rec = cap_engine(e, p, num_layers=4, disk_path=str(tmp_path / "kv"))
    t = capped.tier
    assert t.enabled and t.disk_path == str(tmp_path / "kv")
    assert t.host_pages == int(p.host_fraction * (e.num_pages - 1) * 4)
    # The chunk shrank before the device share was raised: a smaller chunk is exact.
    assert capped.prefill_chunk < e.prefill_chunk and rec["prefill_chunk_from"] == 256
    assert t.device_fraction == max(p.device_fraction, min_device_fraction(capped))
    with pytest.raises(ConfigError, match="disk path"):
        cap_engine(e, p, num_layers=4, disk_path=None)
    # Everything fits the device: no tiers at all.
    whole, rec = cap_engine(e, proportions(_hw(), REF, 100), num_layers=4, disk_path=None)
    assert not whole.tier.enabled and rec["device_fraction"] == 1.0


# (max_seq_len, prompt lengths, new tokens): CI runs the short case, `make test-slow` the long one.
@pytest.mark.parametrize("size", [(256, (120, 160), 4), pytest.param((1024, (500, 700), 12), marks=pytest.mark.slow)],
                         ids=["short", "long"])
def test_emulated_run_is_exact_and_moves_pages(tmp_path, size):
    max_seq_len, lengths, new_tokens = size
    cfg = tiny_config("llama")
    model = random_model(cfg, 3)
    seed = 1
    rng = np.random.default_rng(seed)
    prompt = random_prompts(rng, cfg.vocab_size, [int(rng.integers(*lengths))])[0]
    e = _sparse_engine(max_seq_len)
    p = proportions(_hw(device_memory_gb=0.6, host_memory_gb=1.0), REF, 4_000_000)
    capped, _ = cap_engine(e, p, num_layers=cfg.num_layers, disk_path=str(tmp_path / "kv"))
    greedy = SamplingParams(max_new_tokens=new_tokens, temperature=0.0)
    ref = gj.Engine(model, e).generate(prompt, greedy, return_logits=True)
    with gj.Engine(model, capped) as eng:
        out = eng.generate(prompt, greedy, return_logits=True)
    assert out.tokens == ref.tokens, f"seed={seed}"
    # The contract (README, tiers): within 1e-5 × max(1, max|ref|) of the all-resident engine; the float bound where tighter.
    tol = contract_tolerance(logits_tolerance(cfg, context=len(prompt) + new_tokens, reference=ref.logits), ref.logits, contract=1e-5)
    np.testing.assert_allclose(np.asarray(out.logits), np.asarray(ref.logits), atol=tol, rtol=0, err_msg=f"seed={seed}")
    assert out.stats["pages_fetched_host"] + out.stats["pages_fetched_disk"] > 0
    assert out.stats["pages_fetched_disk"] > 0  # the host bound is small enough that pages reach the disk
