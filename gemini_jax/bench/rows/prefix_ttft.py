"""Row `prefix_ttft`: time to first token with a cached shared prefix vs a cold prompt."""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import llama
from gemini_jax.bench.timing import fmt_ratio, md_table, median, ratio_stats


@row("prefix_ttft", about=(
    "Time to first token (wall time of `generate(prompt, max_new_tokens=1)`: prefill + first "
    "sampling) of the paged engine (block 16, prefix caching on) for a prompt = long prefix + short "
    "suffix, when a previous request already shared that prefix (its pages are cached: 'warm') vs "
    "when it did not ('cold'). Each repeat draws a fresh random prefix, sends the cold request "
    "(prefix + suffix A), then the warm one (prefix + suffix B), and also the cold prompt to the "
    "contiguous engine (no reuse possible) as a reference; the prefill counters "
    "(`prefill_tokens_reused` / `prefill_tokens_computed`) come from each request's `out.stats`. "
    "Headline = median of per-repeat cold/warm ratios (speed-up)."))
def prefix_ttft(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(prefix=1024, suffix=32, repeats=3),
                 full=dict(prefix=8192, suffix=64, repeats=5))
    model = llama(ctx).ours
    V = model.cfg.vocab_size
    P, S = s["prefix"], s["suffix"]
    ecfg = dict(max_seq_len=P + S + 1, max_batch=2, attention_impl="xla")
    paged = gj.Engine(model, gj.EngineConfig(**ecfg, cache=CacheConfig(kind="paged", block_size=16,
                                                                        prefix_caching=True)))
    contig = gj.Engine(model, gj.EngineConfig(**ecfg, cache=CacheConfig(kind="contiguous")))
    params = gj.SamplingParams(max_new_tokens=1, temperature=0.0, stop_at_eos=False)
    rng = np.random.default_rng(ctx.seed + 7)
    last = {}

    def request(eng, prompt, tag):
        t0 = time.perf_counter()
        out = eng.generate(prompt, params)
        dt = time.perf_counter() - t0
        last[tag] = out.stats
        return dt

    def new_pair():
        prefix = rng.integers(3, V, P).astype(np.int32)
        return (np.concatenate([prefix, rng.integers(3, V, S).astype(np.int32)]),
                np.concatenate([prefix, rng.integers(3, V, S).astype(np.int32)]))

    # Warm-up: compile every prefill shape (cold chunks, the warm suffix chunk) on throwaway prompts.
    a, b = new_pair()
    request(paged, a, "cold")
    request(paged, b, "warm")
    request(contig, a, "contig")
    times = {"cold": [], "warm": [], "contig": []}
    for r in tqdm(range(s["repeats"]), desc=f"prefix_ttft @ {P}", leave=False):
        a, b = new_pair()  # a fresh prefix: nothing of it is cached yet
        # Cold must precede warm (warm reuses cold's pages); the contiguous reference alternates
        # between first and last so background load is spread over all three.
        order = [("contig", contig, a)] * (r % 2 == 0) + [("cold", paged, a), ("warm", paged, b)] \
            + [("contig", contig, a)] * (r % 2 == 1)
        for tag, eng, prompt in order:
            times[tag].append(request(eng, prompt, tag))
    speed = ratio_stats(times["cold"], times["warm"])
    vs_contig = ratio_stats(times["cold"], times["contig"])
    recs = []
    for name, tag in (("paged cold", "cold"), ("paged warm (prefix cached)", "warm"),
                      ("contiguous cold", "contig")):
        t = times[tag]
        st = last[tag]
        recs.append({"row": "prefix_ttft", "prefix": P, "suffix": S, "variant": name,
                     "ttft_seconds_median": median(t), "ttft_seconds_all": t,
                     "prefill_tokens_reused": st["prefill_tokens_reused"],
                     "prefill_tokens_computed": st["prefill_tokens_computed"], "repeats": s["repeats"]})
    recs[0].update({"cold_over_warm_" + k: v for k, v in speed.items()})
    recs[0].update({"paged_over_contiguous_cold_" + k: v for k, v in vs_contig.items()})
    table = [[r["variant"], f"{r['ttft_seconds_median']:.3f} s", r["prefill_tokens_reused"],
              r["prefill_tokens_computed"]] for r in recs]
    md = md_table(["request", "TTFT (median)", "prefill_tokens_reused", "prefill_tokens_computed"], table)
    md += (f"\n\nPrompt = {P}-token prefix + {S}-token suffix, engine `prefill_chunk` "
           f"{paged.config.prefill_chunk}. Speed-up from the cached prefix (cold / warm): "
           f"{fmt_ratio(speed)}. Cold prefill paged / contiguous: {fmt_ratio(vs_contig)}. "
           f"Median of {s['repeats']} repeats (per-repeat ratios, min–max).")
    return RowResult(records=recs, markdown=md)
