"""Greedy tokens and integer counters of a fixed set of engines and of the serving scheduler under
churn, written as JSON. `experiments/bench_ab.py --outputs` runs this file once per tree, each
process importing its own tree's `gemini_jax`, and compares the two: a change that claims to
leave behaviour alone must leave these equal. So it uses only what both trees share: `gj.Engine`,
`config.from_dict`, `GenerateOutput.tokens` / `.stats`, `Scheduler` / `Request` / `ServeConfig`.

    PYTHONPATH=<tree> python gemini_jax/bench/same_outputs.py OUT.json [--seed 0]

Each case runs twice in the process: a counter that differs between those two runs depends on
thread timing (the prefetcher's hits against stalls) and is listed as such, not compared.
"""

from __future__ import annotations

import argparse
import json

import numpy as np

import gemini_jax as gj
from gemini_jax.config import EngineConfig, ServeConfig, from_dict
from gemini_jax.data import corpus
from gemini_jax.serve import Request, Scheduler

SPARSE = {"enabled": True, "budget": 64}
TIER = {"enabled": True, "device_fraction": 0.25, "hot_threshold": 0}
# name -> EngineConfig fields over BASE (every one a configuration the exactness tests cover)
CASES = {
    "contiguous": {"cache": {"kind": "contiguous"}},
    "paged": {},
    "paged_k1": {"decode_steps_per_call": 1},
    "sparse": {"sparse": SPARSE},
    "sparse_compact_rerank": {"sparse": {**SPARSE, "positions": "compact", "rerank": 3}},
    "int8": {"cache": {"block_size": 16, "dtype": "int8"}},
    "tiered_dense": {"tier": {**TIER, "prefetch_depth": 0}},
    "tiered_sparse_layers": {"sparse": SPARSE, "tier": {**TIER, "fused_decode": False}},
    "fused": {"sparse": SPARSE, "tier": {**TIER, "device_fraction": 0.2}},  # 51 slots a layer: pages come in
    "aligned": {"cache": {"block_size": 16, "align": "syntax"}},
}
BASE = {"max_seq_len": 1024, "max_batch": 4, "prefill_chunk": 128, "cache": {"block_size": 16}}


def _prompts(seed: int, n: int) -> list[list[int]]:
    """n windows of held-out standard-library source (bytes: the shipped model is byte level)."""
    rng = np.random.default_rng(seed)
    _, text = corpus.load_split("heldout")
    out = []
    for _ in range(n):
        length = int(rng.integers(200, 600))
        off = int(rng.integers(0, len(text) - length))
        out.append(text[off:off + length].astype(np.int32).tolist())
    return out


def _config(fields: dict) -> EngineConfig:
    merged = {**BASE, **fields, "cache": {**BASE["cache"], **fields.get("cache", {})}}
    return from_dict(EngineConfig, merged)


def _counters(stats) -> dict:
    return {k: int(v) for k, v in dict(stats).items() if isinstance(v, (int, np.integer)) and not isinstance(v, bool)}


def run_case(model, fields: dict, prompts, new_tokens: int) -> dict:
    with gj.Engine(model, _config(fields)) as eng:
        out = eng.generate(prompts, gj.SamplingParams(max_new_tokens=new_tokens, stop_at_eos=False))
        return {"tokens": [list(map(int, t)) for t in out.tokens], "counters": _counters(out.stats)}


