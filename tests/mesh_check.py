"""Run by tests/test_mesh.py in a subprocess with 8 fake CPU devices; prints one JSON line.

Checks: meshes (1x8), (2x4), (8x1) give the single-device logits (dense paged, sparse, resume
from a snapshot; soft tokens on (2x4)), also over tiers on (1x8) and (2x4); a snapshot saved on (1x8) restores on (2x4)
(all-resident and tiered) and one saved over tiers restores single-device; the pool's per-device share is
1/model of it; the compiled decode step has no all-gather of pool-sized operands; bad meshes
raise ConfigError. `python tests/mesh_check.py SEED ci` (what `make test` runs) leaves out the (8x1)
mesh and the resumes that repeat a covered pair (saved and restored on one layout, (1x8) -> single);
`full` (`make test-slow`) runs them all.
"""

import json
import os
import re
import sys
import tempfile

# Keep the flags the test run set (conftest.py: the compile level) and add the host devices.
os.environ["XLA_FLAGS"] = os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec  # noqa: E402

import gemini_jax as gj  # noqa: E402
from gemini_jax.attention.pool import PagedKV  # noqa: E402
from gemini_jax.errors import ConfigError  # noqa: E402
from gemini_jax.runtime import tiered as tiers_runner  # noqa: E402
from gemini_jax.testing import random_model, random_prompts, tiny_config  # noqa: E402

seed = int(sys.argv[1])
FULL = sys.argv[2:3] == ["full"]
rng = np.random.default_rng(seed)
cfg = tiny_config("qwen3", num_heads=16, num_kv_heads=8, head_dim=16, hidden_size=128, intermediate_size=256)
model = random_model(cfg, seed % 1000)
prompts = random_prompts(rng, cfg.vocab_size, (21, 50))
params = gj.SamplingParams(max_new_tokens=6, stop_at_eos=False)
MESHES = {"1x8": {"data": 1, "model": 8}, "2x4": {"data": 2, "model": 4}}
if FULL:
    MESHES["8x1"] = {"data": 8, "model": 1}
SPARSE = {"dense": {}, "sparse": dict(enabled=True, budget=24, sink_pages=1, local_pages=1)}
# What the test derives its float tolerance from: the model's depth and widths, the longest context.
report = {"seed": seed, "max_err": {}, "tokens_equal": {}, "max_abs_ref": 0.0,
          "shape": {"num_layers": cfg.num_layers, "hidden_size": cfg.hidden_size,
                    "intermediate_size": cfg.intermediate_size, "context": 50 + 4 + params.max_new_tokens}}


ALL_GATHER = re.compile(r"= (\w+)\[([\d,]*)\][^ ]* all-gather")


def all_gathers(hlo: str) -> list[list[str]]:
    """[dtype, "d0,d1,.."] of every all-gather in compiled HLO text."""
    return [[t, s] for t, s in ALL_GATHER.findall(hlo)]


def instructions(hlo: str) -> int:
    """How many HLO instructions the text holds (so a scan of an empty text cannot pass)."""
    return sum(1 for line in hlo.splitlines() if " = " in line)


def engine(mesh=None, sparse=None, tier=None):
    return gj.Engine(model, gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=96, prefill_chunk=16, max_batch=2, cache=dict(block_size=8), sparse=sparse or {},
        mesh=mesh, tier=tier or {})))


tmp = tempfile.mkdtemp()


def tier(name, slots=8):
    """`slots` device slots per layer (of 25 pages), 4 (layer, page) units in host RAM, the rest on
    disk. A sparse column holds up to one page per kv head and row (8 x 2 here), so sparse runs
    need 16 slots."""
    return dict(enabled=True, device_pages=slots, host_pages=4, prefetch_depth=2, hot_threshold=0, pin_local_pages=1,
                disk_path=os.path.join(tmp, "tier-" + name))


refs = {k: engine(None, sp).generate(prompts, params, return_logits=True) for k, sp in SPARSE.items()}
report["max_abs_ref"] = float(max(np.abs(x).max() for r in refs.values() for x in r.logits))
for mname, mesh in MESHES.items():
    for sname, sp in SPARSE.items():
        eng = engine(mesh, sp)
        out = eng.generate(prompts, params, return_logits=True)
        key = f"{mname}/{sname}"
        report["max_err"][key] = float(max(np.abs(a - b).max() for a, b in zip(out.logits, refs[sname].logits)))
        report["tokens_equal"][key] = out.tokens == refs[sname].tokens
    if mname == "1x8":
        pool = eng.store.device
        shard = pool.k.addressable_shards[0].data
        report["pool_share"] = shard.size / pool.k.size
        report["pool_spec"] = str(pool.k.sharding.spec)
        # Compiled decode step: list all-gathers and their operand sizes.
        bt = jnp.zeros((2, 8), jnp.int32)
        cache = PagedKV(pool.k, pool.v, bt, jnp.array([21, 36], jnp.int32), pool.digests,
                        jnp.zeros((), jnp.int32))
        hlo = eng.ctx.step.lower(eng.params, cache, jnp.zeros((2, 1), jnp.int32), jnp.zeros((2, 1), jnp.int32),
                              jnp.zeros(2, jnp.int32)).compile().as_text()
        report["all_gathers"] = all_gathers(hlo)
        report["decode_hlo_instructions"] = instructions(hlo)
        report["pool_elems_per_device"] = int(shard.size)
        # Positive control: replicating the pool on every device must show up as a pool-sized all-gather.
        replicate = jax.jit(lambda x: x * 2, out_shardings=NamedSharding(pool.k.sharding.mesh, PartitionSpec()))
        report["control_all_gathers"] = all_gathers(replicate.lower(pool.k).compile().as_text())

