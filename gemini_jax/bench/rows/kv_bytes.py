"""Row `kv_bytes`: KV bytes each decode step reads, the bandwidth-bound floor they imply, and how
close the measured step comes to it."""

from __future__ import annotations

from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import llama
from gemini_jax.bench.rows.paged_vs_contiguous import measure_decode_steps
from gemini_jax.bench.timing import fmt_bytes, fmt_ms, md_table


def weight_bytes_per_step(cfg, itemsize: int = 4) -> int:
    """Weights a batch-1 decode step streams: every layer matrix and the LM head (the embedding
    table contributes one row, ignored; norms are negligible and not counted)."""
    return (cfg.num_params() - cfg.vocab_size * cfg.hidden_size * (0 if cfg.tie_embeddings else 1)) * itemsize


@row("kv_bytes", about=(
    "Per decode step: KV bytes read according to the engine's `kv_bytes_read` counter (divided by "
    "the steps taken; same steps as `paged_vs_contiguous`, reused when both rows run), the useful KV "
    "(the `context` positions that exist), and the bandwidth-bound floor = bytes / measured memory "
    "bandwidth (see Machine). The floor is given for KV alone and for KV + weights (a batch-1 step "
    "also streams every weight matrix once); 'bandwidth achieved' = (KV + weights bytes / measured "
    "step time) / measured bandwidth."))
def kv_bytes(ctx: Context) -> RowResult:
    recs_in = ctx.shared("decode_steps", lambda: measure_decode_steps(ctx))
    cfg = llama(ctx).ours.cfg
    bw = ctx.bandwidth["reference_gbs"] * 1e9
    w_bytes = weight_bytes_per_step(cfg)
    per_pos = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4
    recs, table = [], []
    for r in recs_in:
        kvb = r["kv_bytes_per_step"]
        useful = r["tokens_in_cache"] * per_pos
        floor_kv, floor_all = kvb / bw, (kvb + w_bytes) / bw
        step = r["step_seconds_median"]
        rec = {"row": "kv_bytes", "context": r["context"], "variant": r["variant"],
               "kv_bytes_per_step": kvb, "useful_kv_bytes": useful, "weight_bytes_per_step": w_bytes,
               "bandwidth_gbs": ctx.bandwidth["reference_gbs"], "floor_kv_seconds": floor_kv,
               "floor_kv_plus_weights_seconds": floor_all, "step_seconds_median": step,
               "bandwidth_fraction": floor_all / step}
        recs.append(rec)
        table.append([r["context"], r["variant"], fmt_bytes(kvb), f"{kvb / useful:.2f}×",
                      fmt_ms(floor_kv), fmt_ms(floor_all), fmt_ms(step), f"{100 * floor_all / step:.0f}%"])
    md = md_table(["context", "variant", "KV read / step", "read / useful KV", "floor: KV only",
                   "floor: KV + weights", "measured step", "bandwidth achieved"], table)
    md += (f"\n\nWeights streamed per step: {fmt_bytes(w_bytes)} (fp32). Bandwidth "
           f"{ctx.bandwidth['reference_gbs']:.1f} GB/s ({ctx.bandwidth['reference']}). Floors are "
           f"projections from counted bytes, not measurements.")
    return RowResult(records=recs, markdown=md)
