"""Row `sparse_select_share`: the share of a sparse decode step spent scoring pages and picking the top-k."""

from __future__ import annotations

import time

import jax
import jax.numpy as jnp
from tqdm import tqdm

from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import close_harnesses, llama, peak_rss_gib
from gemini_jax.bench.timing import fmt_ms, interleaved, md_table, median, ratio_stats
from gemini_jax.attention.select import page_scores, select_pages
from gemini_jax.config import SparseConfig
from gemini_jax.cache.shapes import table_width

GOAL = 0.25  # selection (scores + top-k) should take at most this share of a sparse step


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(contexts=[2048, 8192], block_sizes=[64, 16], budget=2048, digest="minmax",
                               steps=3, repeats=3, warmup=2),
                    full=dict(contexts=[32768, 131072], block_sizes=[64, 16], budget=2048, digest="minmax",
                              steps=3, repeats=5, warmup=2))


def selection_only(model_cfg, sp: SparseConfig, block_size: int):
    """A jitted function doing only the selection work of a sparse decode step, for every layer.

    (digests [L, K, P, R, D], block_tables i32[B, W], q [L, B, 1, H, D], q_pos i32[B, 1])
    -> selected i32[L, B, K, k]. Per layer, exactly what `paged_backend`'s `sparse_step` does
    before attending: gather the block table's digests, `page_scores`, `select_pages` (same k,
    sink, local and window arguments), the layers under a `lax.scan` with the digests indexed by
    the layer, as the decoder's layer scan does.
    """
    windows = jnp.asarray(model_cfg.layer_windows, jnp.int32)
    k = sp.budget // block_size

    @jax.jit
    def fn(digests, block_tables, q, q_pos):
        def layer(carry, xs):
            idx, q_l, window = xs
            dig = digests[idx][:, block_tables]  # [K, B, W, R, D]
            scores = page_scores(sp.digest, q_l, jnp.swapaxes(dig, 0, 1), sp.group_reduce)
            sel = select_pages(scores, q_pos[:, 0], q_pos[:, -1], block_size=block_size, k=k,
                               sink_pages=sp.sink_pages, local_pages=sp.local_pages, window=window)
            return carry, sel

        _, sel = jax.lax.scan(layer, 0, (jnp.arange(model_cfg.num_layers), q, windows))
        return sel

    return fn


@row("sparse_select_share", about=(
    "Share of a sparse decode step spent in page scoring + top-k selection. Side by side and "
    "interleaved: (a) the sparse engine's full decode step (`runner.decode` as in `sparse_vs_dense`: "
    "block table, the jitted whole-model step `RunContext.step` — digest update, scoring, selection, "
    "sparse attention, "
    "MLPs, LM head — and the host argmax), cache filled with random K/V and digests computed from it; "
    "(b) one jitted function doing only the selection work for all layers on the same shapes and "
    "the same arrays (the engine's digests, its block table at the step's width, random queries "
    "[layers, 1, 1, heads, head_dim]): per layer, gather the table's digests, `page_scores`, "
    f"`select_pages`, layers under `lax.scan`. Headline = median over repeats of b/a (goal ≤ {GOAL:.0%})."))
