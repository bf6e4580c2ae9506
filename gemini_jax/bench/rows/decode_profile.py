"""Row `decode_profile`: where a batch-1 decode step's time goes, op by op, against the bytes each
part of it must read.

A `jax.profiler` trace of a few k-step calls (the engine's own program, `DecodeHarness`) records
every XLA op the CPU runs. The ops are split in two by what encloses them: attention over the
pages (the per-layer loop `paged_decode.decode_over_pages` runs: one `while` op per layer and step)
and the rest of the step (the weight products, norms, sampling). Each part's time per token is set
against the bytes it reads (the engine's `kv_bytes_read` counter; the weights), which gives the rate
it reads them at, as a share of the bandwidth measured in the same run. Inside the attention loop,
the ops are grouped by kind (the name XLA gives a fusion, without its number): what copies pages,
what masks, what multiplies.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import shutil
import tempfile
import time
from collections import defaultdict

import jax

from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import close_harnesses, llama_weights
from gemini_jax.bench.rows.kv_bytes import weight_bytes_per_step
from gemini_jax.bench.timing import fmt_bytes, fmt_ms, md_table, median

# Host-side events in the trace (the Python call, the runtime's dispatch and waits): not ops.
HOST_EVENTS = re.compile(r"^\$|Thunk|PjitFunction|PjRt|np\.asarray|Execute")


def trace_ops(trace_dir: str) -> list[dict]:
    """The XLA op events of the perfetto trace under `trace_dir`: name, kind (the name without its
    `.N`), duration and self time in µs (without the ops nested in it), and whether an attention
    loop (a `while` op) encloses it."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    with gzip.open(files[0], "rt") as fh:
        events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    ops = [e for e in events if e.get("ph") == "X" and "dur" in e and not HOST_EVENTS.search(e["name"])]
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[e["pid"], e["tid"]].append(e)
    out = []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[dict] = []  # the open ops enclosing the current one, outermost first
        for e in evs:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and ts >= stack[-1]["end"]:
                stack.pop()
            rec = {"name": e["name"], "kind": re.sub(r"\.\d+$", "", e["name"]), "dur": dur, "self": dur,
                   "end": ts + dur, "in_loop": any(s["kind"] == "while" for s in stack)}
            if stack:
                stack[-1]["self"] -= dur
            stack.append(rec)
            out.append(rec)
    return out


def profile_step(model, context: int, k: int, calls: int, seed: int) -> dict:
    """One context: the step time without the profiler (median of 3), then a trace of `calls`
    k-step calls, summarised per token."""
    h = DecodeHarness(model, kind="paged", context=context, new_tokens=k * (calls + 4), seed=seed, steps_per_call=k)
    try:
        h.timed(k)  # compile + warm
        plain = median([h.timed(2 * k) for _ in range(3)])
        h.rewind()
        kv_bytes = h.kv_bytes_per_step
        trace_dir = tempfile.mkdtemp(prefix="gj_decode_trace_")
        try:
            with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                for _ in range(calls):
                    h.step()
                jax.block_until_ready(h.next_tok)
            ops = trace_ops(trace_dir)
        finally:
            shutil.rmtree(trace_dir, ignore_errors=True)
    finally:
        close_harnesses(h)
    tokens = calls * k
    loops = [o for o in ops if o["kind"] == "while" and not o["in_loop"]]
    steps_loops = [o for o in loops if sum(x["name"] == o["name"] for x in loops) >= tokens]  # one per layer and step
    if not steps_loops:
        raise RuntimeError(f"no attention loop in the trace at {context} tokens (op kinds: "
                           f"{sorted({o['kind'] for o in ops})[:20]}); the loop needs more than one chunk of pages.")
    attention = sum(o["dur"] for o in steps_loops) / tokens
    total = sum(o["self"] for o in ops) / tokens
    kinds = defaultdict(float)
    for o in ops:
        if o["in_loop"]:
            kinds[o["kind"]] += o["self"] / tokens
    rest = defaultdict(float)
    for o in ops:
        if not o["in_loop"] and o["kind"] != "while":
            rest[o["name"]] += o["self"] / tokens
    return {"context": context, "k": k, "calls": calls, "step_seconds_plain": plain, "kv_bytes_per_step": kv_bytes,
            "traced_op_us_per_token": total, "attention_us_per_token": attention,
            "rest_us_per_token": total - attention, "attention_kinds_us": dict(kinds),
            "rest_top_us": dict(sorted(rest.items(), key=lambda kv: -kv[1])[:5])}


