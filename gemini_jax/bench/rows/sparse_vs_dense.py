"""Row `sparse_vs_dense`: decode step time and bytes read, chunk-sparse engine vs dense paged engine."""

from __future__ import annotations

from tqdm import tqdm

from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import close_harnesses, llama, peak_rss_gib
from gemini_jax.bench.rows.kv_bytes import weight_bytes_per_step
from gemini_jax.bench.timing import fmt_bytes, fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats
from gemini_jax.config import SparseConfig

GOAL_CONTEXT = 131072  # the goals below are stated for this context, block_size 64, budget 2048
GOAL_SPEEDUP = 10.0  # dense / sparse step time
GOAL_BYTES = 0.04  # (KV + digest bytes) sparse / KV bytes dense


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(contexts=[2048, 8192], block_sizes=[64, 16], budgets=[2048, 1024],
                               digest="minmax", steps=3, repeats=3, warmup=2),
                    full=dict(contexts=[32768, GOAL_CONTEXT], block_sizes=[64, 16], budgets=[2048, 1024],
                              digest="minmax", steps=3, repeats=5, warmup=2))


@row("sparse_vs_dense", about=(
    "Time per decode step (batch 1) of the chunk-sparse paged engine (`SparseConfig(enabled=True, "
    "digest='minmax')`, budget 2048 and 1024 tokens, sink 1 + local 2 pages) against the dense paged "
    "engine with the same block size (64 and 16), same model and `max_seq_len`, at long contexts. As in "
    "`paged_vs_contiguous`, each cache is filled with random K/V for `context` tokens (sequence "
    "registered in the `KVCacheManager` as prefill leaves it) and the engine's own decode path "
    "(`runner.decode`) is stepped. For the sparse engine the page digests of the filled pages are then "
    "computed from those keys by the engine's own `digests.update` (layer by layer, positions "
    "[0, context), i.e. the update a prefill of the whole context makes) and placed in `Engine.digests`, "
    "spot-checked against `digests.page_digest`; so selection scores the cache that is there. Each "
    "repeat runs the dense and the sparse engine for a few consecutive steps, interleaved (at most one "
    "dense and one sparse engine alive at a time); headline = median over repeats of dense/sparse "
    f"(goal ≥ {GOAL_SPEEDUP:.0f}× at {GOAL_CONTEXT // 1024}K, block 64, budget 2048). Bytes: "
    "(`kv_bytes_read` + `digest_bytes_read`) of the sparse steps / `kv_bytes_read` of the dense steps, "
    f"from the engines' counters (goal ≤ {100 * GOAL_BYTES:.0f}% at the same point)."))
