"""Row `resume_vs_reprefill`: continuing after an interrupt from an Orbax snapshot vs
re-prefilling the whole sequence."""

from __future__ import annotations

import os
import shutil
import tempfile
import time

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import llama
from gemini_jax.bench.timing import fmt_ratio, md_table, median, ratio_stats


@row("resume_vs_reprefill", about=(
    "Interruptible decoding: a session over a long context generates a few tokens, is "
    "interrupted and snapshotted (Orbax, on local disk). Timed per repeat, interleaved: (a) "
    "`eng.resume(snapshot, instruction)` + the first new token: reading and verifying the "
    "snapshot, restoring its KV pages, prefilling only the instruction; (b) the alternative "
    "without snapshots: `generate(prompt + generated + instruction, max_new_tokens=1)` on an "
    "engine without prefix caching, i.e. a full re-prefill. Headline = median of per-repeat "
    "(b)/(a). Both produce the same next token (checked). Counters from each run's stats."))
def resume_vs_reprefill(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(context=2048, generated=8, instruction=32, repeats=3),
                 full=dict(context=32768, generated=16, instruction=32, repeats=3))
    model = llama(ctx).ours
    V = model.cfg.vocab_size
    C, G, I = s["context"], s["generated"], s["instruction"]
    ecfg = dict(max_seq_len=C + G + I + 8, max_batch=1, prefill_chunk=2048, attention_impl="xla")
    eng = gj.Engine(model, gj.EngineConfig(**ecfg, cache=CacheConfig(block_size=16, prefix_caching=False)))
    greedy = dict(temperature=0.0, stop_at_eos=False)
    rng = np.random.default_rng(ctx.seed + 11)
    prompt = [int(x) for x in rng.integers(3, V, C)]
    tmp = tempfile.mkdtemp(prefix="gj-bench-resume-")
    snap = os.path.join(tmp, "snap")
    try:
        sess = eng.start(prompt, gj.SamplingParams(max_new_tokens=G, **greedy))
        generated = sess.run()
        sess.snapshot(snap)
        sess.close()
        snap_bytes = sum(os.path.getsize(os.path.join(r, f)) for r, _, fs in os.walk(snap) for f in fs)
        one = gj.SamplingParams(max_new_tokens=1, **greedy)
        stats = {}

        def resume(instr):
            t0 = time.perf_counter()
            r = eng.resume(snap, instr, params=one)
            tok = next(iter(r))
            dt = time.perf_counter() - t0
            stats["resume"] = dict(r.stats)
            r.close()
            return dt, tok

        def reprefill(instr):
            t0 = time.perf_counter()
            out = eng.generate(prompt + generated + instr, one)
            dt = time.perf_counter() - t0
            stats["reprefill"] = out.stats
            return dt, out.tokens[0]

        warm = [int(x) for x in rng.integers(3, V, I)]
        resume(warm)
        reprefill(warm)  # compile every shape first
        times = {"resume": [], "reprefill": []}
        same = 0
        for r in tqdm(range(s["repeats"]), desc=f"resume_vs_reprefill @ {C}", leave=False):
            instr = [int(x) for x in rng.integers(3, V, I)]
            order = [("resume", resume), ("reprefill", reprefill)]
            if r % 2:
                order.reverse()
            toks = {}
            for tag, fn in order:
                dt, toks[tag] = fn(instr)
                times[tag].append(dt)
            same += toks["resume"] == toks["reprefill"]
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    speed = ratio_stats(times["reprefill"], times["resume"])
    recs = [{"row": "resume_vs_reprefill", "context": C, "generated": G, "instruction": I, "variant": v,
             "seconds_median": median(times[v]), "seconds_all": times[v],
             "prefill_tokens_computed": stats[v]["prefill_tokens_computed"], "repeats": s["repeats"]}
            for v in ("resume", "reprefill")]
    recs[0].update({"reprefill_over_resume_" + k: v for k, v in speed.items()},
                   snapshot_bytes=snap_bytes, same_next_token=f"{same}/{s['repeats']}")
    table = [["resume from snapshot + instruction", f"{recs[0]['seconds_median']:.3f} s",
              recs[0]["prefill_tokens_computed"]],
             ["full re-prefill", f"{recs[1]['seconds_median']:.3f} s", recs[1]["prefill_tokens_computed"]]]
    md = md_table(["path to the next token", "time (median)", "prefill_tokens_computed"], table)
    md += (f"\n\nContext {C} tokens + {G} generated + a {I}-token instruction; snapshot "
           f"{snap_bytes / 2**20:.1f} MiB on local disk (KV included). Speed-up re-prefill / resume: "
           f"{fmt_ratio(speed)} (goal >= 10x). Same next token in {same}/{s['repeats']} repeats.")
    return RowResult(records=recs, markdown=md)
