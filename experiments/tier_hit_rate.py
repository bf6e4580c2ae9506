"""Prefetch hit rate of sparse decode over tiers, one engine at a time (no other work on the cores).

    python experiments/tier_hit_rate.py                       # 16K context, lookahead 0 1 3 5 8
    python experiments/tier_hit_rate.py --context 4096 --lookaheads 3 5

The bench row (`bench.py --rows tiers`) times ~20 variants interleaved on the same cores, so a
variant's prefetch threads compete with the others' and more fetches arrive late. This script
measures what the predictor can do when its reads have the machine: for each lookahead and each
decode path (one program per step / layer by layer) it prefills the same held-out text with the
shipped model, decodes `--warmup` greedy steps, then counts hits and misses over `--steps` more
(decode only). Written: experiments/results/tier_hit_rate.{json,md}.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gemini_jax as gj  # noqa: E402
from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig, TierConfig  # noqa: E402
from gemini_jax.data import corpus  # noqa: E402
from gemini_jax.runtime import TieredRunner, new_stats  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=16384)
    p.add_argument("--lookaheads", type=int, nargs="+", default=[0, 1, 3, 5, 8])
    p.add_argument("--device-fraction", type=float, default=0.25)
    p.add_argument("--depth", type=int, default=2)
    p.add_argument("--budget", type=int, default=1024)
    p.add_argument("--staging", type=int, default=2048)
    p.add_argument("--warmup", type=int, default=4)
    p.add_argument("--steps", type=int, default=24)
    p.add_argument("--out", default=os.path.join(HERE, "results", "tier_hit_rate"))
    return p.parse_args(argv)


def measure(model, toks, a, lookahead: int, fused: bool) -> dict:
    tier = TierConfig(enabled=True, device_fraction=a.device_fraction, prefetch_depth=a.depth, lookahead=lookahead,
                      staging_pages=a.staging, hot_threshold=0, fused_decode=fused)
    ec = EngineConfig(max_seq_len=len(toks) + a.warmup + a.steps + 2, max_batch=1, prefill_chunk=512,
                      cache=CacheConfig(block_size=16, prefix_caching=False),
                      sparse=SparseConfig(enabled=True, budget=a.budget, sink_pages=1, local_pages=2,
                                          sparse_prefill=True, score_queries=64), tier=tier)
    with gj.Engine(model, ec) as eng:
        stats = new_stats()
        runner = TieredRunner(eng.ctx, 1, stats)
        nxt = np.asarray(np.argmax(np.asarray(runner.prefill(0, toks)), -1), np.int32)
        lengths = np.array([len(toks)], np.int32)
        before, t0, late0 = None, None, 0
        for i in range(a.warmup + a.steps):
            if i == a.warmup:
                before, t0 = dict(stats), time.perf_counter()
                late0 = eng.store.prefetcher.stats["prefetch_late"]
            nxt = np.asarray(np.argmax(np.asarray(runner.decode(nxt, lengths)), -1), np.int32)
            lengths = lengths + 1
        seconds = (time.perf_counter() - t0) / a.steps
        d = {k: stats[k] - before[k] for k in stats}
        fused_steps = eng.store.fused_steps
        late = eng.store.prefetcher.stats["prefetch_late"] - late0
        runner.close()
    hits, misses = d["prefetch_hits"], d["prefetch_misses"]
    return {"lookahead": lookahead, "path": "one program" if fused else "layer by layer",
            "fused_steps": fused_steps, "hit_rate": hits / (hits + misses) if hits + misses else None,
            "hits": hits, "misses": misses, "late": late,
            # The predictor's accuracy: pages it had asked for, arrived or still in flight.
            "predicted": (hits + late) / (hits + misses) if hits + misses else None,
            "pages_fetched_per_token": (d["pages_fetched_host"] + d["pages_fetched_disk"]) / a.steps,
            "step_seconds": seconds}


def main(argv=None) -> int:
    a = parse(argv)
    model = gj.load_tiny()
    _, text = corpus.load_split("heldout")
    toks = np.asarray(text[:a.context], np.int32)
    rows = []
    for la in a.lookaheads:
        for fused in (True, False):
            r = measure(model, toks, a, la, fused)
            rows.append(r)
            print(f"lookahead {la} ({r['path']}): hit rate {r['hit_rate']:.3f} (asked for: {r['predicted']:.3f}), "
                  f"{r['pages_fetched_per_token']:.0f} pages fetched / token, step {1e3 * r['step_seconds']:.1f} ms",
                  flush=True)
    cmd = "python experiments/tier_hit_rate.py " + " ".join(argv if argv is not None else sys.argv[1:])
    result = {"command": cmd.strip(), "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "context": a.context, "device_fraction": a.device_fraction, "prefetch_depth": a.depth,
              "budget": a.budget, "staging_pages": a.staging, "warmup": a.warmup, "steps": a.steps,
              "model": "shipped tiny model, held-out stdlib text", "rows": rows}
    os.makedirs(os.path.dirname(a.out), exist_ok=True)
    with open(a.out + ".json", "w") as fh:
        json.dump(result, fh, indent=1)
    lines = ["# Prefetch hit rate over tiers, one engine at a time", "",
             f"`{result['command']}` — {result['model']}; context {a.context}, device {100 * a.device_fraction:.0f}% of "
             f"the pages, prefetch depth {a.depth}, sparse budget {a.budget} tokens (block 16), staging buffer "
             f"{a.staging} pages; decode only: {a.steps} greedy steps after {a.warmup} warm-up steps. Each engine "
             f"runs alone (the bench row interleaves ~20). Step times are for orientation only (one run each, "
             f"not side by side); the bench row holds the timed comparison. *Asked for in time or late*: the "
             f"needed pages the prefetcher had been asked for, arrived (hits) or still being read when needed "
             f"(counted as misses): the predictor's accuracy, apart from the timing of the reads.", "",
             "| lookahead | decode step runs as | prefetch hit rate (goal ≥ 95%) | asked for in time or late | "
             "pages fetched / token | step |",
             "|---|---|---|---|---|---|"]
    for r in rows:
        ok = "✓" if r["hit_rate"] is not None and r["hit_rate"] >= 0.95 else "✗"
        lines.append(f"| {r['lookahead']} | {r['path']} | {100 * r['hit_rate']:.1f}% {ok} | {100 * r['predicted']:.1f}% | "
                     f"{r['pages_fetched_per_token']:.0f} | {1e3 * r['step_seconds']:.1f} ms |")
    with open(a.out + ".md", "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())
