"""A context far larger than the device budget: sparse prefill then decode over tiers.

    python experiments/tier_scale.py                         # 1M tokens (slow: see the README)
    python experiments/tier_scale.py --context 65536 --resident   # also the all-resident run

One needle (held-out stdlib text as haystack, the needle at --depth) is prefilled through the
engine over tiers: device slots for --device-fraction of the pages, a bounded host tier, and the
rest on disk (tensorstore zarr3 under --disk-path). The answer is decoded greedily. Reported:
the answer and whether it is right, prefill / decode times, peak RSS, KV bytes per tier, the
tier counters. With --resident the same prompt also runs all-resident (every page in the device
pool) and the two answers are compared. Writes experiments/results/tier_scale_<context>.{json,md} (or `--name`).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import resource
import shutil
import sys
import time

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gemini_jax as gj  # noqa: E402
from gemini_jax import tiny  # noqa: E402
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig  # noqa: E402
from gemini_jax.data import corpus, tasks  # noqa: E402
from gemini_jax.eval.needle import is_correct  # noqa: E402


def parse(argv=None):
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--context", type=int, default=1 << 20, help="prompt tokens (default 1M)")
    p.add_argument("--depth", type=float, default=0.5, help="needle depth in [0, 1]")
    p.add_argument("--device-fraction", type=float, default=0.1, help="device slots / pages")
    p.add_argument("--host-pages", type=int, default=8192, help="host tier bound, (layer, page) units")
    p.add_argument("--disk-path", default="/tmp/gj_tier_scale", help="disk tier directory (emptied first)")
    p.add_argument("--disk-layout", default="sharded", choices=["chunked", "sharded"])
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--budget", type=int, default=1024, help="sparse budget, tokens")
    p.add_argument("--digest", default="minmax", choices=["minmax", "mean"])
    p.add_argument("--chunk", type=int, default=1024, help="prefill chunk")
    p.add_argument("--score-queries", type=int, default=64, help="queries of a prefill chunk that score pages")
    p.add_argument("--positions", default="compact", choices=["true", "compact"])
    p.add_argument("--score-distance", type=int, default=0,
                   help="compact positions: score pages as if this many tokens before the query (0 = off)")
    p.add_argument("--prefetch-depth", type=int, default=2)
    p.add_argument("--resident", action="store_true", help="also run all-resident and compare")
    p.add_argument("--random-model", action="store_true",
                   help="a random-init model of the tiny shape (smoke test of the machinery; answers meaningless)")
    p.add_argument("--name", default=None, help="output file stem (default tier_scale_<context>)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    return p.parse_args(argv)


def _peak_rss_gib() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20


def _run(model, ex, ecfg, label):
    answer_len = tasks.KEY_DIGITS + 1
    t0 = time.time()
    with gj.Engine(model, ecfg) as eng:
        out = eng.generate(ex.prompt, SamplingParams(max_new_tokens=answer_len, temperature=0.0))
        ts = eng.tier_stats()
    text = bytes(t for t in out.tokens if t < 256).decode("utf-8", "replace")
    rec = {"run": label, "answer": text, "expected": ex.answer, "correct": is_correct(text, ex.answer),
           "prefill_seconds": out.seconds["prefill"], "decode_seconds": out.seconds["decode"],
           "wall_seconds": time.time() - t0, "peak_rss_gib": _peak_rss_gib(), "stats": out.stats, "tier": ts}
    print(f"{label}: answer {text!r} (expected {ex.answer}) -> {'right' if rec['correct'] else 'wrong'}; "
          f"prefill {rec['prefill_seconds']:.0f} s, peak RSS {rec['peak_rss_gib']:.2f} GiB", flush=True)
    return rec


def main(argv=None) -> int:
    a = parse(argv)
    if a.random_model:
        from flax import nnx

        mcfg = gj.ModelConfig(family="tiny", vocab_size=259, hidden_size=256, intermediate_size=768,
                              num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_position=1 << 21)
        model = gj.Decoder(mcfg, rngs=nnx.Rngs(a.seed))
    elif tiny.available():
        model = gj.load_tiny()
    else:
        raise SystemExit("no shipped tiny model (gemini_jax/assets/tiny); export one first, or pass --random-model.")
    _, held = corpus.load_split("heldout")
    rng = np.random.default_rng(a.seed)
    ex = tasks.needle_example(held, a.context, a.depth, rng)
    sp = SparseConfig(enabled=True, budget=a.budget, digest=a.digest, sink_pages=1, local_pages=2,
                      sparse_prefill=True, score_queries=a.score_queries, positions=a.positions,
                      score_distance=a.score_distance)
    max_len = a.context + tasks.KEY_DIGITS + 1
    base = dict(max_seq_len=max_len, max_batch=1, prefill_chunk=a.chunk,
                cache=CacheConfig(block_size=a.block_size, prefix_caching=False), sparse=sp)
    shutil.rmtree(a.disk_path, ignore_errors=True)
    tier = TierConfig(enabled=True, device_fraction=a.device_fraction, host_pages=a.host_pages,
                      disk_path=a.disk_path, disk_layout=a.disk_layout, prefetch_depth=a.prefetch_depth,
                      hot_threshold=0)
    runs = [_run(model, ex, EngineConfig(**base, tier=tier), "tiered")]
    if a.resident:
        runs.append(_run(model, ex, EngineConfig(**base), "all-resident"))
    shutil.rmtree(a.disk_path, ignore_errors=True)
    cfg = model.cfg
    kv_total = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * max_len
    result = {"date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
              "command": "python experiments/tier_scale.py " + " ".join(sys.argv[1:] if argv is None else argv),
              "args": {**vars(a), "out": os.path.relpath(a.out, os.path.dirname(HERE))}, "needle_at": ex.needle_at, "kv_bytes_total": kv_total, "runs": runs}
    if a.resident:
        result["same_answer"] = runs[0]["answer"] == runs[1]["answer"]
    os.makedirs(a.out, exist_ok=True)
    stem = os.path.join(a.out, a.name or f"tier_scale_{a.context}")
    with open(stem + ".json", "w") as fh:
        json.dump(result, fh, indent=1, default=float)
    with open(stem + ".md", "w") as fh:
        fh.write(_markdown(result))
    print(f"wrote {stem}.json and .md")
    return 0


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def _markdown(r) -> str:
    a = r["args"]
    scored = f", pages scored at distance {a['score_distance']}" if a.get("score_distance") else ""
    lines = [f"# {a['context']:,}-token context over tiers", "",
             f"Run {r['date']}, command `{r['command']}`. "
             f"{'A RANDOM-INIT model (machinery only; its answers mean nothing)' if a['random_model'] else 'The shipped tiny model'}; a needle at depth "
             f"{a['depth']} (token {r['needle_at']:,}) of held-out standard-library text; sparse prefill and "
             f"decode (budget {a['budget']} tokens, {a['digest']} digests, block {a['block_size']}, {a['positions']} "
             f"positions, the last {a['score_queries']} queries of each {a['chunk']}-token chunk score pages{scored}); "
             f"KV in all: {_gib(r['kv_bytes_total'])}.", "",
             "| run | answer | right | prefill | decode | peak RSS | KV on device | KV in host RAM | KV on disk | "
             "pages from host / disk | prefetch hit rate | stall |", "| --- " * 12 + "|"]
    for run in r["runs"]:
        t, s = run["tier"], run["stats"]
        hits, miss = s["prefetch_hits"], s["prefetch_misses"]
        lines.append(
            f"| {run['run']} | `{run['answer']!r}` (want {run['expected']}) | {'✓' if run['correct'] else '✗'} | "
            f"{run['prefill_seconds']:.0f} s | {run['decode_seconds']:.1f} s | {run['peak_rss_gib']:.2f} GiB | "
            f"{_gib(t.get('kv_bytes_device', r['kv_bytes_total']))} | {_gib(t.get('kv_bytes_host', 0))} | "
            f"{_gib(t.get('kv_bytes_disk', 0))} | {s['pages_fetched_host']} / {s['pages_fetched_disk']} | "
            f"{(100 * hits / (hits + miss)) if hits + miss else 0:.1f}% | {s['stall_seconds']:.1f} s |")
    if "same_answer" in r:
        lines += ["", f"Tiered and all-resident answers identical: **{r['same_answer']}**."]
    lines += ["", f"Device tier: {a['device_fraction']:.0%} of the pages per layer (digests of every page stay "
                  f"on device as well); host tier bound {a['host_pages']} (layer, page) units; disk "
                  f"layout {a['disk_layout']}. Peak RSS is the whole process (model, digests, host tier, "
                  f"jit buffers)."]
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    raise SystemExit(main())
