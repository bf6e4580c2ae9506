"""Row `dense_vs_hf`: decode tokens/s of our engine against transformers `generate`, same weights."""

from __future__ import annotations

import time

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import llama
from gemini_jax.bench.timing import fmt_ratio, interleaved, md_table, median, ratio_stats


class Stamps:
    """A `generate` streamer that only records when each put arrives. generate calls put() once
    with the prompt (before prefill), then once per new token right after it is chosen."""

    def __init__(self):
        self.times = []

    def put(self, value):
        self.times.append(time.perf_counter())

    def end(self):
        pass


def _hf_decode(hf, prompt: np.ndarray, n: int):
    """(seconds for n decode steps, tokens) of transformers greedy generate with n + 1 new tokens:
    from the first generated token's put() to the last one's (prefill excluded)."""
    import torch
    import transformers

    gc = transformers.GenerationConfig(max_new_tokens=n + 1, min_new_tokens=n + 1, do_sample=False,
                                       eos_token_id=None, pad_token_id=0, use_cache=True)
    ids = torch.from_numpy(prompt.astype(np.int64))[None]
    stamps = Stamps()
    with torch.inference_mode():
        out = hf.generate(ids, attention_mask=torch.ones_like(ids), generation_config=gc, streamer=stamps)
    new = out[0, len(prompt):].tolist()
    if len(new) != n + 1 or len(stamps.times) != n + 2:
        raise RuntimeError(f"transformers generate stopped early: {len(new)} of {n + 1} tokens "
                           f"(EOS handling?); the timing would be wrong.")
    return stamps.times[-1] - stamps.times[1], new


def _ours_decode(eng, prompt: np.ndarray, n: int):
    """(seconds for n decode steps, tokens, stats): `out.seconds['decode']` of generate with n + 1
    new tokens = sampling the first token from the prefill logits + n (decode step + sampling)."""
    out = eng.generate(prompt, gj.SamplingParams(max_new_tokens=n + 1, temperature=0.0, stop_at_eos=False))
    assert out.stats["decode_steps"] == n, out.stats
    return out.seconds["decode"], list(out.tokens), out.stats


def _agree(a: list, b: list) -> int:
    """Length of the common prefix (random-weight models have near-ties; informational)."""
    k = 0
    while k < min(len(a), len(b)) and a[k] == b[k]:
        k += 1
    return k


@row("dense_vs_hf", about=(
    "Decode throughput (tokens/s, batch 1, greedy, fp32) of our engine — contiguous cache and "
    "paged cache (block 16), `attention_impl='xla'` — against Hugging Face transformers `generate` "
    "(torch CPU, fp32, sdpa attention, DynamicCache, `do_sample=False`, EOS disabled with "
    "`eos_token_id=None` and `min_new_tokens`) on the same weights: a real-shaped Llama built with "
    "transformers, saved with `save_pretrained`, loaded into ours with `gj.load_hf`. Prefill is "
    "excluded on both sides: HF is timed with a streamer that timestamps every token put(), from the "
    "first generated token to the last (N forward steps + their greedy picks); ours by "
    "`out.seconds['decode']` of `generate` with N+1 new tokens (N decode steps + N+1 samplings). "
    "Each repeat runs all three, interleaved, on the same random prompt; headline = median of "
    "per-repeat ratios ours/HF (tokens/s)."))
def dense_vs_hf(ctx: Context) -> RowResult:
    s = ctx.pick(quick=dict(prompts=[128, 512], new_tokens=8, repeats=3),
                 full=dict(prompts=[1024, 4096], new_tokens=32, repeats=5))
    bm = llama(ctx)
    n = s["new_tokens"]
    rng = np.random.default_rng(ctx.seed)
    recs, table = [], []
    for plen in tqdm(s["prompts"], desc="dense_vs_hf: prompt lengths"):
        prompt = rng.integers(3, bm.ours.cfg.vocab_size, plen).astype(np.int32)
        engines = {
            kind: gj.Engine(bm.ours, gj.EngineConfig(
                max_seq_len=plen + n + 1, max_batch=1, attention_impl="xla",
                cache=CacheConfig(kind=kind, block_size=16, prefix_caching=False)))
            for kind in ("contiguous", "paged")}
        # Warm-up (jit compiles every prefill/decode shape; torch warms its kernels) and tokens.
        _, tok_c, stats_c = _ours_decode(engines["contiguous"], prompt, n)
        _, tok_p, stats_p = _ours_decode(engines["paged"], prompt, n)
        _, tok_h = _hf_decode(bm.hf, prompt, n)
        times = interleaved({
            "ours contiguous": lambda: _ours_decode(engines["contiguous"], prompt, n)[0],
            "ours paged": lambda: _ours_decode(engines["paged"], prompt, n)[0],
            "transformers": lambda: _hf_decode(bm.hf, prompt, n)[0],
        }, s["repeats"], desc=f"dense_vs_hf @ {plen}")
        hf_t = times["transformers"]
        for name, stats, toks in (("ours contiguous", stats_c, tok_c), ("ours paged", stats_p, tok_p),
                                  ("transformers", None, tok_h)):
            t = times[name]
            # tokens/s ratio ours/HF = per-repeat time ratio HF/ours.
            r = ratio_stats(hf_t, t)
            rec = {"row": "dense_vs_hf", "prompt_len": plen, "new_tokens": n, "variant": name,
                   "decode_seconds_median": median(t), "decode_seconds_all": t,
                   "tokens_per_s": n / median(t), **{"vs_hf_" + k: v for k, v in r.items()},
                   "tokens_agree_with_hf": _agree(toks, tok_h), "repeats": s["repeats"]}
            if stats is not None:
                rec["kv_bytes_per_step"] = stats["kv_bytes_read"] / max(stats["decode_steps"], 1)
            recs.append(rec)
            table.append([plen, name, f"{n / median(t):.1f}",
                          "1.00× (baseline)" if name == "transformers" else fmt_ratio(r),
                          f"{_agree(toks, tok_h)}/{n + 1}"])
        engines.clear()  # free both before the next length
    md = md_table(["prompt", "engine", "decode tokens/s (median)", "ours / HF (tokens/s)",
                   "greedy tokens equal to HF (prefix)"], table)
    md += (f"\n\n{n} decode steps per measurement, median of {s['repeats']} interleaved repeats; ratio "
           f"= median of per-repeat ratios (min–max). Token agreement is informational (fp32 rounding "
           f"differs between XLA and torch; random weights have near-ties).")
    return RowResult(records=recs, markdown=md)