def sparse_vs_dense(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    model = llama(ctx).ours
    cfg = model.cfg
    per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4  # fp32 K+V bytes per token
    w_bytes = weight_bytes_per_step(cfg)
    per_run = s["warmup"] + s["steps"] * s["repeats"]
    records = []
    for context in tqdm(s["contexts"], desc="sparse_vs_dense: contexts"):
        for bs in s["block_sizes"]:
            dense = sparse = None
            try:
                # One dense engine serves every budget at this (context, block size): room for all its steps.
                dense = DecodeHarness(model, kind="paged", block_size=bs, context=context, seed=ctx.seed,
                                      new_tokens=per_run * len(s["budgets"]))
                for _ in range(s["warmup"]):
                    dense.step()
                for budget in s["budgets"]:
                    sp = SparseConfig(enabled=True, budget=budget, digest=s["digest"])
                    sparse = DecodeHarness(model, kind="paged", block_size=bs, context=context,
                                           seed=ctx.seed + 1, new_tokens=per_run, sparse=sp)
                    for _ in range(s["warmup"]):
                        sparse.step()
                    d0 = dict(dense.stats, steps=dense.steps)
                    s0 = dict(sparse.stats, steps=sparse.steps)
                    times = interleaved({"dense": lambda: dense.timed(s["steps"]),
                                         "sparse": lambda: sparse.timed(s["steps"])},
                                        s["repeats"], desc=f"bs={bs} budget={budget} @ {context}")
                    # Counters over the timed steps only.
                    nd, ns = dense.steps - d0["steps"], sparse.steps - s0["steps"]
                    kv_d = (dense.stats["kv_bytes_read"] - d0["kv_bytes_read"]) / nd
                    kv_s = (sparse.stats["kv_bytes_read"] - s0["kv_bytes_read"]) / ns
                    dig_s = (sparse.stats["digest_bytes_read"] - s0["digest_bytes_read"]) / ns
                    sel = (sparse.stats["pages_selected"] - s0["pages_selected"]) / ns
                    close_harnesses(sparse)
                    sparse = None
                    records.append({
                        "row": "sparse_vs_dense", "context": context, "block_size": bs, "budget": budget,
                        "digest": s["digest"], "sink_pages": sp.sink_pages, "local_pages": sp.local_pages,
                        "dense_step_seconds_median": median(times["dense"]),
                        "sparse_step_seconds_median": median(times["sparse"]),
                        "dense_step_seconds_all": times["dense"], "sparse_step_seconds_all": times["sparse"],
                        **{"speedup_" + k: v for k, v in ratio_stats(times["dense"], times["sparse"]).items()},
                        "dense_kv_bytes_per_step": kv_d, "sparse_kv_bytes_per_step": kv_s,
                        "sparse_digest_bytes_per_step": dig_s,
                        "bytes_fraction": (kv_s + dig_s) / kv_d,
                        "bytes_fraction_of_useful_kv": (kv_s + dig_s) / (context * per_pos),
                        "weight_bytes_per_step": w_bytes,
                        # Both steps bandwidth-bound (a projection from counted bytes, not a measurement).
                        "speedup_bandwidth_bound": (kv_d + w_bytes) / (kv_s + dig_s + w_bytes),
                        "pages_selected_per_layer_head": sel / (cfg.num_layers * cfg.num_kv_heads),
                        "dense_pages_read_per_layer_head": kv_d / (2 * bs * cfg.head_dim * 4
                                                                   * cfg.num_layers * cfg.num_kv_heads),
                        "peak_rss_gib": peak_rss_gib(),
                        "steps_per_repeat": s["steps"], "repeats": s["repeats"],
                    })
            finally:
                close_harnesses(dense, sparse)
                dense = sparse = None
    return RowResult(records=records, markdown=_markdown(records, s, per_pos))


def _markdown(records, s, per_pos: int) -> str:
    table = []
    for r in records:
        at_goal = r["context"] == GOAL_CONTEXT and r["block_size"] == 64 and r["budget"] == 2048
        ok_t = ("✓" if r["speedup_ratio"] >= GOAL_SPEEDUP else "✗") if at_goal else ""
        ok_b = ("✓" if r["bytes_fraction"] <= GOAL_BYTES else "✗") if at_goal else ""
        table.append([r["context"], r["block_size"], r["budget"],
                      fmt_ms(r["dense_step_seconds_median"]), fmt_ms(r["sparse_step_seconds_median"]),
                      f"{fmt_ratio(r, 'speedup_')} {ok_t}", f"{r['speedup_bandwidth_bound']:.2f}×",
                      f"{r['pages_selected_per_layer_head']:.0f} / {r['dense_pages_read_per_layer_head']:.0f}",
                      fmt_bytes(r["dense_kv_bytes_per_step"]),
                      f"{fmt_bytes(r['sparse_kv_bytes_per_step'])} + {fmt_bytes(r['sparse_digest_bytes_per_step'])}",
                      f"**{100 * r['bytes_fraction']:.1f}%** {ok_b}",
                      f"{100 * r['bytes_fraction_of_useful_kv']:.1f}%"])
    md = md_table(["context", "block", "budget", "dense step", "sparse step",
                   f"dense / sparse (goal ≥ {GOAL_SPEEDUP:.0f}×)",
                   "bandwidth-bound projection", "pages read per layer·head: sparse / dense",
                   "dense KV / step", "sparse KV + digests / step",
                   f"sparse (KV+digests) / dense KV (goal ≤ {100 * GOAL_BYTES:.0f}%)",
                   "… / useful KV"], table)
    peak = max((r["peak_rss_gib"] for r in records), default=0.0)
    md += (
        f"\n\n**Figures.** *dense step / sparse step*: median wall time of one engine decode step "
        f"(`runner.decode`: block table + the jitted whole-model step `RunContext.step` + host argmax), "
        f"dense paged vs sparse "
        f"paged at the same block size; *dense / sparse* is the median of per-repeat ratios ({s['repeats']} "
        f"repeats × {s['steps']} consecutive steps, the two engines interleaved, order rotated; min–max in "
        f"parentheses) — the speed-up of sparsity. *Bandwidth-bound projection*: the speed-up if both "
        f"steps ran at memory bandwidth, (dense KV + weights) / (sparse KV + digests + weights) bytes per "
        f"step, weights = {fmt_bytes(records[0]['weight_bytes_per_step']) if records else '-'} streamed once per "
        f"batch-1 step (as in `kv_bytes`) — a projection from counted bytes, not a measurement; the "
        f"measured ratio can exceed it where the dense step runs further below bandwidth than the "
        f"sparse one. *Pages read per layer·head*: pages the attention read "
        f"per (layer, kv head) per step, from the `pages_selected` / `kv_bytes_read` counters: sparse = "
        f"budget / block (sink and local pages included; every page while the budget covers the context), "
        f"dense = the block-table width. *Dense KV / step* and *sparse KV + digests / step*: the engines' "
        f"`kv_bytes_read` and `digest_bytes_read` counters per step (digests: {s['digest']}, "
        f"{'2 rows' if s['digest'] == 'minmax' else '1 row'} × head_dim per page per kv head, scored for "
        f"every page of the block table in every layer). The bytes fraction is sparse (KV + digests) over "
        f"dense KV; '… / useful KV' divides by the KV that exists (context × 2 × layers × kv heads × "
        f"head_dim × 4 B) instead, so block-table padding does not flatter it. Goals are checked only at "
        f"{GOAL_CONTEXT // 1024}K, block 64, budget 2048 (✓/✗); at contexts where the budget covers the "
        f"context the sparse engine selects every page and there is nothing to gain.\n\n"
        f"Digests: the pool is filled with random K/V (prefilling these contexts on a CPU would take far "
        f"longer than the steps), so the sparse engine's digests are computed afterwards from the filled "
        f"keys with the engine's own `digests.update` (per layer, positions [0, context) — what a prefill "
        f"of the whole context leaves) and spot-checked against `digests.page_digest`; later decode steps "
        f"keep them current themselves. Random keys make the minmax scores of all pages alike, which "
        f"changes which pages win but not the work (top-k over every page, a fixed number of pages "
        f"gathered). Memory: at most one dense and one sparse engine are alive at a time (each a pool of "
        f"{fmt_bytes(per_pos)} per token of context; freed with del + gc after use); peak RSS of "
        f"the whole bench process after this row: {peak:.2f} GiB.")
    return md
