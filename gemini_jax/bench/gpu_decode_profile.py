"""Decode on a GPU against the HBM bound, and where a step's time goes.

    python -m gemini_jax.bench.gpu_decode_profile OUTDIR             # a GPU (about 4 minutes on an H200)
    python -m gemini_jax.bench.gpu_decode_profile OUTDIR --dry-run   # any host: tiny shapes, checks the script

For two model shapes with random weights (the bytes read and the kernels launched do not depend
on the values): the benchmark Llama (4 layers, 45M parameters) and SmolLM2-135M's shape (30
layers, 576 wide, 135M parameters, tied embeddings), float32, paged cache (block 16), batch 1:

1. the decode step of the engine's own path (`gemini_jax.bench.decode.DecodeHarness`: `runner.decode`
   for k = 1, the k-step program for k > 1), median of interleaved repeats, at 2K and 8K tokens;
   bytes per step = the weights (each read once per step) + the engine's `kv_bytes_read`
   counter; achieved GB/s and the fraction of the HBM copy bandwidth measured in the same run;
2. a `jax.profiler` trace of a few k = 16 calls per shape, summarised here: the device's kernel
   time per token against the wall time per token (what is left is launch and host time), the
   kernels launched per token, and the kernels that take the most time.

Writes OUTDIR/decode_profile.{json,md}.
"""

from __future__ import annotations

import argparse
import glob
import gzip
import json
import os
import subprocess
import sys
import tempfile
import time
from collections import defaultdict

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

import gemini_jax as gj
from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.testing import random_model

SHAPES = {
    "bench-llama": dict(vocab_size=32000, hidden_size=512, intermediate_size=1536, num_layers=4, num_heads=8,
                        num_kv_heads=2, head_dim=64, tie_embeddings=False),
    "smollm2-135m": dict(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_layers=30, num_heads=9,
                         num_kv_heads=3, head_dim=64, tie_embeddings=True),
}
TINY = dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_layers=2, num_heads=2, num_kv_heads=1,
            head_dim=32, tie_embeddings=False)


def hbm_copy_gbs(dry: bool) -> float:
    """Bytes read + written per second by a jitted elementwise copy of a 1 GiB array (64 MiB dry)."""
    n = (64 if dry else 1024) * 2**20 // 4
    x = jnp.arange(n, dtype=jnp.float32)
    f = jax.jit(lambda a: a + 1.0)
    jax.block_until_ready(f(x))
    times = []
    for _ in range(10):
        t0 = time.perf_counter()
        jax.block_until_ready(f(x))
        times.append(time.perf_counter() - t0)
    return 2 * n * 4 / float(np.median(times)) / 1e9


def weight_bytes(model) -> int:
    """Weights one batch-1 step reads: all of them, the embedding table once (a row when untied)."""
    _, state = nnx.split(model)
    leaves = jax.tree.leaves(state)
    total = sum(x.size * x.dtype.itemsize for x in leaves)
    cfg = model.cfg
    if cfg.tie_embeddings:
        return total
    return total - (cfg.vocab_size - 1) * cfg.hidden_size * leaves[0].dtype.itemsize


def measure(model, contexts, ks, steps: int, repeats: int, seed: int) -> list[dict]:
    """Interleaved repeats over every (context, k) harness of `model`; one record each."""
    harnesses = {}
    for ctx_len in contexts:
        for k in ks:
            h = DecodeHarness(model, kind="paged", context=ctx_len, new_tokens=steps * (repeats + 2) + k,
                              seed=seed, steps_per_call=k)
            h.timed(steps)  # compile + warm
            harnesses[ctx_len, k] = h
    times = defaultdict(list)
    for rep in range(repeats):
        order = list(harnesses)
        order = order[rep % len(order):] + order[:rep % len(order)]  # rotate who goes first
        for key in order:
            times[key].append(harnesses[key].timed(steps))
    wbytes = weight_bytes(model)
    out = []
    for (ctx_len, k), h in harnesses.items():
        kv = h.kv_bytes_per_step
        step = float(np.median(times[ctx_len, k]))
        out.append({"context": ctx_len, "k": k, "step_seconds_median": step, "step_seconds_all": times[ctx_len, k],
                    "weight_bytes": wbytes, "kv_bytes_per_step": kv, "bytes_per_step": wbytes + kv,
                    "achieved_gbs": (wbytes + kv) / step / 1e9})
        h.close()
    return out


