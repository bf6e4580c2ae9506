"""Study `tier_scale`: a context far larger than the device budget, sparse prefill then decode over tiers.

One needle (held-out stdlib text as haystack, the needle at `depth`) is prefilled through the engine
over tiers: device slots for `device_fraction` of the pages, a bounded host tier, and the rest on
disk (tensorstore zarr3 under `disk_path`). The answer is decoded greedily. Reported: the answer and
whether it is right, prefill / decode times, peak RSS, KV bytes per tier, the tier counters. With
`resident` the same prompt also runs all-resident (every page in the device pool) and the two
answers are compared.
"""

from __future__ import annotations

import os
import resource
import shutil
import tempfile
import time
from dataclasses import dataclass

import numpy as np

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.data import tasks
from gemini_jax.errors import ConfigError
from gemini_jax.eval.needle import is_correct
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import choice


@dataclass(frozen=True, kw_only=True)
class Config:
    context: int = 1 << 20
    depth: float = 0.5
    device_fraction: float = 0.1
    host_pages: int = 8192
    disk_path: str | None = None  # None: a fresh temporary directory, removed afterwards
    disk_layout: str = "sharded"
    block_size: int = 16
    budget: int = 1024
    digest: str = "minmax"
    chunk: int = 1024
    score_queries: int = 64
    positions: str = "compact"
    score_distance: int = 0
    prefetch_depth: int = 2
    resident: bool = False
    random_model: bool = False
    seed: int = 0
    out_name: str | None = None

    def __post_init__(self):
        choice(self, "disk_layout", ("chunked", "sharded"))
        choice(self, "digest", ("minmax", "mean"))
        choice(self, "positions", ("true", "compact"))

    @property
    def stem(self) -> str:
        return self.out_name or f"tier_scale_{self.context}"


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


def run(cfg: Config) -> StudyResult:
    """The needle's haystack window and key come from seed `seed` (one trial)."""
    # NOTE: only a directory this study created is removed; a given one must be empty or new.
    if cfg.disk_path and os.path.isdir(cfg.disk_path) and os.listdir(cfg.disk_path):
        raise ConfigError(f"experiment.disk_path={cfg.disk_path!r} is not empty; give an empty or new directory "
                          f"(the study writes a disk tier there and leaves it for you to remove).")
    if cfg.random_model:
        from flax import nnx

        mcfg = gj.ModelConfig(family="tiny", vocab_size=259, hidden_size=256, intermediate_size=768,
                              num_layers=4, num_heads=4, num_kv_heads=2, head_dim=64, max_position=1 << 21)
        model = gj.Decoder(mcfg, rngs=nnx.Rngs(cfg.seed))
    elif tiny.available():
        model = gj.load_tiny()
    else:
        raise ConfigError("no shipped tiny model (gemini_jax/assets/tiny); export one first, or set "
                          "experiment.random_model=true.")
    held = heldout_text()
    rng = np.random.default_rng(cfg.seed)
    ex = tasks.needle_example(held, cfg.context, cfg.depth, rng)
    sp = SparseConfig(enabled=True, budget=cfg.budget, digest=cfg.digest, sink_pages=1, local_pages=2,
                      sparse_prefill=True, score_queries=cfg.score_queries, positions=cfg.positions,
                      score_distance=cfg.score_distance)
    max_len = cfg.context + tasks.KEY_DIGITS + 1
    base = dict(max_seq_len=max_len, max_batch=1, prefill_chunk=cfg.chunk,
                cache=CacheConfig(block_size=cfg.block_size, prefix_caching=False), sparse=sp)
    disk_path = cfg.disk_path or tempfile.mkdtemp(prefix="gj_tier_scale_")
    tier = TierConfig(enabled=True, device_fraction=cfg.device_fraction, host_pages=cfg.host_pages,
                      disk_path=disk_path, disk_layout=cfg.disk_layout, prefetch_depth=cfg.prefetch_depth,
                      hot_threshold=0)
    try:
        runs = [_run(model, ex, EngineConfig(**base, tier=tier), "tiered")]
        if cfg.resident:
            runs.append(_run(model, ex, EngineConfig(**base), "all-resident"))
    finally:
        if not cfg.disk_path:
            shutil.rmtree(disk_path, ignore_errors=True)
    mc = model.cfg
    extra = {"needle_at": ex.needle_at,
             "kv_bytes_total": 2 * mc.num_layers * mc.num_kv_heads * mc.head_dim * 4 * max_len}
    if cfg.resident:
        extra["same_answer"] = runs[0]["answer"] == runs[1]["answer"]
    return StudyResult(name=cfg.stem, records=runs, split="dev", seeds=[cfg.seed], extra=extra)


def _gib(n):
    return f"{n / 2**30:.2f} GiB"


def markdown(r: dict) -> str:
    a = r["config"]
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
    for run_ in r["records"]:
        t, s = run_["tier"], run_["stats"]
        hits, miss = s["prefetch_hits"], s["prefetch_misses"]
        lines.append(
            f"| {run_['run']} | `{run_['answer']!r}` (want {run_['expected']}) | {'✓' if run_['correct'] else '✗'} | "
            f"{run_['prefill_seconds']:.0f} s | {run_['decode_seconds']:.1f} s | {run_['peak_rss_gib']:.2f} GiB | "
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