def run_serve(model, seed: int, k: int) -> dict:
    """Requests joining at random steps into a pool too small for all: preemption (swap) happens."""
    rng = np.random.default_rng(seed)
    prompts = _prompts(seed + 1, 16)
    work = [(p[:int(rng.integers(16, 160))], int(rng.integers(8, 40)), int(rng.integers(0, 12))) for p in prompts]
    cfg = _config({"decode_steps_per_call": k, "max_seq_len": 256, "max_batch": 8,
                   "cache": {"num_pages": 40}})
    with gj.Engine(model, cfg) as eng:
        sched = Scheduler(eng, ServeConfig(step_tokens=96, preempt="swap"))
        reqs = [Request(f"r{i}", p, gj.SamplingParams(max_new_tokens=m)) for i, (p, m, _) in enumerate(work)]
        step, last = 0, max(j for _, _, j in work)
        while True:
            for r, (_, _, join) in zip(reqs, work):
                if join == step:
                    sched.submit(r)
            worked = sched.step()
            step += 1
            if step > last and not worked:
                break
        return {"tokens": [list(map(int, r.generated)) for r in reqs],
                "counters": {"preemptions": int(sched.preemptions), **_counters(eng.stats)}}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("out")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--new-tokens", type=int, default=24)
    a = p.parse_args(argv)
    model = gj.load_tiny()
    prompts = _prompts(a.seed, 3)
    results = {}
    for name, fields in CASES.items():
        results[name] = _merge([run_case(model, fields, prompts, a.new_tokens) for _ in range(2)])
        print(f"{name}: {len(results[name]['counters'])} counters", flush=True)
    for k in (1, 4):
        results[f"serve_churn_k{k}"] = _merge([run_serve(model, a.seed, k) for _ in range(2)])
        print(f"serve_churn_k{k}: done", flush=True)
    with open(a.out, "w") as fh:
        json.dump({"seed": a.seed, "new_tokens": a.new_tokens, "cases": results}, fh, indent=1)
    return 0


def _merge(runs: list[dict]) -> dict:
    """One case's two runs: tokens must agree; a counter that differs is timing-dependent."""
    first, second = runs
    if first["tokens"] != second["tokens"]:
        raise SystemExit("the same engine gave different greedy tokens on two runs in one process")
    varies = sorted(k for k in first["counters"] if first["counters"][k] != second["counters"].get(k))
    counters = {k: v for k, v in first["counters"].items() if k not in varies}
    return {"tokens": first["tokens"], "counters": counters, "timing_dependent": varies}


def compare(old: dict, new: dict) -> tuple[list[dict], list[str]]:
    """Per case: tokens equal, counters equal (those both trees count and neither run found
    timing-dependent), and the counters only one side has. -> (rows, markdown table lines)."""
    rows = []
    for name in sorted(set(old["cases"]) | set(new["cases"])):
        o, n = old["cases"].get(name), new["cases"].get(name)
        if o is None or n is None:
            rows.append({"case": name, "missing_on": "old" if o is None else "new", "same": False})
            continue
        skip = set(o["timing_dependent"]) | set(n["timing_dependent"])
        shared = sorted((set(o["counters"]) & set(n["counters"])) - skip)
        differ = [k for k in shared if o["counters"][k] != n["counters"][k]]
        rows.append({"case": name, "tokens_equal": o["tokens"] == n["tokens"], "counters_compared": len(shared),
                     "counters_differing": {k: [o["counters"][k], n["counters"][k]] for k in differ},
                     "timing_dependent": sorted(skip), "only_new": sorted(set(n["counters"]) - set(o["counters"]) - skip),
                     "only_old": sorted(set(o["counters"]) - set(n["counters"]) - skip),
                     "same": o["tokens"] == n["tokens"] and not differ})
    lines = ["| case | greedy tokens | counters equal | timing-dependent (not compared) | counters only one side has |",
             "| --- | --- | --- | --- | --- |"]
    for r in rows:
        if "missing_on" in r:
            lines.append(f"| {r['case']} | missing on the {r['missing_on']} side | – | – | – |")
            continue
        diff = ", ".join(f"{k} {a}→{b}" for k, (a, b) in r["counters_differing"].items())
        only = ", ".join([f"new: {k}" for k in r["only_new"]] + [f"old: {k}" for k in r["only_old"]])
        lines.append(f"| {r['case']} | {'equal ✓' if r['tokens_equal'] else 'differ ✗'} | "
                     f"{r['counters_compared'] - len(r['counters_differing'])}/{r['counters_compared']} "
                     f"{'✓' if not diff else '✗ ' + diff} | {', '.join(r['timing_dependent']) or '–'} | {only or '–'} |")
    return rows, lines


if __name__ == "__main__":
    raise SystemExit(main())
