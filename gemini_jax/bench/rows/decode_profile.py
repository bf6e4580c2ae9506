"""Row `decode_profile`: where a batch-1 decode step's time goes, against the bytes each part of it
must read.

Two measurements of the engine's own k-step program (`DecodeHarness`), neither under the profiler:
the step at a short context, where attention reads almost nothing (what is left is the weight
products, norms and sampling), and the step at a long one. The growth between them is attention
over the pages, and the engine's `kv_bytes_read` counter gives the bytes that growth reads: bytes
over time is the rate each part reads at, beside the bandwidth measured in the same run. A
`jax.profiler` trace at the long context then splits the attention loop (`decode_over_pages`: one
`while` op per layer and step) by op kind (the name XLA gives a fusion, without its number): what
copies pages, what masks, what multiplies.
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


def read_trace(trace_dir: str) -> list[dict]:
    """The complete ('X') events of the perfetto trace `jax.profiler` wrote under `trace_dir`."""
    files = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"), recursive=True)
    if not files:
        raise RuntimeError(f"jax.profiler wrote no perfetto trace under {trace_dir}")
    with gzip.open(files[0], "rt") as fh:
        events = json.load(fh)
    events = events["traceEvents"] if isinstance(events, dict) else events
    return [e for e in events if e.get("ph") == "X" and "dur" in e]


def loop_body_times(events: list[dict], loops: set[str]) -> dict[str, float]:
    """Self time (µs) per op kind of the ops in the bodies of the `while` ops named in `loops`.

    XLA's CPU runtime runs ops asynchronously: a loop's event covers the part on its own thread and
    the rest of its body runs on the intra-op pool's threads, so a span in time does not tell which
    ops are the loop's. Op names do: each HLO instruction has its own name, so every op seen nested
    in a loop's event on that thread is a body op, and so is each of its runs on another thread.
    Self time is an op's time less the ops nested in it on its thread. Host events are dropped."""
    ops = [e for e in events if not HOST_EVENTS.search(e["name"]) and not e["name"].startswith("end: ")]
    by_thread = defaultdict(list)
    for e in ops:
        by_thread[e["pid"], e["tid"]].append(e)
    body, selfs = set(), []
    for evs in by_thread.values():
        evs.sort(key=lambda e: (float(e["ts"]), -float(e["dur"])))
        stack: list[list] = []  # [name, end, self] of the open ops on this thread, outermost first
        for e in evs:
            ts, dur = float(e["ts"]), float(e["dur"])
            while stack and ts >= stack[-1][1]:
                stack.pop()
            if any(name in loops for name, _, _ in stack):
                body.add(e["name"])
            if stack:
                stack[-1][2] -= dur
            stack.append([e["name"], ts + dur, dur])
            selfs.append(stack[-1])
    kinds = defaultdict(float)
    for name, _, self_us in selfs:
        if name in body:
            kinds[re.sub(r"\.\d+$", "", name)] += self_us
    return dict(kinds)


def step_seconds(model, context: int, k: int, seed: int, trace_calls: int = 0) -> tuple[float, float, list]:
    """(seconds per step without the profiler, median of 3; KV bytes per step; the trace events of
    `trace_calls` k-step calls, or [] when 0)."""
    h = DecodeHarness(model, kind="paged", context=context, new_tokens=k * (trace_calls + 4), seed=seed,
                      steps_per_call=k)
    try:
        h.timed(k)  # compile + warm
        plain = median([h.timed(2 * k) for _ in range(3)])
        kv_bytes = h.kv_bytes_per_step
        events = []
        if trace_calls:
            h.rewind()
            trace_dir = tempfile.mkdtemp(prefix="gj_decode_trace_")
            try:
                with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
                    for _ in range(trace_calls):
                        h.step()
                    jax.block_until_ready(h.next_tok)
                events = read_trace(trace_dir)
            finally:
                shutil.rmtree(trace_dir, ignore_errors=True)
        return plain, kv_bytes, events
    finally:
        close_harnesses(h)


def profile_step(model, context: int, k: int, calls: int, seed: int, short: int) -> dict:
    """Attention's cost at `context` as the step's growth from `short` tokens (where it reads
    little KV) to `context`, set against the KV bytes that growth reads; the rest as the short
    step, against the weights; and the attention loop's ops by kind, from a trace."""
    base, base_kv, _ = step_seconds(model, short, k, seed)
    plain, kv_bytes, events = step_seconds(model, context, k, seed, calls)
    tokens = calls * k
    counts = defaultdict(int)
    for e in events:
        counts[e["name"]] += e["name"].startswith("while.")
    # The attention loops: a `while` op run once per layer and step (not the k-step loop around them).
    loops = {n for n, c in counts.items() if c >= tokens}
    if not loops:
        raise RuntimeError(f"no attention loop in the trace at {context} tokens; the loop needs more than one "
                           f"chunk of pages (paged_decode.CHUNK_PAGES).")
    kinds = {kind: us / tokens for kind, us in loop_body_times(events, loops).items()}
    return {"context": context, "k": k, "calls": calls, "short_context": short, "step_seconds_plain": plain,
            "short_step_seconds": base, "kv_bytes_per_step": kv_bytes, "short_kv_bytes_per_step": base_kv,
            "attention_kinds_us": kinds}


