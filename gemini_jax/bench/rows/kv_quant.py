"""Row `kv_quant`: decode step time and bytes, int8 / float8 KV against float32 KV, dense and sparse."""

from __future__ import annotations

import numpy as np
from tqdm import tqdm

import gemini_jax as gj

from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import close_harnesses, llama_weights
from gemini_jax.bench.timing import fmt_bytes, fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats
from gemini_jax.config import SparseConfig, TierConfig

QUANT = ("int8", "float8_e4m3fn")
GOAL_BYTES = 0.27  # quantized / float32 bytes, scales included


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(context=2048, steps=3, repeats=3, warmup=2, budget=512, tier_context=1024),
                    full=dict(context=32768, steps=4, repeats=7, warmup=2, budget=2048, tier_context=4096))


TIER_TOKENS = 16  # tokens generated over the tiers


def _tier_bytes(model, dt, s, seed: int) -> dict:
    """One request over tiers (a quarter of the pages on device, the rest in host RAM; sparse,
    budget s["budget"] // 4): the (layer, page) units written below and fetched back, and the
    bytes one unit takes there (packed with its scales when quantized)."""
    cfg = gj.EngineConfig(max_seq_len=s["tier_context"] + TIER_TOKENS, max_batch=1, prefill_chunk=128,
                          cache=gj.config.CacheConfig(block_size=16, prefix_caching=False, dtype=dt),
                          sparse=SparseConfig(enabled=True, budget=s["budget"] // 4, digest="minmax"),
                          tier=TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=2))
    prompt = np.random.default_rng(seed).integers(0, model.cfg.vocab_size, s["tier_context"]).tolist()
    with gj.Engine(model, cfg) as eng:
        out = eng.generate(prompt, gj.SamplingParams(max_new_tokens=TIER_TOKENS, temperature=0.0, stop_at_eos=False))
        ts = eng.tier_stats()
        page = ts["page_bytes"]
    up = out.stats["pages_fetched_host"] + out.stats["pages_fetched_disk"]
    return {"pages_down": ts["host_pages"], "pages_up": up, "page_bytes": page,
            "bytes_moved": (ts["host_pages"] + up) * page}


@row("kv_quant", about=(
    "Decode step (batch 1) of the paged engine with `cache.dtype` int8 and float8_e4m3fn against "
    "float32 KV, at 32K context, dense and chunk-sparse (minmax digests, budget 2048, block 16): the "
    "three engines hold the same random K/V (drawn in float32, quantized by the engine as it stores "
    "them), are stepped through `runner.decode` interleaved (order rotated), and each headline is the "
    "median of per-repeat ratios quantized / float32 step time. Bytes: the engines' `kv_bytes_read` "
    "counter per step, and the sequence's KV payload as a snapshot stores it (`engine.sequences.image`: K, V and "
    f"their scales), quantized / float32 (goal ≤ {GOAL_BYTES}× for both); with sparse attention the snapshot "
    "also holds the page digests, kept in float32 for every dtype, shown beside it. Tiers: one request "
    f"(a 4K random prompt, {TIER_TOKENS} tokens, sparse, a quarter of the pages on device, the rest in host "
    "RAM) per dtype; the bytes the tiers moved (pages written below + pages fetched back, times the bytes a "
    "page takes there, scales included), quantized / float32 (goal ≤ 0.27×)."))
