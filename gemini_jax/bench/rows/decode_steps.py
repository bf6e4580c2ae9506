"""Rows `decode_steps_vs_hf` and `decode_bandwidth`: decode with k tokens per device program
(`engine.decode_steps_per_call`) against transformers `generate`, and as a fraction of the
memory-bandwidth bound."""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig
from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import close_harnesses, llama, llama_weights
from gemini_jax.bench.rows.dense_vs_hf import Stamps
from gemini_jax.bench.timing import fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats

KS = (1, 4, 8, 16)
SPEED_GOAL = 2.0  # batch-1 decode at 2K: ours / transformers tokens/s
BANDWIDTH_GOAL = 0.60  # fraction of the bandwidth bound at 16K


def _hf_decode(hf, prompts: np.ndarray, n: int) -> float:
    """Seconds of n decode steps of transformers greedy `generate` (n + 1 new tokens) on a batch
    of equal-length prompts, from the first token's put() to the last one's."""
    import torch
    import transformers

    gc = transformers.GenerationConfig(max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False,
                                       eos_token_id=None, pad_token_id=0, use_cache=True)
    ids = torch.from_numpy(prompts.astype(np.int64))
    stamps = Stamps()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, streamer=stamps)
    if out.shape[1] - prompts.shape[1] != n + 1 or len(stamps.times) != n + 2:
        raise RuntimeError("transformers generate stopped early; the timing would be wrong.")
    return stamps.times[-1] - stamps.times[1]


def _ours_decode(eng, prompts: np.ndarray, n: int) -> float:
    out = eng.generate(list(prompts), gj.SamplingParams(max_new_tokens=n + 1, temperature=0.0, stop_at_eos=False))
    assert out.stats["decode_steps"] == n, out.stats
    return out.seconds["decode"]


@row("decode_steps_vs_hf", about=(
    "Decode tokens/s (greedy, fp32, paged cache, block 16, `attention_impl='xla'`) with k = 1 / 4 / 8 / 16 "
    "tokens per device program (`engine.decode_steps_per_call`) against transformers `generate` (torch "
    "CPU, sdpa, DynamicCache, EOS off) on the same weights and the same random prompts; batch 1 and 8. "
    "Prefill excluded on both sides (ours: `out.seconds['decode']` of `generate` with N+1 new tokens; "
    "HF: streamer timestamps from the first generated token to the last). Goal: batch 1 at 2K ≥ 2× HF."))
def decode_steps_vs_hf(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(cases=[(128, 1), (256, 2)], new_tokens=16, repeats=3),
                 full=dict(cases=[(1024, 1), (2048, 1), (4096, 1), (1024, 8)], new_tokens=48, repeats=5))
    bm = llama(ctx)
    n = s["new_tokens"]
    rng = np.random.default_rng(ctx.seed)
    recs, table = [], []
    for plen, B in tqdm(s["cases"], desc="decode_steps_vs_hf"):
        prompts = rng.integers(3, bm.ours.cfg.vocab_size, (B, plen)).astype(np.int32)
        engines = {k: gj.Engine(bm.ours, gj.EngineConfig(
            max_seq_len=plen + n + 1, max_batch=B, decode_steps_per_call=k, attention_impl="xla",
            cache=CacheConfig(kind="paged", block_size=16, prefix_caching=False))) for k in KS}
        for eng in engines.values():  # compile every shape
            _ours_decode(eng, prompts, n)
        _hf_decode(bm.hf, prompts, n)
        variants = {f"ours k={k}": (lambda e=e: _ours_decode(e, prompts, n)) for k, e in engines.items()}
        variants["transformers"] = lambda: _hf_decode(bm.hf, prompts, n)
        times = interleaved(variants, s["repeats"], desc=f"decode @ {plen} x {B}")
        hf_t = times["transformers"]
        for name, t in times.items():
            r = ratio_stats(hf_t, t)  # tokens/s ours / HF = time HF / ours, per repeat
            rec = {"row": "decode_steps_vs_hf", "prompt_len": plen, "batch": B, "new_tokens": n, "variant": name,
                   "decode_seconds_all": t, "decode_seconds_median": median(t),
                   "tokens_per_s": B * n / median(t), **{"vs_hf_" + k: v for k, v in r.items()},
                   "repeats": s["repeats"]}
            goal = (plen == 2048 and B == 1 and name != "transformers")
            if goal:
                rec["goal"] = SPEED_GOAL
                rec["goal_met"] = r["ratio"] >= SPEED_GOAL
            recs.append(rec)
            mark = ("✓" if r["ratio"] >= SPEED_GOAL else "✗") if goal else ""
            table.append([plen, B, name, f"{B * n / median(t):.1f}",
                          "1.00× (baseline)" if name == "transformers" else f"{fmt_ratio(r)} {mark}".strip()])
        engines.clear()
    md = md_table(["prompt", "batch", "engine", "decode tokens/s (median)", "ours / HF (tokens/s)"], table)
    md += (f"\n\n{n} decode steps per measurement (× batch tokens), median of {s['repeats']} interleaved repeats; "
           f"ratio = median of per-repeat ratios (min–max). Goal (✓/✗ on the 2K batch-1 rows): ≥ {SPEED_GOAL:.0f}× "
           f"transformers.")
    return RowResult(records=recs, markdown=md)