def trace_summary(trace_dir: str, tokens: int, any_process: bool = False) -> dict:
    """Kernel time and count per token from the perfetto trace `jax.profiler` wrote: events on the
    device's processes (their name holds 'GPU' or '/device:'), busy time as the union of their
    intervals (overlapping streams counted once). `any_process`: every process counts (a CPU dry run)."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        return {"error": f"no perfetto trace under {trace_dir}"}
    with gzip.open(files[0], "rt") as f:
        events = json.load(f)
    events = events["traceEvents"] if isinstance(events, dict) else events
    pname = {e["pid"]: e.get("args", {}).get("name", "") for e in events
             if e.get("ph") == "M" and e.get("name") == "process_name"}
    device = {p for p, n in pname.items() if any_process or "GPU" in n or "/device:" in n}
    kernels = [e for e in events if e.get("ph") == "X" and e.get("pid") in device and "dur" in e]
    if not kernels:
        return {"error": "no device events in the trace", "processes": sorted(set(pname.values()))}
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in kernels)
    busy, end = 0.0, -1.0
    for a, b in spans:
        if b > end:
            busy += b - max(a, end)
            end = b
    by_name = defaultdict(lambda: [0, 0.0])
    for e in kernels:
        by_name[e["name"]][0] += 1
        by_name[e["name"]][1] += float(e["dur"])
    top = sorted(by_name.items(), key=lambda kv: -kv[1][1])[:15]
    return {"device_processes": sorted(pname[p] for p in device), "events": len(kernels),
            "events_per_token": len(kernels) / tokens, "device_busy_us_per_token": busy / tokens,
            "window_us": spans[-1][1] - spans[0][0],
            "top": [{"name": n[:120], "count": c, "total_us": t} for n, (c, t) in top]}


def profile(model, context: int, k: int, calls: int, seed: int, any_process: bool = False) -> dict:
    h = DecodeHarness(model, kind="paged", context=context, new_tokens=k * (calls + 4), seed=seed, steps_per_call=k)
    h.timed(k)  # compile + warm
    h.rewind()
    t0 = time.perf_counter()
    out_dir = tempfile.mkdtemp(prefix="decode_trace_")  # deep folders: summarised here, not kept
    with jax.profiler.trace(out_dir, create_perfetto_trace=True):
        for _ in range(calls):
            h.step()
        jax.block_until_ready(h.next_tok)
    wall = time.perf_counter() - t0
    h.close()
    tokens = calls * k
    return {"context": context, "k": k, "calls": calls, "wall_us_per_token": wall / tokens * 1e6,
            **trace_summary(out_dir, tokens, any_process)}


def report(res: dict) -> str:
    hbm = res["hbm_copy_gbs"]
    lines = [f"# Decode on {res['device']} against the HBM bound", "",
             f"Command: `{res['command']}`; commit `{res['commit']}`; seed {res['seed']}; jax {res['jax']}.", "",
             f"HBM copy bandwidth measured in the same run: **{hbm:.1f} GB/s**. Batch 1, float32, paged (block 16); "
             f"median of {res['repeats']} interleaved repeats of {res['steps']} tokens.", "",
             "| shape | context | k | step | bytes / step | GB/s | of HBM copy |", "|---|---|---|---|---|---|---|"]
    for r in res["rows"]:
        lines.append(f"| {r['shape']} | {r['context']} | {r['k']} | {r['step_seconds_median'] * 1e3:.3f} ms | "
                     f"{r['bytes_per_step'] / 2**20:.0f} MiB | {r['achieved_gbs']:.0f} | "
                     f"{r['achieved_gbs'] / hbm:.1%} |")
    lines += ["", "## Where a token's time goes (jax.profiler trace, k-step calls)", "",
              "| shape | context | k | wall / token | device busy / token | busy share | kernels / token |",
              "|---|---|---|---|---|---|---|"]
    for p in res["profiles"]:
        if "error" in p:
            lines.append(f"| {p['shape']} | {p['context']} | {p['k']} | {p['wall_us_per_token']:.0f} µs | "
                         f"{p['error']} | | |")
            continue
        lines.append(f"| {p['shape']} | {p['context']} | {p['k']} | {p['wall_us_per_token']:.0f} µs | "
                     f"{p['device_busy_us_per_token']:.0f} µs | "
                     f"{p['device_busy_us_per_token'] / p['wall_us_per_token']:.0%} | {p['events_per_token']:.0f} |")
    for p in res["profiles"]:
        if "top" not in p:
            continue
        lines += ["", f"Top kernels, {p['shape']} at {p['context']} (k = {p['k']}, {p['calls']} calls):", "",
                  "| kernel | count | total | per token |", "|---|---|---|---|"]
        tokens = p["calls"] * p["k"]
        for t in p["top"]:
            lines.append(f"| `{t['name']}` | {t['count']} | {t['total_us']:.0f} µs | {t['total_us'] / tokens:.1f} µs |")
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out")
    ap.add_argument("--dry-run", action="store_true", help="tiny shapes on any backend (checks the script)")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    os.makedirs(args.out, exist_ok=True)
    dry = args.dry_run
    shapes = {"tiny": TINY} if dry else SHAPES
    contexts, ks = ((256,), (1, 4)) if dry else ((2048, 8192), (1, 16))
    steps, repeats = (8, 2) if dry else (32, 5)
    try:
        commit = subprocess.run(["git", "rev-parse", "HEAD"], capture_output=True, text=True,
                                cwd=os.path.dirname(os.path.abspath(__file__))).stdout.strip() or "unknown"
    except OSError:
        commit = "unknown"
    res = {"device": str(jax.devices()[0].device_kind), "jax": jax.__version__, "commit": commit,
           "command": "python -m gemini_jax.bench.gpu_decode_profile OUTDIR" + (" --dry-run" if dry else ""),
           "seed": args.seed, "steps": steps, "repeats": repeats, "hbm_copy_gbs": hbm_copy_gbs(dry),
           "rows": [], "profiles": []}
    print(f"HBM copy: {res['hbm_copy_gbs']:.1f} GB/s", flush=True)
    for name, shape in shapes.items():
        model = random_model(gj.ModelConfig(family="llama", max_position=16384, **shape), args.seed)
        for r in measure(model, contexts, ks, steps, repeats, args.seed):
            res["rows"].append({"shape": name, **r})
            print(json.dumps(res["rows"][-1])[:300], flush=True)
        k = ks[-1]
        p = profile(model, contexts[0], k, 4, args.seed, any_process=dry)
        res["profiles"].append({"shape": name, **p})
        print(json.dumps(res["profiles"][-1])[:600], flush=True)
        del model
    with open(os.path.join(args.out, "decode_profile.json"), "w") as f:
        json.dump(res, f, indent=1)
    with open(os.path.join(args.out, "decode_profile.md"), "w") as f:
        f.write(report(res))
    print(report(res))
    return 0


if __name__ == "__main__":
    sys.exit(main())
