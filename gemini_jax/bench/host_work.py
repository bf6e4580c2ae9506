"""Profile of the `tiers` bench row's decode step in two trees: Python work per step and step time.

The `tiers` row's A/B (experiments/bench_ab.py) runs each tree's whole row once per round, 3 steps
x 4 repeats per variant; on a shared 2-core machine its rounds move together by +-30%, too much to
resolve a 5% change. This takes the row's variants that decode from the host (the layer loop) with
the all-resident and a one-program reference, and measures, per tree and in one process each:

- Python function calls per decode step (cProfile, one step at a time; the median over steps, so a
  step that compiles a new shape does not count). Deterministic: more host work shows here even
  when times are noise.
- Step time, median over repeats of a few consecutive greedy steps, variants interleaved, and its
  ratio to the same process's all-resident step (which cancels what the machine does meanwhile).

Processes alternate old / new (`--pairs` of them), as bench_ab's rounds do.

    python -m gemini_jax.bench.host_work --base 19ca6da [--pairs 4] [--repeats 15]

Each side runs this file from the new tree under its own tree's `gemini_jax` (PYTHONPATH), using
only what both share. Writes experiments/results/bench_ab/<base>_<head>_host_work.{json,md}.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RESULTS = os.path.join(ROOT, "experiments", "results", "bench_ab")
# The `tiers` row's quick sizes: 2K of held-out text, block 16, sparse budget 128, prefill chunk 128.
CONTEXT, STEPS, WARMUP, PROFILED = 2048, 4, 20, 8
VARIANTS = {  # name -> TierConfig fields (None: the all-resident sparse engine)
    "all-resident": None,
    "tiered 25% depth 0": {"device_fraction": 0.25, "prefetch_depth": 0, "hot_threshold": 0},
    "tiered 10% depth 0": {"device_fraction": 0.1, "prefetch_depth": 0, "hot_threshold": 0},
    "tiered 100%, layer by layer": {"device_fraction": 1.0, "prefetch_depth": 0, "fused_decode": False},
    "tiered 25% depth 0, layer by layer": {"device_fraction": 0.25, "prefetch_depth": 0, "hot_threshold": 0,
                                           "fused_decode": False},
}


def worker(out: str, repeats: int, seed: int) -> None:
    """One tree's measurements (run under that tree's gemini_jax), as JSON into `out`."""
    import numpy as np

    import gemini_jax as gj
    from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig, TierConfig
    from gemini_jax.data import corpus
    from gemini_jax.runtime import new_stats

    def runner(eng):
        if hasattr(eng, "runner"):
            return eng.runner(1, new_stats())
        from gemini_jax.runtime import make_runner  # trees before the decode core
        return make_runner(eng.ctx, 1, new_stats())

    model = gj.load_tiny()
    _, text = corpus.load_split("heldout")
    off = int(np.random.default_rng(seed).integers(0, len(text) - CONTEXT))
    toks = np.asarray(text[off:off + CONTEXT], np.int32)
    sp = SparseConfig(enabled=True, budget=128, sink_pages=1, local_pages=2, sparse_prefill=True, score_queries=64)
    live = {}
    for name, tier in VARIANTS.items():
        eng = gj.Engine(model, EngineConfig(
            max_seq_len=CONTEXT + WARMUP + STEPS * repeats + PROFILED + 8, max_batch=1, prefill_chunk=128,
            cache=CacheConfig(block_size=16, prefix_caching=False), sparse=sp,
            tier=TierConfig(enabled=True, **tier) if tier else TierConfig()))
        r = runner(eng)
        nxt = np.asarray(np.argmax(np.asarray(r.prefill(0, toks)), -1), np.int32)
        live[name] = {"eng": eng, "r": r, "next": nxt, "len": np.array([CONTEXT], np.int32), "tokens": []}

    def step(v):
        v["next"] = np.asarray(np.argmax(np.asarray(v["r"].decode(v["next"], v["len"])), -1), np.int32)
        v["tokens"].append(int(v["next"][0]))
        v["len"] = v["len"] + 1

    for v in live.values():
        for _ in range(WARMUP):  # past the shapes a growing sequence compiles early
            step(v)
    times = {n: [] for n in live}
    names = list(live)
    for rep in range(repeats):  # interleaved, order rotated
        for n in names[rep % len(names):] + names[:rep % len(names)]:
            t0 = time.perf_counter()
            for _ in range(STEPS):
                step(live[n])
            times[n].append((time.perf_counter() - t0) / STEPS)
    calls = {}
    for n, v in live.items():
        per = []
        for _ in range(PROFILED):
            prof = cProfile.Profile()
            prof.enable()
            step(v)
            prof.disable()
            per.append(pstats.Stats(prof).total_calls)
        calls[n] = statistics.median(per)
    ref = live["all-resident"]["tokens"]
    res = {"seed": seed, "offset": off, "step_seconds": times, "calls_per_step": calls,
           "tokens_equal_all_resident": {n: v["tokens"] == ref for n, v in live.items()}}
    for v in live.values():
        v["r"].close()
        v["eng"].close()
    with open(out, "w") as fh:
        json.dump(res, fh)


def _git(*args: str) -> str:
    return subprocess.run(["git", *args], cwd=ROOT, check=True, capture_output=True, text=True).stdout.strip()


def _markdown(rec: dict) -> str:
    old, new = rec["sides"]["old"], rec["sides"]["new"]
    lines = [f"# Host work per decode step, `tiers` row variants: {rec['head'][:7]} (new) vs {rec['base'][:7]} (old)", "",
             f"`{rec['command']}`: {rec['config']['pairs']} process pairs alternating old / new, {rec['config']['repeats']} "
             f"repeats x {STEPS} greedy steps per variant (interleaved) after {WARMUP} warm-up steps, batch 1, "
             f"{CONTEXT} tokens of held-out text (seeds {rec['seeds']}), the shipped tiny model. Python calls: cProfile, "
             f"median over {PROFILED} single steps. Ratios: per pair new / old, median [min, max] over pairs.", "",
             "| variant | Python calls / step, old | new | step new / old | (step / all-resident) new / old | tokens equal |",
             "|---|---|---|---|---|---|"]
    for name in VARIANTS:
        calls = f"{statistics.median(o['calls_per_step'][name] for o in old):.0f} | " \
                f"{statistics.median(n['calls_per_step'][name] for n in new):.0f}"
        step = rec["ratios"][name]["step"]
        rel = rec["ratios"][name]["vs_all_resident"]
        same = all(s["tokens_equal_all_resident"][name] for s in old + new)
        lines.append(f"| {name} | {calls} | {step['median']:.3f} [{step['min']:.3f}, {step['max']:.3f}] | "
                     + ("—" if rel is None else f"{rel['median']:.3f} [{rel['min']:.3f}, {rel['max']:.3f}]")
                     + f" | {'✓' if same else '✗'} |")
    return "\n".join(lines) + "\n"


def _spread(xs: list[float]) -> dict:
    return {"median": statistics.median(xs), "min": min(xs), "max": max(xs), "per_pair": xs}


def pair_ratios(sides: dict) -> dict:
    """variant -> {"step": new / old step median per pair, "vs_all_resident": the same of each side's
    step / its own all-resident step}, each as median, min, max and the per-pair list."""
    ratios = {}
    for name in VARIANTS:
        med = {s: [statistics.median(r["step_seconds"][name]) for r in sides[s]] for s in sides}
        ref = {s: [statistics.median(r["step_seconds"]["all-resident"]) for r in sides[s]] for s in sides}
        ratios[name] = {"step": _spread([n / o for n, o in zip(med["new"], med["old"])]),
                        "vs_all_resident": None if name == "all-resident" else _spread(
                            [(n / rn) / (o / ro) for n, rn, o, ro in zip(med["new"], ref["new"], med["old"], ref["old"])])}
    return ratios


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--base", help="the commit to compare against (required)")
    p.add_argument("--pairs", type=int, default=4, help="old / new process pairs, alternating")
    p.add_argument("--repeats", type=int, default=15, help="timed repeats per variant in a process")
    p.add_argument("--seed", type=int, default=0, help="the text window's seed (pair i uses seed + i)")
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    a = p.parse_args(argv)
    if a.worker:
        worker(a.worker, a.repeats, a.seed)
        return 0
    if not a.base:
        p.error("--base is required")
    base, head = _git("rev-parse", a.base), _git("rev-parse", "HEAD")
    dirty = bool(_git("status", "--porcelain", "--untracked-files=no"))
    work = tempfile.mkdtemp(prefix="host_work_")
    base_tree = os.path.join(work, "base")
    _git("worktree", "add", "--detach", base_tree, base)
    sides = {"old": [], "new": []}
    try:
        for i in range(a.pairs):
            order = [("old", base_tree), ("new", ROOT)]
            for side, tree in order if i % 2 == 0 else order[::-1]:
                print(f"pair {i + 1}/{a.pairs}: {side}", flush=True)
                out = os.path.join(work, f"{side}{i}.json")
                subprocess.run([sys.executable, os.path.abspath(__file__), "--worker", out, "--repeats", str(a.repeats),
                                "--seed", str(a.seed + i)], cwd=tree, env=dict(os.environ, PYTHONPATH=tree), check=True)
                with open(out) as fh:
                    sides[side].append(json.load(fh))
    finally:
        _git("worktree", "remove", "--force", base_tree)
    ratios = pair_ratios(sides)
    new = head + ("+dirty" if dirty else "")
    rec = {"command": "python -m gemini_jax.bench.host_work " + " ".join(sys.argv[1:] if argv is None else argv),
           "commit": new, "base": base, "head": new, "config": {k: v for k, v in vars(a).items() if k != "worker"},
           "split": None, "seeds": [a.seed + i for i in range(a.pairs)], "sides": sides, "ratios": ratios}
    name = f"{base[:7]}_{head[:7]}_host_work"
    os.makedirs(RESULTS, exist_ok=True)
    with open(os.path.join(RESULTS, name + ".json"), "w") as fh:
        json.dump(rec, fh, indent=1)
    md = _markdown(rec)
    with open(os.path.join(RESULTS, name + ".md"), "w") as fh:
        fh.write(md)
    print(md, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
