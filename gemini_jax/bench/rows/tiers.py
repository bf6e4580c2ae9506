"""Row `tiers`: decode step time over tiers (device budgets x prefetch depths) vs all-resident
sparse, prefetch hit rate, and bytes moved per token against the disk's measured bandwidth."""

from __future__ import annotations

import shutil
import tempfile
import time

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.bench.registry import Context, RowResult, row
from gemini_jax.bench.rows.common import peak_rss_gib
from gemini_jax.bench.timing import fmt_bytes, fmt_ms, fmt_ratio, interleaved, md_table, median, ratio_stats
from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig, TierConfig
from gemini_jax.runtime import new_stats
from gemini_jax.tiers.cost_model import measure_disk

GOAL_RATIO = 0.9  # tiered / all-resident speed at 25% with depth >= 2
GOAL_HIT = 0.95


def _sizes(ctx: Context) -> dict:
    return ctx.pick(quick=dict(context=2048, budgets=[0.5, 0.25, 0.1], depths=[0, 2], steps=4, repeats=3,
                               warmup=3, block_size=16, sparse_budget=128, chunk=128),
                    full=dict(context=16384, budgets=[0.5, 0.25, 0.1], depths=[0, 1, 2, 4], steps=8, repeats=5,
                              warmup=4, block_size=16, sparse_budget=1024, chunk=512))


def tier_bench_model():
    """The shipped tiny model on real text when it exists (selection then follows real attention);
    else a random tiny model on random tokens (labelled as such in the report)."""
    from gemini_jax import tiny
    from gemini_jax.data import corpus

    if tiny.available():
        model = gj.load_tiny()
        _, text = corpus.load_split("heldout")
        return model, lambda n, rng: np.asarray(text[:n], np.int32), "the shipped tiny model on held-out stdlib text"
    cfg = gj.ModelConfig(family="tiny", vocab_size=259, hidden_size=256, intermediate_size=768, num_layers=4,
                         num_heads=4, num_kv_heads=2, head_dim=64, max_position=1 << 20)
    from flax import nnx

    model = gj.Decoder(cfg, rngs=nnx.Rngs(0))
    return model, lambda n, rng: rng.integers(0, 256, n).astype(np.int32), "a random-init tiny model on random bytes"


class TierVariant:
    """One engine holding one prefilled sequence; `timed(n)` decodes n greedy tokens."""

    def __init__(self, model, toks, s, *, tier: TierConfig | None):
        # Sparse prefill keeps the 14 prefills linear; the timed decode steps are the same either way.
        sp = SparseConfig(enabled=True, budget=s["sparse_budget"], sink_pages=1, local_pages=2, sparse_prefill=True,
                          score_queries=64)
        new = s["warmup"] + s["steps"] * s["repeats"] + 2
        self.eng = gj.Engine(model, EngineConfig(
            max_seq_len=len(toks) + new, max_batch=1, prefill_chunk=s["chunk"],
            cache=CacheConfig(block_size=s["block_size"], prefix_caching=False), sparse=sp,
            tier=tier or TierConfig()))
        self.stats = new_stats()
        self.runner = self.eng.runner(1, self.stats)
        logits = self.runner.prefill(0, toks)
        self.next = np.asarray(np.argmax(np.asarray(logits), -1), np.int32)
        self.lengths = np.array([len(toks)], np.int32)
        self.tokens = []

    def step(self):
        logits = self.runner.decode(self.next, self.lengths)
        self.next = np.asarray(np.argmax(np.asarray(logits), -1), np.int32)
        self.tokens.append(int(self.next[0]))
        self.lengths = self.lengths + 1

    def timed(self, n):
        t0 = time.perf_counter()
        for _ in range(n):
            self.step()
        return (time.perf_counter() - t0) / n

    def close(self):
        self.runner.close()
        self.eng.close()


@row("tiers", about=(
    "Decode step time (batch 1, chunk-sparse attention, budget 1024 tokens, block 16) of the engine over "
    "tiers — device slots for 50 / 25 / 10 % of the pages, the rest in host RAM, layer-by-layer decode "
    "with the predictive prefetcher at depth 0 / 1 / 2 / 4 — against the all-resident sparse engine "
    "(every page in the device pool, one scanned call per step). A third reference is the tiered engine "
    "with 100 % of the pages on device: it pays the tiered step's machinery but never moves a page, so "
    "the row separates that price from the price of moving pages. Tiered decode steps run as one device "
    "program with host callbacks for missing pages (`tier.fused_decode`); the layer-by-layer variants "
    "run the same cells with two jitted calls and a host sync per layer. Every "
    "variant holds the same prompt, prefilled for real through its own engine; each repeat runs every "
    "variant for a few consecutive greedy steps, interleaved, order rotated; headline = median over "
    "repeats of all-resident / tiered step time (goal ≥ 0.9× at 25 % with depth ≥ 2), prefetch hit rate "
    "from the engine's counters (goal ≥ 95 %). Bytes moved per token = pages fetched × page bytes, "
    "set against the disk's read bandwidth measured here with tensorstore (`measure_disk`)."))