def weight_bytes_per_step(model, batch: int) -> int:
    """Bytes of weights one decode step reads: every weight once, except the embedding table, of
    which only the batch's rows are read (unless it is tied to the output projection)."""
    import jax

    from flax import nnx

    _, state = nnx.split(model)
    total = sum(x.size * x.dtype.itemsize for x in jax.tree.leaves(state))
    cfg = model.cfg
    if cfg.tie_embeddings:
        return total
    itemsize = jax.tree.leaves(state)[0].dtype.itemsize
    return total - cfg.vocab_size * cfg.hidden_size * itemsize + batch * cfg.hidden_size * itemsize


@row("decode_bandwidth", about=(
    "Achieved fraction of the memory-bandwidth bound of a decode step: (weights read per step + KV "
    "bytes read per step, from the engine's `kv_bytes_read` counter) / step time / the machine's measured "
    "bandwidth (see Machine), for k = 1 / 4 / 8 / 16 tokens per program, batch 1 and 8, paged cache (block 16) "
    "filled with random K/V (the decode harness; no prefill), greedy on device. Goal: ≥ 60% at 16K."))
def decode_bandwidth(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(contexts=[256, 1024], batches=[1, 2], steps=16, repeats=3),
                 full=dict(contexts=[1024, 4096, 16384], batches=[1, 8], steps=32, repeats=5))
    model = llama_weights(ctx).ours
    bw = ctx.bandwidth["reference_gbs"] * 1e9
    recs, table = [], []
    for context in tqdm(s["contexts"], desc="decode_bandwidth: contexts"):
        for B in s["batches"]:
            new = max(s["steps"], max(KS))
            hs = {k: DecodeHarness(model, kind="paged", context=context, new_tokens=new, batch=B, steps_per_call=k,
                                   seed=ctx.seed + k) for k in KS}
            try:
                for h in hs.values():  # compile every width the timed runs reach (each rewinds first)
                    h.timed(s["steps"])
                times = interleaved({k: (lambda h=h: h.timed(s["steps"])) for k, h in hs.items()}, s["repeats"],
                                    desc=f"decode steps @ {context} x {B}")
                wbytes = weight_bytes_per_step(model, B)
                for k, h in hs.items():
                    step_s = median(times[k])
                    kv = h.kv_bytes_per_step
                    frac = (wbytes + kv) / step_s / bw
                    r = ratio_stats(times[1], times[k])
                    goal = context == 16384
                    rec = {"row": "decode_bandwidth", "context": context, "batch": B, "k": k,
                           "step_seconds_all": times[k], "step_seconds_median": step_s,
                           "weight_bytes_per_step": wbytes, "kv_bytes_per_step": kv,
                           "bandwidth_gbs": bw / 1e9, "fraction_of_bound": frac,
                           **{"speedup_vs_k1_" + x: v for x, v in r.items()}, "repeats": s["repeats"]}
                    if goal:
                        rec["goal"], rec["goal_met"] = BANDWIDTH_GOAL, frac >= BANDWIDTH_GOAL
                    recs.append(rec)
                    mark = (" ✓" if frac >= BANDWIDTH_GOAL else " ✗") if goal else ""
                    table.append([context, B, k, fmt_ms(step_s), f"{B / step_s:.1f}",
                                  f"{(wbytes + kv) / 2**20:.0f} MiB", f"**{frac:.0%}**{mark}",
                                  "1.00×" if k == 1 else fmt_ratio(r)])
            finally:
                close_harnesses(*hs.values())
    md = md_table(["context", "batch", "k", "time per step (median)", "tokens/s", "bytes per step",
                   "of bandwidth bound", "speed vs k=1"], table)
    md += (f"\n\nBound = bytes per step / {bw / 1e9:.1f} GB/s (measured, see Machine); {s['steps']} steps per "
           f"measurement, median of {s['repeats']} interleaved repeats. Goal (✓/✗ on the 16K rows): ≥ "
           f"{BANDWIDTH_GOAL:.0%} of the bound.")
    return RowResult(records=recs, markdown=md)


SMOLLM2 = "smollm2-135m-instruct"
SMOLLM2_GOAL = 0.70  # batch-1 decode at 2K and 8K: fraction of the bandwidth bound (the better k)


