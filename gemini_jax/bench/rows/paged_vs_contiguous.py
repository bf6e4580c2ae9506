"""Row `paged_vs_contiguous`: time per decode step, paged pool vs contiguous buffer, at long contexts."""

from __future__ import annotations

from tqdm import tqdm

from gemini_jax.bench.decode import DecodeHarness
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import llama
from gemini_jax.bench.timing import fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats

GOAL = 1.15  # paged should stay within this factor of contiguous


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(contexts=[512, 2048], block_sizes=[16, 64], steps=4, repeats=3, warmup=2),
                    full=dict(contexts=[4096, 16384, 65536], block_sizes=[16, 64], steps=8, repeats=7,
                              warmup=3))


def measure_decode_steps(ctx: Context) -> list[dict]:
    """Per-step seconds of contiguous and paged (each block size) at each context, side by side.

    Shared with the `kv_bytes` row through `ctx.shared`.
    """
    s = _sizes(ctx)
    model = llama(ctx).ours
    cfg = model.cfg
    # Every step appends one token: leave room for all of them, and no more.
    new_tokens = s["warmup"] + s["steps"] * s["repeats"]
    records = []
    for context in tqdm(s["contexts"], desc="paged_vs_contiguous: contexts"):
        variants = {"contiguous": dict(kind="contiguous", context=context)}
        for bs in s["block_sizes"]:
            variants[f"paged bs={bs}"] = dict(kind="paged", block_size=bs, context=context)
        # Diagnostic: the engine pads block tables to a few fixed widths (<= 12.5% padding), so a
        # context just past one reads a little more KV. The same paged engine with `slack` fewer
        # tokens stays under it for all its steps: comparing the two isolates the padding.
        bs0 = s["block_sizes"][0]
        slack = -(-new_tokens // bs0) * bs0
        variants[f"paged bs={bs0}, context−{slack} (diagnostic)"] = dict(
            kind="paged", block_size=bs0, context=context - slack)
        hs = {name: DecodeHarness(model, new_tokens=new_tokens, seed=ctx.seed + i, **kw)
              for i, (name, kw) in enumerate(variants.items())}
        try:
            for h in hs.values():  # compile + warm caches
                for _ in range(s["warmup"]):
                    h.step()
            times = interleaved({n: (lambda h=h: h.timed(s["steps"])) for n, h in hs.items()},
                                s["repeats"], desc=f"decode steps @ {context}")
        finally:
            for h in hs.values():
                h.close()
        base = times["contiguous"]
        for name, kw in variants.items():
            h = hs[name]
            kv_pos = h.kv_bytes_per_step / (2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4)
            records.append({
                "row": "paged_vs_contiguous", "context": context, "variant": name, "kind": kw["kind"],
                "block_size": kw.get("block_size"), "tokens_in_cache": kw["context"],
                "max_seq_len": kw["context"] + new_tokens, "diagnostic": "diagnostic" in name,
                "step_seconds_median": median(times[name]), "step_seconds_all": times[name],
                **{"vs_contiguous_" + k: v for k, v in ratio_stats(times[name], base).items()},
                "kv_bytes_per_step": h.kv_bytes_per_step, "kv_positions_read_per_step": kv_pos,
                "steps_per_repeat": s["steps"], "repeats": s["repeats"],
            })
    return records


@row("paged_vs_contiguous", about=(
    "Time per decode step (batch 1) of the paged engine (block_size 16 and 64) against the "
    "contiguous engine at several context lengths, same model, `max_seq_len = context + new tokens` "
    "for both and a pool sized for one sequence. Prefilling 64K tokens on a CPU would take far longer "
    "than the steps being measured, so each engine's cache is filled with random K/V for `context` "
    "tokens (the paged sequence is registered in the `KVCacheManager` as prefill leaves it) and the "
    "engine's own per-token decode path is stepped (`runner.decode`: host bookkeeping + the engine's "
    "jitted whole-model step `RunContext.step` + a host argmax); attention cost does not depend on the "
    "values. Each repeat runs "
    f"every variant for a few consecutive steps, interleaved; headline = median over repeats of "
    f"paged/contiguous (goal ≤ {GOAL}×). A diagnostic line runs the paged engine with a few pages "
    "less context, so its block table is not rounded up past a width step."))
def paged_vs_contiguous(ctx: Context) -> RowResult:
    recs = ctx.shared("decode_steps", lambda: measure_decode_steps(ctx))
    s = _sizes(ctx)
    table = []
    for r in recs:
        is_base = r["kind"] == "contiguous"
        ok = "" if is_base or r["diagnostic"] else ("✓" if r["vs_contiguous_ratio"] <= GOAL else "✗")
        table.append([r["context"], r["variant"], fmt_ms(r["step_seconds_median"]),
                      "1.00× (baseline)" if is_base else f"{fmt_ratio(r, 'vs_contiguous_')} {ok}",
                      f"{r['kv_positions_read_per_step'] / r['tokens_in_cache']:.2f}×"])
    md = md_table(["context", "variant", "step time (median)", f"paged / contiguous (goal ≤ {GOAL}×)",
                   "KV positions read / context"], table)
    md += (f"\n\nMedian of {s['repeats']} repeats × {s['steps']} consecutive steps (variants interleaved "
           f"within each repeat, order rotated); ratio = median of per-repeat ratios (min–max in "
           f"parentheses). 'KV positions read / context' comes from the engine's `kv_bytes_read` "
           f"counter: contiguous attends over its whole `max_seq_len` buffer, paged over its block-table "
           f"width (pages rounded up to a width step, <= 12.5% padding) × block_size. The diagnostic line "
           f"is the same paged engine holding a few pages fewer, so its block table stays at one width "
           f"for every timed step: the gap between it and `paged bs={s['block_sizes'][0]}` is the cost "
           f"of that rounding.")
    return RowResult(records=recs, markdown=md)