@row("decode_profile", about=(
    "Where a batch-1 decode step's time goes on this backend (the benchmark Llama's shape, fp32, paged "
    "cache of block 16, k = 16 steps per call): a `jax.profiler` trace of the engine's k-step program, "
    "its XLA ops split into attention over the pages (the per-layer `while` loop of "
    "`paged_decode.decode_over_pages`) and the rest of the step, each against the bytes it reads "
    "(the `kv_bytes_read` counter; the weights) and the bandwidth measured in this run. The traced op "
    "times run slower than the untraced step (the profiler's own cost), so the table gives each part's "
    "share of the traced time and projects it onto the untraced step."))
def decode_profile(ctx: Context) -> RowResult:
    # Quick: past one chunk of pages (paged_decode.CHUNK_PAGES x 16 tokens), so the loop stays a loop.
    s = ctx.pick(quick=dict(contexts=(1280,), k=4, calls=1), full=dict(contexts=(2048, 16384), k=16, calls=2))
    model = llama_weights(ctx).ours
    w_bytes = weight_bytes_per_step(model.cfg)
    bw = ctx.bandwidth["reference_gbs"] * 1e9
    recs, table, inside = [], [], []
    for context in s["contexts"]:
        t0 = time.perf_counter()
        p = profile_step(model, context, s["k"], s["calls"], ctx.seed)
        share = p["attention_us_per_token"] / p["traced_op_us_per_token"]
        att_s, rest_s = share * p["step_seconds_plain"], (1 - share) * p["step_seconds_plain"]
        rec = {"row": "decode_profile", **p, "weight_bytes_per_step": w_bytes, "attention_share": share,
               "attention_seconds_projected": att_s, "rest_seconds_projected": rest_s,
               "attention_gbs": p["kv_bytes_per_step"] / att_s / 1e9, "rest_gbs": w_bytes / rest_s / 1e9,
               "bound_seconds": (p["kv_bytes_per_step"] + w_bytes) / bw, "profile_seconds": time.perf_counter() - t0}
        recs.append(rec)
        table.append([context, fmt_ms(p["step_seconds_plain"]), fmt_ms(rec["bound_seconds"]),
                      f"{100 * rec['bound_seconds'] / p['step_seconds_plain']:.0f}%",
                      f"{100 * share:.0f}%", f"{fmt_bytes(p['kv_bytes_per_step'])} at {rec['attention_gbs']:.1f} GB/s",
                      f"{fmt_bytes(w_bytes)} at {rec['rest_gbs']:.1f} GB/s"])
        kinds = sorted(p["attention_kinds_us"].items(), key=lambda kv: -kv[1])
        att = sum(v for _, v in kinds) or 1.0
        inside.append(f"- {context} tokens: " + ", ".join(f"`{kd}` {100 * v / att:.0f}%" for kd, v in kinds[:6])
                      + "; outside it, the ops taking most: "
                      + ", ".join(f"`{n}` {v:.0f} µs" for n, v in p["rest_top_us"].items()))
    md = md_table(["context", "step (untraced)", "bound: bytes / bandwidth", "of the bound", "attention share",
                   "attention reads KV", "the rest reads weights"], table)
    md += ("\n\nInside the attention loop, self time by op kind (share of the loop):\n\n" + "\n".join(inside)
           + f"\n\nBandwidth {ctx.bandwidth['reference_gbs']:.1f} GB/s ({ctx.bandwidth['reference']}); rates are bytes "
           "over the untraced step time times the part's traced share (a projection, not a separate measurement).")
    return RowResult(records=recs, markdown=md)