def tiers(ctx: Context) -> RowResult:
    s = _sizes(ctx)
    model, text_of, model_desc = tier_bench_model()
    toks = text_of(s["context"], np.random.default_rng(ctx.seed))
    cfg = model.cfg
    page_bytes = 2 * cfg.num_kv_heads * s["block_size"] * cfg.head_dim * np.dtype(cfg.dtype).itemsize
    disk_dir = tempfile.mkdtemp(prefix="gj_bench_disk_")
    try:
        disk = measure_disk(disk_dir)
    finally:
        shutil.rmtree(disk_dir, True)
    variants = {"all-resident": None, "tiered 100%": TierConfig(enabled=True, device_fraction=1.0, prefetch_depth=0),
                "tiered 100%, layer by layer": TierConfig(enabled=True, device_fraction=1.0, prefetch_depth=0,
                                                          fused_decode=False)}
    for b in s["budgets"]:
        for d in s["depths"]:
            variants[f"tiered {int(b * 100)}% depth {d}"] = TierConfig(
                enabled=True, device_fraction=b, prefetch_depth=d, hot_threshold=0)
    # What the lookahead buys: the goal cell guessing the top 5 x or 1 x budget, and with the
    # previous step's selection as the only guess (lookahead 0).
    for la in (5, 1, 0):
        variants[f"tiered 25% depth 2, lookahead {la}"] = TierConfig(
            enabled=True, device_fraction=0.25, prefetch_depth=2, hot_threshold=0, lookahead=la)
    # The same cells with every step run layer by layer from the host (tier.fused_decode=False).
    for d in (0, 2):
        variants[f"tiered 25% depth {d}, layer by layer"] = TierConfig(
            enabled=True, device_fraction=0.25, prefetch_depth=d, hot_threshold=0, fused_decode=False)
    live = {}
    try:
        for name, tier in tqdm(variants.items(), desc="tiers: prefill variants"):
            live[name] = TierVariant(model, toks, s, tier=tier)
            for _ in range(s["warmup"]):
                live[name].step()
        before = {n: dict(v.stats) for n, v in live.items()}
        steps0 = {n: len(v.tokens) for n, v in live.items()}
        fused0 = {n: v.eng.tier_stats().get("fused_decode_steps", 0) for n, v in live.items()}
        prog0 = {n: v.eng.tier_stats().get("fused_program_seconds", 0.0) for n, v in live.items()}
        times = interleaved({n: (lambda v=v: v.timed(s["steps"])) for n, v in live.items()}, s["repeats"],
                            desc=f"tiers @ {s['context']}")
        same = {n: v.tokens == live["all-resident"].tokens for n, v in live.items()}
        records = []
        for name, tier in variants.items():
            v, b0 = live[name], before[name]
            n = len(v.tokens) - steps0[name]
            d = {k: v.stats[k] - b0[k] for k in v.stats}
            hits, misses = d["prefetch_hits"], d["prefetch_misses"]
            fetched = d["pages_fetched_host"] + d["pages_fetched_disk"]
            rec = {"row": "tiers", "variant": name, "context": s["context"], "model": model_desc,
                   "device_fraction": None if tier is None else tier.device_fraction,
                   "prefetch_depth": None if tier is None else tier.prefetch_depth,
                   "lookahead": None if tier is None else tier.lookahead,
                   "step_seconds_median": median(times[name]), "step_seconds_all": times[name],
                   "tokens_equal_all_resident": same[name],
                   "prefetch_hits": hits, "prefetch_misses": misses,
                   "hit_rate": hits / (hits + misses) if hits + misses else None,
                   "pages_fetched_per_token": fetched / n, "bytes_moved_per_token": fetched * page_bytes / n,
                   "stall_seconds_per_token": d["stall_seconds"] / n,
                   "disk_read_gbs": disk.get("disk_read_gbs"), "peak_rss_gib": peak_rss_gib()}
            if name != "all-resident":
                rec.update({"speed_vs_all_resident_" + k: x
                            for k, x in ratio_stats(times["all-resident"], times[name]).items()})
                rec.update({"speed_vs_tiered100_" + k: x
                            for k, x in ratio_stats(times["tiered 100%"], times[name]).items()})
            if tier is not None:
                ts = v.eng.tier_stats()
                rec["device_slots_per_layer"] = ts["device_slots_per_layer"]
                rec["fused_decode"] = tier.fused_decode
                rec["fused_steps"] = ts["fused_decode_steps"] - fused0[name]
                rec["timed_steps"] = n
                # Share of the timed steps spent inside the one-program step (its callbacks included);
                # the rest is the host's bookkeeping around it.
                prog = ts["fused_program_seconds"] - prog0[name]
                rec["program_share"] = prog / (sum(times[name]) * s["steps"]) if rec["fused_steps"] else None
            records.append(rec)
    finally:
        for v in live.values():
            v.close()
    return RowResult(records=records, markdown=_markdown(records, s, disk, model_desc, page_bytes))