@row("decode_profile", about=(
    "Where a batch-1 decode step's time goes on this backend (the benchmark Llama's shape, fp32, paged "
    "cache of block 16, k = 16 steps per call): the step at a short context (the weights, norms and "
    "sampling; attention reads almost nothing) against the step at 2K and 16K, whose growth is "
    "attention over the pages and reads the KV the engine's `kv_bytes_read` counts; each part's "
    "bytes over its time is the rate it reads at, next to the bandwidth measured in this run. A "
    "`jax.profiler` trace of the k-step program splits the attention loop "
    "(`paged_decode.decode_over_pages`) by op kind: what copies pages, what masks, what multiplies."))
def decode_profile(ctx: Context) -> RowResult:
    # Quick: past one chunk of pages (paged_decode.CHUNK_PAGES x 16 tokens), so the loop stays a loop.
    s = ctx.pick(quick=dict(contexts=(1280,), k=4, calls=1, short=64),
                 full=dict(contexts=(2048, 16384), k=16, calls=2, short=64))
    model = llama_weights(ctx).ours
    w_bytes = weight_bytes_per_step(model.cfg)
    bw = ctx.bandwidth["reference_gbs"] * 1e9
    recs, table, inside = [], [], []
    for context in s["contexts"]:
        t0 = time.perf_counter()
        p = profile_step(model, context, s["k"], s["calls"], ctx.seed, s["short"])
        att_s = p["step_seconds_plain"] - p["short_step_seconds"]
        att_bytes = p["kv_bytes_per_step"] - p["short_kv_bytes_per_step"]
        rec = {"row": "decode_profile", **p, "weight_bytes_per_step": w_bytes,
               "attention_seconds": att_s, "attention_share": att_s / p["step_seconds_plain"],
               "attention_gbs": att_bytes / att_s / 1e9 if att_s > 0 else None,
               "rest_gbs": (w_bytes + p["short_kv_bytes_per_step"]) / p["short_step_seconds"] / 1e9,
               "bound_seconds": (p["kv_bytes_per_step"] + w_bytes) / bw, "profile_seconds": time.perf_counter() - t0}
        recs.append(rec)
        att = "–" if rec["attention_gbs"] is None else f"{rec['attention_gbs']:.1f} GB/s"
        table.append([context, fmt_ms(p["step_seconds_plain"]), fmt_ms(rec["bound_seconds"]),
                      f"{100 * rec['bound_seconds'] / p['step_seconds_plain']:.0f}%",
                      fmt_ms(p["short_step_seconds"]), f"{fmt_bytes(w_bytes)} at {rec['rest_gbs']:.1f} GB/s",
                      f"{100 * rec['attention_share']:.0f}%", f"{fmt_bytes(att_bytes)} at {att}"])
        kinds = sorted(p["attention_kinds_us"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in kinds) or 1.0
        inside.append(f"- {context} tokens: " + ", ".join(f"`{kd}` {100 * v / total:.0f}%" for kd, v in kinds[:6]))
    md = md_table(["context", "step", "bound: bytes / bandwidth", "of the bound", f"step at {s['short']} tokens",
                   "it reads the weights at", "attention: share of the step", "attention reads its KV at"], table)
    md += ("\n\nAttention's cost is the step's growth from a short context to this one, against the KV bytes that "
           "growth reads (the engine's `kv_bytes_read`); the short step stands for the rest (weights, norms, "
           "sampling). Inside the attention loop, self time by op kind (share of the loop's ops; a "
           "`jax.profiler` trace of the k-step program):\n\n" + "\n".join(inside)
           + f"\n\nBandwidth {ctx.bandwidth['reference_gbs']:.1f} GB/s ({ctx.bandwidth['reference']}), measured "
           "in this run.")
    return RowResult(records=recs, markdown=md)


def summary_lines(rec: dict, link: str) -> list[str]:
    """The table docs/results.md shows of a bench record holding this row (`link`: its BENCH.md)."""
    recs = rec["rows"]["decode_profile"]["records"]
    lines = [f"Where a batch-1 step's time goes (k = {recs[0]['k']}): the step at {recs[0]['short_context']} tokens "
             "stands for the weights; its growth to the long context is attention, against the KV bytes it reads.", "",
             "| context | step | bound | weights read at | attention: share, KV read at | attention loop by op kind |",
             "|---|---|---|---|---|---|"]
    for r in recs:
        kinds = sorted(r["attention_kinds_us"].items(), key=lambda kv: -kv[1])
        total = sum(v for _, v in kinds) or 1.0
        att = "–" if r["attention_gbs"] is None else f"{r['attention_gbs']:.1f} GB/s"
        lines.append(f"| {r['context']} | {r['step_seconds_plain'] * 1e3:.2f} ms | {r['bound_seconds'] * 1e3:.2f} ms | "
                     f"{r['rest_gbs']:.1f} GB/s | {r['attention_share']:.0%}, {att} | "
                     + ", ".join(f"`{k}` {v / total:.0%}" for k, v in kinds[:4]) + " |")
    return lines + ["", f"From [BENCH.md]({link}), commit `{rec['commit'][:7]}`, seed "
                    f"{rec['seeds'][0]}; bandwidth {rec['bandwidth']['reference_gbs']:.1f} GB/s measured in the same run.",
                    ""]