# Soft tokens (encoder outputs: embeddings instead of ids) on a (2x4) mesh vs one device.
soft = (0.02 * rng.standard_normal((4, cfg.hidden_size))).astype(np.float32)
soft_out = {}
for mname, mesh in (("single", None), ("2x4", MESHES["2x4"])):
    eng = engine(mesh)
    ids = [int(i) for i in eng.soft.add("mesh-check", soft, {"encoder": "random"})]
    soft_out[mname] = eng.generate([p[:10] + ids + p[10:] for p in prompts], params, return_logits=True)
report["max_abs_ref"] = max(report["max_abs_ref"], float(max(np.abs(x).max() for x in soft_out["single"].logits)))
report["max_err"]["2x4/soft"] = float(max(np.abs(a - b).max() for a, b in zip(soft_out["2x4"].logits,
                                                                               soft_out["single"].logits)))
report["tokens_equal"]["2x4/soft"] = soft_out["2x4"].tokens == soft_out["single"].tokens

# Over tiers: each shard of kv heads has its own host pool and zarr array on disk. The first
# call of each jitted per-layer piece (a decode step) is recorded, to inspect its compiled HLO for all-gathers.
report["tiered"] = {}
seen = {}


def recording(name, fn):
    def call(*args, **kwargs):
        seen[name] = (args, kwargs)  # the last call: a decode step
        return fn(*args, **kwargs)
    return call


ORIG = {name: getattr(tiers_runner, name) for name in ("_front", "_back")}
for name, fn in ORIG.items():
    setattr(tiers_runner, name, recording(name, fn))
for mname in ("1x8", "2x4"):
    for sname, sp in SPARSE.items():
        key = f"tiered {mname}/{sname}"
        with engine(MESHES[mname], sp, tier(key.replace(" ", "-").replace("/", "-"), 16 if sp else 8)) as eng:
            out = eng.generate(prompts, params, return_logits=True)
            st = eng.tier_stats()
            t = eng.store.device
            report["max_err"][key] = float(max(np.abs(a - b).max() for a, b in zip(out.logits, refs[sname].logits)))
            report["tokens_equal"][key] = out.tokens == refs[sname].tokens
            report["tiered"][key] = {
                "slot_share": t.k.addressable_shards[0].data.size / t.k.size, "slot_spec": str(t.k.sharding.spec),
                "shard_dirs": sorted(os.listdir(os.path.join(tmp, "tier-" + key.replace(" ", "-").replace("/", "-")))),
                "pages_fetched_disk": out.stats["pages_fetched_disk"],
                "pages_fetched_host": out.stats["pages_fetched_host"], "shards": st["shards"],
                "slot_elems_per_device": int(t.k.addressable_shards[0].data.size)}
        if mname == "1x8":
            gathers, scanned = [], {}
            for name, (args, kwargs) in seen.items():
                hlo = ORIG[name].lower(*args, **kwargs).compile().as_text()
                gathers += [[name, ty, sh] for ty, sh in all_gathers(hlo)]
                scanned[name] = instructions(hlo)
            report["tiered"][key]["all_gathers"] = gathers
            report["tiered"][key]["scanned_instructions"] = scanned
            seen.clear()

# Resume from a snapshot: taken single-device and on (1x8); restored on (1x8), (2x4) and single.
snaps = {}
for name, mesh, tr in (("single", None, None), ("1x8", MESHES["1x8"], None),
                       ("1x8 tiered", MESHES["1x8"], tier("snap"))):
    eng = engine(mesh, tier=tr)
    sess = eng.start(prompts[1], gj.SamplingParams(max_new_tokens=4, stop_at_eos=False))
    sess.run()
    snaps[name] = os.path.join(tmp, name.replace(" ", "-"))
    sess.snapshot(snaps[name])
    sess.close()
    eng.close()
instr = random_prompts(rng, cfg.vocab_size, (7,))[0]
resumed = {}
RESUMES = [("single", "single", None, None), ("1x8", "2x4", MESHES["2x4"], None),
           ("1x8", "2x4 tiered", MESHES["2x4"], tier("resume")), ("1x8 tiered", "single", None, None)]
if FULL:
    RESUMES += [("1x8", "1x8", MESHES["1x8"], None), ("1x8", "single", None, None)]
for snap_name, eng_name, mesh, tr in RESUMES:
    eng = engine(mesh, tier=tr)
    r = eng.resume(snaps[snap_name], instr, params=gj.SamplingParams(max_new_tokens=5, stop_at_eos=False))
    resumed[f"{snap_name}->{eng_name}"] = r.run()
    r.close()
    eng.close()
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