def kv_quant(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    model = llama_weights(ctx).ours
    per_run = s["warmup"] + s["steps"] * s["repeats"]
    records = []
    for mode in tqdm(("dense", "sparse"), desc="kv_quant"):
        sparse = SparseConfig(enabled=True, budget=s["budget"], digest="minmax") if mode == "sparse" else None
        hs = {}
        try:
            for dt in (None, *QUANT):
                hs[dt or "float32"] = DecodeHarness(model, kind="paged", context=s["context"], seed=ctx.seed,
                                                    new_tokens=per_run, sparse=sparse, cache_dtype=dt)
            payload = {}
            for name, h in hs.items():
                for _ in range(s["warmup"]):
                    h.step()
                image = h.eng.sequences.image(h.runner.ids[0])
                payload[name] = (image.k.nbytes + image.v.nbytes, image.nbytes)  # KV + scales; + digests
            before = {n: (h.stats["kv_bytes_read"], h.steps) for n, h in hs.items()}
            times = interleaved({n: (lambda h=h: h.timed(s["steps"])) for n, h in hs.items()}, s["repeats"],
                                desc=f"kv_quant {mode} @ {s['context']}")
            per_step = {n: (h.stats["kv_bytes_read"] - before[n][0]) / (h.steps - before[n][1]) for n, h in hs.items()}
            for dt in QUANT:
                records.append({
                    "row": "kv_quant", "mode": mode, "dtype": dt, "context": s["context"],
                    "budget": s["budget"] if sparse else None,
                    "float32_step_seconds_median": median(times["float32"]),
                    "quant_step_seconds_median": median(times[dt]),
                    "float32_step_seconds_all": times["float32"], "quant_step_seconds_all": times[dt],
                    **{"time_" + k: v for k, v in ratio_stats(times[dt], times["float32"]).items()},
                    "float32_kv_bytes_per_step": per_step["float32"], "quant_kv_bytes_per_step": per_step[dt],
                    "kv_bytes_ratio": per_step[dt] / per_step["float32"],
                    "float32_snapshot_kv_bytes": payload["float32"][0], "quant_snapshot_kv_bytes": payload[dt][0],
                    "snapshot_kv_ratio": payload[dt][0] / payload["float32"][0],
                    "snapshot_payload_ratio": payload[dt][1] / payload["float32"][1],
                    "steps_per_repeat": s["steps"], "repeats": s["repeats"],
                })
        finally:
            close_harnesses(*hs.values())
    tiers = {dt or "float32": _tier_bytes(model, dt, s, ctx.seed) for dt in tqdm((None, *QUANT), desc="kv_quant tiers")}
    for dt in QUANT:
        records.append({"row": "kv_quant", "mode": "tiers", "dtype": dt, "context": s["tier_context"],
                        "float32": tiers["float32"], "quant": tiers[dt],
                        "tier_bytes_ratio": tiers[dt]["bytes_moved"] / tiers["float32"]["bytes_moved"]})
    return RowResult(records=records, markdown=markdown(records))


def markdown(records) -> str:
    def mark(x):
        return "✓" if x <= GOAL_BYTES else "✗"

    steps, tiers = [r for r in records if r["mode"] != "tiers"], [r for r in records if r["mode"] == "tiers"]
    table = [[r["mode"], r["dtype"], r["context"], fmt_ms(r["float32_step_seconds_median"]),
              fmt_ms(r["quant_step_seconds_median"]), fmt_ratio(r, "time_"),
              f"{fmt_bytes(r['quant_kv_bytes_per_step'])} / {fmt_bytes(r['float32_kv_bytes_per_step'])} = "
              f"{r['kv_bytes_ratio']:.3f}× {mark(r['kv_bytes_ratio'])}",
              f"{r['snapshot_kv_ratio']:.3f}× {mark(r['snapshot_kv_ratio'])}",
              f"{r['snapshot_payload_ratio']:.3f}×"] for r in steps]
    return md_table(["attention", "KV dtype", "context", "float32 step", "quantized step",
                     "step time quantized / float32 (min–max)", "KV bytes read per step (goal ≤ 0.27×)",
                     "snapshot KV + scales (goal ≤ 0.27×)", "… + float32 digests"], table) + (
        "\n\nStep times are medians over interleaved repeats; the ratio is the median of per-repeat ratios. "
        "On this CPU a quantized read converts each page back to float32 before the products, so fewer "
        "bytes need not mean a faster step.") + ("\n\n" + md_table(
        ["tiers", "KV dtype", "prompt", "pages down / up (float32)", "pages down / up (quantized)",
         "bytes a page takes below", "bytes moved quantized / float32 (goal ≤ 0.27×)"],
        [["sparse, 25% on device", r["dtype"], r["context"], f"{r['float32']['pages_down']} / {r['float32']['pages_up']}",
          f"{r['quant']['pages_down']} / {r['quant']['pages_up']}",
          f"{fmt_bytes(r['quant']['page_bytes'])} vs {fmt_bytes(r['float32']['page_bytes'])}",
          f"**{r['tier_bytes_ratio']:.3f}×** {mark(r['tier_bytes_ratio'])}"] for r in tiers]) if tiers else "")
