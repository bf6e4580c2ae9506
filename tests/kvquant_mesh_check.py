"""Run by tests/test_kv_quant.py in a subprocess with 2 fake CPU devices; prints one JSON line.

int8 KV on a (1 x 2) mesh, all-resident and over tiers, against one device: tokens, logits, and
each device's share of the pool's data and scales.
"""

import json
import os
import sys

# Keep the flags the test run set (conftest.py: the compile level) and add the host devices.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"

import jax  # noqa: E402
import numpy as np  # noqa: E402

import gemini_jax as gj  # noqa: E402
from gemini_jax.testing import random_model, random_prompts, tiny_config  # noqa: E402

seed = int(sys.argv[1])
rng = np.random.default_rng(seed)
cfg = tiny_config("llama", num_heads=4, num_kv_heads=2, head_dim=32, hidden_size=128, intermediate_size=256)
model = random_model(cfg, seed % 1000)
prompt = random_prompts(rng, cfg.vocab_size, (90,))[0]
params = gj.SamplingParams(max_new_tokens=5, temperature=0.0, stop_at_eos=False)
base = dict(max_seq_len=128, max_batch=1, prefill_chunk=32, cache=dict(block_size=8, dtype="int8"),
            sparse=dict(enabled=True, budget=48, sink_pages=1, local_pages=1))
tier = dict(enabled=True, device_fraction=0.5, prefetch_depth=2, hot_threshold=0)
report = {"seed": seed, "devices": jax.device_count()}
runs = {}
for name, over in (("single", {}), ("mesh", dict(mesh=dict(data=1, model=2))),
                   ("mesh_tiers", dict(mesh=dict(data=1, model=2), tier=tier))):
    with gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(base, **over))) as eng:
        out = eng.generate(prompt, params, return_logits=True)
        runs[name] = out
        k = eng.store.device.k
        report[name] = {"tokens": out.tokens,
                        "data_share": k.data.addressable_shards[0].data.size / k.data.size,
                        "scale_share": k.scale.addressable_shards[0].data.size / k.scale.size,
                        "fetched": out.stats["pages_fetched_host"]}
for name in ("mesh", "mesh_tiers"):
    report[name]["max_err"] = float(np.max(np.abs(np.asarray(runs[name].logits) - np.asarray(runs["single"].logits))))
print("REPORT " + json.dumps(report))
