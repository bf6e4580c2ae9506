"""Decode-attention kernels on a GPU: correctness, achieved bandwidth, goals.

    python -m gemini_jax.bench.gpu_kernels OUTDIR            # on a GPU (experiments/gpu_check.sh runs it)
    python -m gemini_jax.bench.gpu_kernels OUTDIR --dry-run  # any host: tiny shapes, interpret mode

Measures, in one process:
- HBM copy bandwidth: a jitted `x + 1` over a large array (bytes read + written / time);
- at batch x context 1x32K, 8x32K, 1x128K (Llama-3-8B heads: 32 q / 8 kv heads, head_dim 128,
  bf16, pages of 16): the GPU Pallas paged kernel, the engine's XLA path (gather + dense, from
  `gemini_jax.attention.dispatch`) and jax's own Pallas GPU paged attention;
- at 1x128K with a 2K-token selection per (sequence, kv head): the GPU Pallas sparse kernel and
  the engine's XLA sparse path.
Achieved bandwidth = K/V bytes a variant must read (visible tokens x kv heads x head_dim x 2 x
itemsize; the selected pages for sparse) / time. Variants of one shape are timed side by side
(interleaved, order rotated); one timing is a jitted loop of `steps` dependent calls, so launch
and Python overheads are amortised as in a real decode loop.

Goals (each marked met / not met in OUTDIR/gpu_kernels.md, all numbers in gpu_kernels.json):
paged decode >= 70% of the measured HBM bandwidth at every shape >= 32K; sparse 2K at 128K
>= 10x faster than the dense paged kernel's step at 128K; Pallas >= XLA at every shape.

`--dry-run` runs every step end to end at tiny shapes with interpret=True (jax's kernel too), to
check the script itself off GPU; its numbers mean nothing and the report says so.
Needs jax, flax (the XLA path's layers), numpy; not hydra / wandb / tqdm.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import platform
import subprocess
import sys
import time

import jax
import jax.numpy as jnp
import numpy as np

from gemini_jax.attention import dispatch
from gemini_jax.attention.views import PageView, Selection
from pallas_kernels.paged_decode import paged_decode_attention_reference
from pallas_kernels.paged_decode_gpu import paged_decode_attention_gpu
from pallas_kernels.sparse_decode import sparse_decode_attention_reference
from pallas_kernels.sparse_decode_gpu import sparse_decode_attention_gpu

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # the checkout (its commit)

PAGED_HBM_GOAL = 0.70
SPARSE_SPEEDUP_GOAL = 10.0


@dataclasses.dataclass(frozen=True)
class Plan:
    """Shapes and repeats of one run (full on a GPU, tiny for --dry-run)."""

    dense: tuple  # (batch, context) pairs
    sparse: tuple  # (batch, context, budget tokens)
    num_q_heads: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    copy_bytes: int
    repeats: int
    steps: int  # dependent calls per timed loop
    interpret: bool
    goal_min_context: int  # the bandwidth goal applies from this context up


FULL = Plan(dense=((1, 32768), (8, 32768), (1, 131072)), sparse=((1, 131072, 2048),),
            num_q_heads=32, num_kv_heads=8, head_dim=128, page_size=16, copy_bytes=4 << 30,
            repeats=7, steps=20, interpret=False, goal_min_context=32768)
DRY = Plan(dense=((1, 512), (2, 512), (1, 1024)), sparse=((1, 1024, 128),),
           num_q_heads=4, num_kv_heads=2, head_dim=64, page_size=16, copy_bytes=16 << 20,
           repeats=2, steps=2, interpret=True, goal_min_context=0)


def make_pool(plan: Plan, batch: int, context: int, seed: int):
    """Full-length sequences on shuffled physical pages of a bf16 pool (+ one spare page)."""
    pages_per_seq = context // plan.page_size
    num_pages = batch * pages_per_seq + 1
    keys = jax.random.split(jax.random.key(seed), 3)
    shape = (plan.num_kv_heads, num_pages, plan.page_size, plan.head_dim)
    q = jax.random.normal(keys[0], (batch, plan.num_q_heads, plan.head_dim), jnp.bfloat16)
    k = jax.random.normal(keys[1], shape, jnp.bfloat16)
    v = jax.random.normal(keys[2], shape, jnp.bfloat16)
    perm = np.random.default_rng(seed).permutation(num_pages - 1)[:batch * pages_per_seq] + 1
    tables = jnp.asarray(perm.reshape(batch, pages_per_seq).astype(np.int32))
    lengths = jnp.full((batch,), context, jnp.int32)
    return q, k, v, tables, lengths


def make_selection(plan: Plan, batch: int, context: int, budget: int, seed: int):
    """i32[B, Hkv, budget / page_size]: a sink page, the last pages and random pages between."""
    pages_per_seq, slots = context // plan.page_size, budget // plan.page_size
    rng = np.random.default_rng(seed)
    sel = np.empty((batch, plan.num_kv_heads, slots), np.int32)
    for b in range(batch):
        for h in range(plan.num_kv_heads):
            middle = rng.choice(np.arange(1, pages_per_seq - 4), size=slots - 5, replace=False)
            sel[b, h] = np.sort(np.concatenate([[0], middle, np.arange(pages_per_seq - 4,
                                                                       pages_per_seq)]))
    return jnp.asarray(sel)


def timed_loop(attend, steps: int):
    """jit(loop of `steps` calls) -> seconds per call. Each call's query depends on the previous
    output (a 1e-30 nudge), so the calls run in order and none is hoisted out of the loop."""

    @jax.jit
    def loop(q, *rest):
        def body(_, carry):
            q, acc = carry
            out = attend(q, *rest)
            return q + (1e-30 * out).astype(q.dtype), acc + out.astype(jnp.float32).sum()

        return jax.lax.fori_loop(0, steps, body, (q, jnp.float32(0)))[1]

    def run(*args) -> float:
        t0 = time.perf_counter()
        jax.block_until_ready(loop(*args))
        return (time.perf_counter() - t0) / steps

    return run


def interleaved(variants: dict, args: dict, repeats: int) -> dict:
    """name -> median seconds per call; each repeat runs every variant once, order rotated."""
    for name, run in variants.items():
        run(*args[name])  # compile + warm up
    times = {n: [] for n in variants}
    names = list(variants)
    for r in range(repeats):
        k = r % len(names)
        for n in names[k:] + names[:k]:
            times[n].append(variants[n](*args[n]))
    return {n: float(np.median(t)) for n, t in times.items()}


def hbm_copy_bandwidth(plan: Plan) -> dict:
    n = plan.copy_bytes // 4
    x = jnp.arange(n, dtype=jnp.float32)
    step = jax.jit(lambda x: x + 1.0)
    jax.block_until_ready(step(x))
    ts = []
    for _ in range(max(plan.repeats, 3)):
        t0 = time.perf_counter()
        jax.block_until_ready(step(x))
        ts.append(time.perf_counter() - t0)
    t = float(np.median(ts))
    return {"bytes_read": plan.copy_bytes, "bytes_written": plan.copy_bytes, "seconds": t,
            "gbs": 2 * plan.copy_bytes / t / 1e9}


def spec_for(plan: Plan, impl: str):
    return dispatch.AttentionImpl(impl=impl, scale=plan.head_dim ** -0.5, interpret=plan.interpret,
                                  platform="gpu")


def jax_paged_variant(plan: Plan, pages_per_seq: int):
    """jax's own Pallas GPU paged attention (it takes no scale: pre-scale q). Its k_splits must
    divide pages_per_seq: the largest power of two <= 16 that does."""
    from jax.experimental.pallas.ops.gpu import paged_attention as jax_paged

    k_splits = max(s for s in (1, 2, 4, 8, 16) if pages_per_seq % s == 0)
    scale = plan.head_dim ** -0.5
    return lambda q, k, v, t, n: jax_paged.paged_attention(
        q * jnp.asarray(scale, q.dtype), k, v, t, n, k_splits=k_splits, interpret=plan.interpret)


def dense_row(plan: Plan, batch: int, context: int, check: bool) -> dict:
    q, k, v, tables, lengths = make_pool(plan, batch, context, seed=batch * 7 + context)
    scale = plan.head_dim ** -0.5
    xla = spec_for(plan, "xla")
    window = jnp.int32(0)
    variants = {
        "pallas_gpu": lambda q, k, v, t, n: paged_decode_attention_gpu(
            q, k, v, t, n, sm_scale=scale, interpret=plan.interpret),
        "xla": lambda q, k, v, t, n: dispatch.attend_pages(
            xla, (q[:, None], (n - 1)[:, None]), (k, v), PageView(t, n), window)[:, 0],
        "jax_pallas_gpu": jax_paged_variant(plan, tables.shape[1]),
    }
    row = {"kind": "dense", "batch": batch, "context": context,
           "kv_bytes": int(lengths.sum()) * plan.num_kv_heads * plan.head_dim * 2 * k.dtype.itemsize}
    if check:
        ref = paged_decode_attention_reference(q, k, v, tables, lengths, sm_scale=scale)
        for name, fn in variants.items():
            err = jnp.abs(jax.jit(fn)(q, k, v, tables, lengths).astype(jnp.float32)
                          - ref.astype(jnp.float32)).max()
            row[f"{name}_max_abs_err"] = float(err)
    args = {n: (q, k, v, tables, lengths) for n in variants}
    times = interleaved({n: timed_loop(f, plan.steps) for n, f in variants.items()}, args,
                        plan.repeats)
    for name, t in times.items():
        row[f"{name}_s"] = t
        row[f"{name}_gbs"] = row["kv_bytes"] / t / 1e9
    return row


def sparse_row(plan: Plan, batch: int, context: int, budget: int, check: bool) -> dict:
    q, k, v, tables, lengths = make_pool(plan, batch, context, seed=batch * 11 + context)
    selected = make_selection(plan, batch, context, budget, seed=budget)
    scale = plan.head_dim ** -0.5
    xla = spec_for(plan, "xla")
    window = jnp.int32(0)
    variants = {
        "pallas_gpu": lambda q, k, v, t, n, s: sparse_decode_attention_gpu(
            q, k, v, t, n, s, sm_scale=scale, interpret=plan.interpret),
        "xla": lambda q, k, v, t, n, s: dispatch.attend_selected(
            xla, (q[:, None], (n - 1)[:, None]), (k, v), PageView(t, n), Selection(s),
            window)[:, 0],
    }
    row = {"kind": "sparse", "batch": batch, "context": context, "budget": budget,
           "kv_bytes": int(selected.size) * plan.page_size * plan.head_dim * 2 * k.dtype.itemsize}
    if check:
        ref = sparse_decode_attention_reference(q, k, v, tables, lengths, selected, sm_scale=scale)
        for name, fn in variants.items():
            err = jnp.abs(jax.jit(fn)(q, k, v, tables, lengths, selected).astype(jnp.float32)
                          - ref.astype(jnp.float32)).max()
            row[f"{name}_max_abs_err"] = float(err)
    args = {n: (q, k, v, tables, lengths, selected) for n in variants}
    times = interleaved({n: timed_loop(f, plan.steps) for n, f in variants.items()}, args,
                        plan.repeats)
    for name, t in times.items():
        row[f"{name}_s"] = t
        row[f"{name}_gbs"] = row["kv_bytes"] / t / 1e9
    return row


def goals(rows: list[dict], hbm_gbs: float, min_context: int) -> list[dict]:
    out = []
    dense = [r for r in rows if r["kind"] == "dense" and "pallas_gpu_s" in r]
    for r in [r for r in dense if r["context"] >= min_context]:
        frac = r["pallas_gpu_gbs"] / hbm_gbs
        out.append({"goal": f"paged decode >= {PAGED_HBM_GOAL:.0%} of HBM copy bandwidth at "
                            f"{r['batch']}x{r['context']}",
                    "value": f"{frac:.1%} ({r['pallas_gpu_gbs']:.1f} of {hbm_gbs:.1f} GB/s)",
                    "met": frac >= PAGED_HBM_GOAL})
    for r in [r for r in rows if r["kind"] == "sparse" and "pallas_gpu_s" in r]:
        same = [d for d in dense if (d["batch"], d["context"]) == (r["batch"], r["context"])]
        if same:
            speedup = same[0]["pallas_gpu_s"] / r["pallas_gpu_s"]
            out.append({"goal": f"sparse {r['budget']}-token budget at {r['batch']}x{r['context']}"
                                f" >= {SPARSE_SPEEDUP_GOAL:.0f}x faster than the dense paged step",
                        "value": f"{speedup:.1f}x", "met": speedup >= SPARSE_SPEEDUP_GOAL})
    for r in rows:
        if "pallas_gpu_s" in r and "xla_s" in r:
            ratio = r["xla_s"] / r["pallas_gpu_s"]
            out.append({"goal": f"pallas >= XLA ({r['kind']} {r['batch']}x{r['context']})",
                        "value": f"pallas {ratio:.2f}x the XLA path's speed", "met": ratio >= 1.0})
    return out


def report_markdown(result: dict) -> str:
    dry = (f" (DRY RUN: tiny shapes, interpret mode on {result['backend']}; numbers mean nothing)"
           if result["dry_run"] else "")
    lines = [f"# GPU decode-attention kernels{dry}",
             "", f"Device: {', '.join(result['devices'])}; jax {result['jax']}; commit "
                 f"`{result['commit']}`; command `{result['command']}`.", "",
             f"HBM copy bandwidth (measured): **{result['hbm']['gbs']:.1f} GB/s**" if "hbm" in result
             else "HBM copy bandwidth: not measured", "",
             "| shape | variant | time / step | K/V bytes | achieved GB/s | max abs err vs reference |",
             "| --- | --- | --- | --- | --- | --- |"]
    for r in result["rows"]:
        shape = f"{r['kind']} {r['batch']}x{r['context']}" + (f" (budget {r['budget']})"
                                                                if r["kind"] == "sparse" else "")
        if "error" in r:
            lines.append(f"| {shape} | - | error: {r['error'][:200]} | | | |")
            continue
        for name in ("pallas_gpu", "xla", "jax_pallas_gpu"):
            if f"{name}_s" in r:
                err = r.get(f"{name}_max_abs_err")
                lines.append(f"| {shape} | {name} | {r[f'{name}_s'] * 1e6:.1f} µs | "
                             f"{r['kv_bytes'] / 2**20:.1f} MiB | {r[f'{name}_gbs']:.1f} | "
                             f"{'-' if err is None else f'{err:.2e}'} |")
    lines += ["", "| goal | value | met |", "| --- | --- | --- |"]
    lines += [f"| {g['goal']} | {g['value']} | {'met' if g['met'] else 'NOT met'} |"
              for g in result["goals"]]
    if result["dry_run"]:
        lines += ["", "Dry run: every step ran end to end; the goal marks above are not results."]
    return "\n".join(lines) + "\n"


def commit() -> str:
    """The full commit of this checkout (a record's `commit`); "unknown" where git or the history
    did not travel with the tree (then say in the commit message which commit the tree was)."""
    try:
        return subprocess.run(["git", "rev-parse", "HEAD"], cwd=ROOT, capture_output=True,
                              text=True, timeout=10).stdout.strip() or "unknown"
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("outdir")
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes, interpret mode: check the script on any host")
    parser.add_argument("--no-check", action="store_true",
                        help="skip the comparison with the jnp references")
    args = parser.parse_args(argv)
    plan = DRY if args.dry_run else FULL
    if not args.dry_run and jax.default_backend() not in ("gpu", "cuda", "rocm"):
        print(f"backend is {jax.default_backend()!r}, not a GPU: use --dry-run", file=sys.stderr)
        return 2
    os.makedirs(args.outdir, exist_ok=True)
    result = {"dry_run": args.dry_run, "backend": jax.default_backend(), "jax": jax.__version__,
              "python": platform.python_version(),
              "devices": [f"{d} ({getattr(d, 'device_kind', '?')})" for d in jax.devices()],
              "commit": commit(), "command": " ".join(["python -m gemini_jax.bench.gpu_kernels", *sys.argv[1:]]),
              # a result record's fields (gemini_jax.eval.record): seeds are fixed per shape
              # (make_pool: batch * 7 + context, batch * 11 + context; selections: the budget)
              "config": dataclasses.asdict(plan), "split": None, "seeds": ["per shape, see make_pool"],
              "plan": dataclasses.asdict(plan), "rows": []}
    t0 = time.perf_counter()
    result["hbm"] = hbm_copy_bandwidth(plan)
    print(f"hbm copy: {result['hbm']['gbs']:.1f} GB/s", flush=True)
    jobs = [("dense", shape) for shape in plan.dense] + [("sparse", shape) for shape in plan.sparse]
    for i, (kind, shape) in enumerate(jobs):
        # The dense reference materialises the whole context in f32: run it at the first shape;
        # the sparse one reads only the selection.
        check = not args.no_check and (i == 0 or kind == "sparse" or args.dry_run)
        try:
            row = (dense_row if kind == "dense" else sparse_row)(plan, *shape, check)
        except Exception as e:  # record and go on: one failing shape must not hide the others
            row = {"kind": kind, "batch": shape[0], "context": shape[1],
                   "error": f"{type(e).__name__}: {e}"[:1000]}
        result["rows"].append(row)
        print(json.dumps(row), flush=True)
    result["goals"] = goals(result["rows"], result["hbm"]["gbs"], plan.goal_min_context)
    result["seconds"] = time.perf_counter() - t0
    with open(os.path.join(args.outdir, "gpu_kernels.json"), "w") as f:
        json.dump(result, f, indent=1)
    md = report_markdown(result)
    with open(os.path.join(args.outdir, "gpu_kernels.md"), "w") as f:
        f.write(md)
    print(md)
    errors = [r for r in result["rows"] if "error" in r]
    return 1 if errors else 0


if __name__ == "__main__":
    sys.exit(main())
