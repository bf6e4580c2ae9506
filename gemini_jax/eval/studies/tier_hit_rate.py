"""Study `tier_hit_rate`: prefetch hit rate of sparse decode over tiers, one engine at a time (no other
work on the cores).

The bench row (`bench.py --rows tiers`) times ~20 variants interleaved on the same cores, so a
variant's prefetch threads compete with the others' and more fetches arrive late. This study
measures what the predictor can do when its reads have the machine: for each lookahead and each
decode path (one program per step / layer by layer) it prefills the same held-out text with the
shipped model, decodes `warmup` greedy steps, then counts hits and misses over `steps` more (decode
only).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig, TierConfig
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import as_tuple
from gemini_jax.runtime import new_stats

MODEL = "shipped tiny model, held-out stdlib text"


@dataclass(frozen=True, kw_only=True)
class Config:
    context: int = 16384
    lookaheads: tuple[int, ...] = (0, 1, 3, 5, 8)
    device_fraction: float = 0.25
    prefetch_depth: int = 2
    budget: int = 1024
    staging_pages: int = 2048
    warmup: int = 4
    steps: int = 24
    out_name: str = "tier_hit_rate"

    def __post_init__(self):
        as_tuple(self, "lookaheads", int)


def measure(model, toks, cfg: Config, lookahead: int, fused: bool) -> dict:
    tier = TierConfig(enabled=True, device_fraction=cfg.device_fraction, prefetch_depth=cfg.prefetch_depth,
                      lookahead=lookahead, staging_pages=cfg.staging_pages, hot_threshold=0, fused_decode=fused)
    ec = EngineConfig(max_seq_len=len(toks) + cfg.warmup + cfg.steps + 2, max_batch=1, prefill_chunk=512,
                      cache=CacheConfig(block_size=16, prefix_caching=False),
                      sparse=SparseConfig(enabled=True, budget=cfg.budget, sink_pages=1, local_pages=2,
                                          sparse_prefill=True, score_queries=64), tier=tier)
    with gj.Engine(model, ec) as eng:
        stats = new_stats()
        runner = eng.runner(1, stats)
        nxt = np.asarray(np.argmax(np.asarray(runner.prefill(0, toks)), -1), np.int32)
        lengths = np.array([len(toks)], np.int32)
        before, t0, late0 = None, None, 0
        for i in range(cfg.warmup + cfg.steps):
            if i == cfg.warmup:
                before, t0 = dict(stats), time.perf_counter()
                late0 = eng.tier_stats()["prefetch_late"]
            nxt = np.asarray(np.argmax(np.asarray(runner.decode(nxt, lengths)), -1), np.int32)
            lengths = lengths + 1
        seconds = (time.perf_counter() - t0) / cfg.steps
        d = {k: stats[k] - before[k] for k in stats}
        ts = eng.tier_stats()
        fused_steps, late = ts["fused_decode_steps"], ts["prefetch_late"] - late0
        runner.close()
    hits, misses = d["prefetch_hits"], d["prefetch_misses"]
    return {"lookahead": lookahead, "path": "one program" if fused else "layer by layer",
            "fused_steps": fused_steps, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "hits": hits, "misses": misses, "late": late,
            # The predictor's accuracy: pages it had asked for, arrived or still in flight.
            "predicted": (hits + late) / (hits + misses) if hits + misses else None,
            "pages_fetched_per_token": (d["pages_fetched_host"] + d["pages_fetched_disk"]) / cfg.steps,
            "step_seconds": seconds}


def run(cfg: Config) -> StudyResult:
    """No seeded trials: the prompt is the first `context` tokens of the held-out text."""
    model = gj.load_tiny()
    text = heldout_text()
    toks = np.asarray(text[:cfg.context], np.int32)
    rows = []
    for la in cfg.lookaheads:
        for fused in (True, False):
            r = measure(model, toks, cfg, la, fused)
            rows.append(r)
            print(f"lookahead {la} ({r['path']}): hit rate {r['hit_rate']:.3f} (asked for: {r['predicted']:.3f}), "
                  f"{r['pages_fetched_per_token']:.0f} pages fetched / token, step {1e3 * r['step_seconds']:.1f} ms",
                  flush=True)
    return StudyResult(name=cfg.out_name, records=rows, split=None, seeds=None, extra={"model": MODEL})


def markdown(record: dict) -> str:
    a = record["config"]
    lines = ["# Prefetch hit rate over tiers, one engine at a time", "",
             f"`{record['command']}` — {record['model']}; context {a['context']}, device "
             f"{100 * a['device_fraction']:.0f}% of the pages, prefetch depth {a['prefetch_depth']}, sparse budget "
             f"{a['budget']} tokens (block 16), staging buffer {a['staging_pages']} pages; decode only: {a['steps']} "
             f"greedy steps after {a['warmup']} warm-up steps. Each engine "
             f"runs alone (the bench row interleaves ~20). Step times are for orientation only (one run each, "
             f"not side by side); the bench row holds the timed comparison. *Asked for in time or late*: the "
             f"needed pages the prefetcher had been asked for, arrived (hits) or still being read when needed "
             f"(counted as misses): the predictor's accuracy, apart from the timing of the reads.", "",
             "| lookahead | decode step runs as | prefetch hit rate (goal ≥ 95%) | asked for in time or late | "
             "pages fetched / token | step |",
             "|---|---|---|---|---|---|"]
    for r in record["records"]:
        ok = "✓" if r["hit_rate"] is not None and r["hit_rate"] >= 0.95 else "✗"
        lines.append(f"| {r['lookahead']} | {r['path']} | {100 * r['hit_rate']:.1f}% {ok} | {100 * r['predicted']:.1f}% | "
                     f"{r['pages_fetched_per_token']:.0f} | {1e3 * r['step_seconds']:.1f} ms |")
    return "\n".join(lines) + "\n"