def _markdown(records, s, disk, model_desc, page_bytes) -> str:
    rows = []
    bw = disk.get("disk_read_gbs")
    for r in records:
        at_goal = r["device_fraction"] == 0.25 and (r["prefetch_depth"] or 0) >= 2 and r.get("lookahead")
        ok = ""
        if at_goal:
            ok = ("✓" if r["speed_vs_all_resident_ratio"] >= GOAL_RATIO else "✗")
        hit = "-" if r["hit_rate"] is None else f"{100 * r['hit_rate']:.1f}%"
        if at_goal and r["hit_rate"] is not None:
            hit += " ✓" if r["hit_rate"] >= GOAL_HIT else " ✗"
        io = r["bytes_moved_per_token"] / (bw * 1e9) if bw else None
        if r["variant"] == "all-resident":
            how = "one program (scan)"
        else:
            how = (f"one program ({r['fused_steps']}/{r['timed_steps']}; {100 * r['program_share']:.0f}% of the "
                   f"step in it)" if r["fused_steps"] else "layer by layer")
        rows.append([r["variant"], r.get("device_slots_per_layer", "all"), how, fmt_ms(r["step_seconds_median"]),
                     "1" if r["variant"] == "all-resident" else f"{fmt_ratio(r, 'speed_vs_all_resident_')} {ok}",
                     "-" if r["variant"] == "all-resident" else fmt_ratio(r, "speed_vs_tiered100_"),
                     hit, f"{r['pages_fetched_per_token']:.1f}", fmt_bytes(r["bytes_moved_per_token"]),
                     "-" if io is None else fmt_ms(io), fmt_ms(r["stall_seconds_per_token"]),
                     "✓" if r["tokens_equal_all_resident"] else "✗"])
    md = md_table(["variant", "device slots / layer", "decode step runs as", "step", "speed vs all-resident (goal ≥ 0.9× at 25%, depth ≥ 2)",
                   "speed vs tiered 100%", "prefetch hit rate", "pages fetched / token", "bytes moved / token",
                   "… at disk read bandwidth", "stall / token", "same tokens"], rows)
    md += (f"\n\n**Setup.** {model_desc}; context {s['context']} tokens, block {s['block_size']}, sparse budget "
           f"{s['sparse_budget']} tokens (minmax digests, sink 1 + local 2 pages), prefill chunk {s['chunk']} (sparse "
           f"prefill); lookahead 3 (the top 3 × budget pages of layer l+depth scored from layer l's input) "
           f"unless marked; "
           f"page = {fmt_bytes(page_bytes)} (one layer, all kv heads). Host tier unbounded (no disk in the timed "
           f"loop); the disk column projects the bytes moved onto this machine's tensorstore read bandwidth "
           f"({bw:.2f} GB/s sequential, {disk.get('disk_iops', 0):.0f} random 4 KiB IOPS, measured by "
           f"`measure_disk`) — a projection, not a measurement. *speed vs X* = median over {s['repeats']} repeats "
           f"of (X step time / this step time), {s['steps']} greedy steps per repeat, all variants interleaved "
           f"(min–max in parentheses). *Same tokens*: the greedy tokens of the timed steps equal the "
           f"all-resident engine's. *One program*: the decode step runs as one device program whose host "
           f"callbacks bring missing pages (`tier.fused_decode`, default); *layer by layer*: two jitted calls and "
           f"a host sync per layer.")
    return md