def sparse_select_share(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    model = llama(ctx).ours
    cfg = model.cfg
    sp = SparseConfig(enabled=True, budget=s["budget"], digest=s["digest"])
    records = []
    for context in tqdm(s["contexts"], desc="sparse_select_share: contexts"):
        for bs in s["block_sizes"]:
            h = None
            try:
                h = DecodeHarness(model, kind="paged", block_size=bs, context=context, seed=ctx.seed + 2,
                                  new_tokens=s["warmup"] + s["steps"] * s["repeats"], sparse=sp)
                eng, sid = h.eng, h.runner.ids[0]
                # The block table as the next step sees it (one more token reserved), at the step's width.
                pages = max(eng.sequences.num_pages(sid), -(-(context + 1) // bs))
                width = table_width(pages, eng.config.pages_per_seq)
                bt = jnp.asarray(eng.sequences.block_tables([sid], width))
                q = jax.random.normal(jax.random.key(ctx.seed + 3),
                                      (cfg.num_layers, 1, 1, cfg.num_heads, cfg.head_dim), jnp.float32)
                q_pos = jnp.asarray([[context]], jnp.int32)
                fn = selection_only(cfg, sp, bs)

                def select_timed(n):
                    t0 = time.perf_counter()
                    for _ in range(n):
                        # The store's digests are read at call time: the step replaces them (donation).
                        jax.block_until_ready(fn(eng.sequences.device_digests, bt, q, q_pos))
                    return (time.perf_counter() - t0) / n

                for _ in range(s["warmup"]):  # compile + warm both
                    h.step()
                    select_timed(1)
                times = interleaved({"step": lambda: h.timed(s["steps"]),
                                     "select": lambda: select_timed(s["steps"])},
                                    s["repeats"], desc=f"bs={bs} @ {context}")
                records.append({
                    "row": "sparse_select_share", "context": context, "block_size": bs,
                    "budget": s["budget"], "digest": s["digest"], "table_width": width,
                    "top_k": s["budget"] // bs,
                    "step_seconds_median": median(times["step"]),
                    "select_seconds_median": median(times["select"]),
                    "step_seconds_all": times["step"], "select_seconds_all": times["select"],
                    **{"share_" + k: v for k, v in ratio_stats(times["select"], times["step"]).items()},
                    "peak_rss_gib": peak_rss_gib(), "steps_per_repeat": s["steps"], "repeats": s["repeats"],
                })
            finally:
                close_harnesses(h)
                h = None
    table = []
    for r in records:
        ok = "✓" if r["share_ratio"] <= GOAL else "✗"
        table.append([r["context"], r["block_size"], r["table_width"], r["top_k"],
                      fmt_ms(r["step_seconds_median"]), fmt_ms(r["select_seconds_median"]),
                      f"**{100 * r['share_ratio']:.1f}%** ({100 * r['share_ratio_min']:.1f}–"
                      f"{100 * r['share_ratio_max']:.1f}%) {ok}"])
    md = md_table(["context", "block", "pages scored (table width)", "pages kept (k)",
                   "(a) sparse step", "(b) selection only", f"share b / a (goal ≤ {GOAL:.0%})"], table)
    md += (
        f"\n\n**Figures.** *Pages scored*: the block-table width of the step — every page of the "
        f"sequence is scored from its digest in every layer and kv head, so the selection work grows "
        f"linearly with context / block size; *pages kept*: the top-k = budget / block (sink and local "
        f"pages included). *(a)* and *(b)*: median seconds per call; *share b / a*: the fraction of a "
        f"sparse decode step that scoring + top-k costs (the rest: the QKV/O projections, MLPs and LM head, which stream the weights, "
        f"the sparse attention over the kept pages, digest upkeep, host work).\n\n"
        f"**Method.** (a) is the sparse engine's real decode step (`runner.decode`, budget "
        f"{s['budget']}, {s['digest']} digests, every layer sparse), as timed in `sparse_vs_dense`. (b) "
        f"re-does only the selection part of that step in a separate jitted function on the same arrays: "
        f"for each of the {cfg.num_layers} layers (a `lax.scan`, digests indexed by layer as in the "
        f"decoder's scan) gather the digests of the block table's pages, score them against the query "
        f"(`page_scores`: two matmuls for minmax, max over the GQA group) and take the top-k with sink and "
        f"local pages forced (`select_pages`). It returns the selected ids so nothing is optimised away. "
        f"Each repeat runs (a) and (b) {s['steps']} times each, interleaved, order rotated; share = median "
        f"over {s['repeats']} repeats of the per-repeat ratio b/a (min–max in parentheses). Not in (b): the "
        f"per-step digest update of the written page (`digests.update`) and the sparse attention itself. "
        f"(b) compiled on its own can fuse differently from the same ops inside the full step, and (b) "
        f"pays its own dispatch and sync (~tens of µs), so the share is an estimate of the selection's "
        f"cost, not a profile of the step.")
    return RowResult(records=records, markdown=md)
