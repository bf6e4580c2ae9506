"""Run by tests/test_mesh.py in a subprocess with 8 fake CPU devices; prints one JSON line.

Checks: meshes (1x8), (2x4), (8x1) give the single-device logits (dense paged, sparse, resume
from a snapshot); a snapshot saved on (1x8) restores on (2x4); the pool's per-device share is
1/model of it; the compiled decode step has no all-gather of pool-sized operands; bad meshes
raise ConfigError.
"""

import json
import os
import re
import sys
import tempfile

os.environ["XLA_FLAGS"] = "--xla_force_host_platform_device_count=8"
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

import gemini_jax as gj  # noqa: E402
from gemini_jax.cache.paged import PagedKV  # noqa: E402
from gemini_jax.errors import ConfigError  # noqa: E402
from helpers import random_model, random_prompts, tiny_config  # noqa: E402

seed = int(sys.argv[1])
rng = np.random.default_rng(seed)
cfg = tiny_config("qwen3", num_heads=16, num_kv_heads=8, head_dim=16, hidden_size=128, intermediate_size=256)
model = random_model(cfg, seed % 1000)
prompts = random_prompts(rng, cfg.vocab_size, (21, 50))
params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
MESHES = {"1x8": {"data": 1, "model": 8}, "2x4": {"data": 2, "model": 4}, "8x1": {"data": 8, "model": 1}}
SPARSE = {"dense": {}, "sparse": dict(enabled=True, budget=24, sink_pages=1, local_pages=1)}
report = {"seed": seed, "max_err": {}, "tokens_equal": {}}


def engine(mesh=None, sparse=None):
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=96, prefill_chunk=16, max_batch=2, cache=dict(block_size=8), sparse=sparse or {},
        mesh=mesh)))


refs = {k: engine(None, sp).generate(prompts, params, return_logits=True) for k, sp in SPARSE.items()}
for mname, mesh in MESHES.items():
    for sname, sp in SPARSE.items():
        eng = engine(mesh, sp)
        out = eng.generate(prompts, params, return_logits=True)
        key = f"{mname}/{sname}"
        report["max_err"][key] = float(max(np.abs(a - b).max() for a, b in zip(out.logits, refs[sname].logits)))
        report["tokens_equal"][key] = out.tokens == refs[sname].tokens
    if mname == "1x8":
        shard = eng.k_pool.addressable_shards[0].data
        report["pool_share"] = shard.size / eng.k_pool.size
        report["pool_spec"] = str(eng.k_pool.sharding.spec)
        # Compiled decode step: list all-gathers and their operand sizes.
        bt = jnp.zeros((2, 8), jnp.int32)
        cache = PagedKV(eng.k_pool, eng.v_pool, bt, jnp.array([21, 36], jnp.int32), eng.digests,
                        jnp.zeros((), jnp.int32))
        hlo = eng._step.lower(eng.params, cache, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                              jnp.zeros(2, jnp.int32)).compile().as_text()
        gathers = re.findall(r"= (\w+)\[([\d,]*)\][^ ]* all-gather", hlo)
        report["all_gathers"] = [[t, s] for t, s in gathers]
        report["pool_elems_per_device"] = int(shard.size)

# Resume from a snapshot: taken single-device and on (1x8); restored on (1x8), (2x4) and single.
tmp = tempfile.mkdtemp()
snaps = {}
for name, mesh in (("single", None), ("1x8", MESHES["1x8"])):
    eng = engine(mesh)
    sess = eng.start(prompts[1], gj.SamplingParams(max_new_tokens=4, stop_at_eos=False))
    sess.run()
    snaps[name] = os.path.join(tmp, name)
    sess.snapshot(snaps[name])
    sess.close()
instr = random_prompts(rng, cfg.vocab_size, (7,))[0]
resumed = {}
for snap_name, eng_name, mesh in (("single", "single", None), ("1x8", "1x8", MESHES["1x8"]),
                                  ("1x8", "2x4", MESHES["2x4"]), ("1x8", "single", None)):
    eng = engine(mesh)
    r = eng.resume(snaps[snap_name], instr, params=gj.SamplingParams(max_new_tokens=5, stop_at_eos=False))
    resumed[f"{snap_name}->{eng_name}"] = r.run()
    r.close()
report["resume_equal"] = len({tuple(v) for v in resumed.values()}) == 1
report["resumed"] = resumed

errors = {}
for name, mesh, c in (("too_big", {"data": 2, "model": 8}, cfg),
                      ("kv_heads", {"data": 1, "model": 2}, tiny_config("llama", num_heads=6, num_kv_heads=3))):
    try:
        gj.Engine(random_model(c, 1), gj.config.from_dict(gj.EngineConfig, dict(max_seq_len=64, mesh=mesh)))
        errors[name] = "no error"
    except ConfigError as e:
        errors[name] = str(e)
report["errors"] = errors
print("REPORT " + json.dumps(report))