def _smollm2(ctx: Context):
    """(ours, transformers) on the same GGUF file, float32: the pretrained model both sides load."""
    import os

    import torch
    import transformers

    path = gj.pretrained_path(SMOLLM2)
    ours, _ = gj.load_pretrained(SMOLLM2, dtype="float32")
    hf = transformers.AutoModelForCausalLM.from_pretrained(os.path.dirname(path), gguf_file=os.path.basename(path),
                                                           dtype=torch.float32).eval()
    hf.generation_config.eos_token_id = None
    return ours, hf


@row("smollm2_decode", about=(
    "SmolLM2-135M-Instruct (the pretrained GGUF, dequantized to fp32 by both sides), batch-1 greedy decode "
    "tokens/s with k = 1 / 16 tokens per device program against transformers `generate` (torch CPU, sdpa, "
    "loaded from the same file with `gguf_file=`), on the same random prompts, prefill excluded as in "
    "`decode_steps_vs_hf`; and each side's fraction of the bandwidth bound: (weights + the KV a dense step "
    "reads, from our `kv_bytes_read` counter, the same bytes charged to transformers) / step time / the "
    "machine's measured bandwidth. Goal: ours ≥ 70% of the bound at 2K and 8K."))
def smollm2_decode(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(contexts=[128], new_tokens=8, repeats=2, ks=(1, 4)),
                 full=dict(contexts=[2048, 8000], new_tokens=32, repeats=3, ks=(1, 16)))
    ours, hf = ctx.shared("smollm2", lambda: _smollm2(ctx))
    n = s["new_tokens"]
    bw = ctx.bandwidth["reference_gbs"] * 1e9
    wbytes = weight_bytes_per_step(ours, 1)
    rng = np.random.default_rng(ctx.seed)
    recs, table = [], []
    for plen in tqdm(s["contexts"], desc="smollm2_decode"):
        prompts = rng.integers(3, ours.cfg.vocab_size, (1, plen)).astype(np.int32)
        engines = {k: gj.Engine(ours, gj.EngineConfig(
            max_seq_len=plen + n + 1, max_batch=1, decode_steps_per_call=k, attention_impl="xla",
            cache=CacheConfig(kind="paged", block_size=16, prefix_caching=False))) for k in s["ks"]}
        kv = {}
        for k, eng in engines.items():  # compile every shape; count the KV bytes a step reads
            out = eng.generate(list(prompts), gj.SamplingParams(max_new_tokens=n + 1, temperature=0.0,
                                                                stop_at_eos=False))
            kv[k] = out.stats["kv_bytes_read"] / out.stats["decode_steps"]
        _hf_decode(hf, prompts, n)
        variants = {f"ours k={k}": (lambda e=e: _ours_decode(e, prompts, n)) for k, e in engines.items()}
        variants["transformers"] = lambda: _hf_decode(hf, prompts, n)
        times = interleaved(variants, s["repeats"], desc=f"smollm2 decode @ {plen}")
        kv_step = max(kv.values())  # the same dense KV whatever k; charged to transformers as well
        for name, t in times.items():
            step_s = median(t) / n
            frac = (wbytes + kv_step) / step_s / bw
            r = ratio_stats(times["transformers"], t)
            goal = name != "transformers" and plen in (2048, 8000)
            rec = {"row": "smollm2_decode", "model": SMOLLM2, "prompt_len": plen, "batch": 1, "new_tokens": n,
                   "variant": name, "decode_seconds_all": t, "step_seconds_median": step_s,
                   "tokens_per_s": 1 / step_s, "weight_bytes_per_step": wbytes, "kv_bytes_per_step": kv_step,
                   "bandwidth_gbs": bw / 1e9, "fraction_of_bound": frac,
                   **{"vs_hf_" + x: v for x, v in r.items()}, "repeats": s["repeats"]}
            mark = ""
            if goal:
                rec["goal"], rec["goal_met"] = SMOLLM2_GOAL, frac >= SMOLLM2_GOAL
                mark = " ✓" if frac >= SMOLLM2_GOAL else " ✗"
            recs.append(rec)
            table.append([plen, name, f"{1 / step_s:.1f}", fmt_ms(step_s),
                          f"{(wbytes + kv_step) / 2**20:.0f} MiB", f"**{frac:.0%}**{mark}",
                          "1.00× (baseline)" if name == "transformers" else fmt_ratio(r)])
        engines.clear()
    md = md_table(["prompt", "engine", "decode tokens/s (median)", "time per token", "bytes per step",
                   "of bandwidth bound", "ours / HF (tokens/s)"], table)
    md += (f"\n\n{n} decode steps per measurement, median of {s['repeats']} interleaved repeats; ratio = median of "
           f"per-repeat ratios (min–max). Bound = bytes per step / {bw / 1e9:.1f} GB/s (measured in this run, see "
           f"Machine). Goal (✓/✗ on our 2K and 8K rows): ≥ {SMOLLM2_GOAL:.0%} of the bound.")
    return RowResult(records=recs, markdown=md)
