"""Decode per token over tiers through the paths users call: `Engine.generate` and a `Session`,
against the all-resident engine, on one prompt of held-out Python sources.

    python experiments/tiers_generate.py [--context 16384] [--tokens 24] [--repeats 3] [--seed 0]

Engines: all-resident, and tiers with a quarter of the pages on device at prefetch depth 0 and 2
(real links), each sparse (budget 1024, sink 1, local 2, sparse prefill). Per engine and repeat:
`generate` with N new tokens (per token: its own decode time, `out.seconds["decode"]`, over its
N - 1 decode calls; the first token comes from the prefill's logits), and a `Session` over the
same prompt (per token: from `start` returning, the prefill done, to its N-th token, over N: a
session writes each token's KV as it yields it). Every engine is warmed by one untimed round
first, and the repeats interleave the engines.
Tokens of every path must equal the all-resident engine's. Medians of the repeats; the headline
is generate / session per token on the same engine (1.0: `generate` carries no cost of its own).
Writes experiments/results/tiers_generate/tiers_generate.{json,md}.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
GOAL = 1.25  # generate per token at most this times the session's, on the same engine


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--context", type=int, default=16384)
    ap.add_argument("--tokens", type=int, default=24)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--out", default=os.path.join(ROOT, "experiments", "results"))
    a = ap.parse_args()
    sys.path.insert(0, ROOT)
    import jax
    import numpy as np
    from tqdm import tqdm

    import gemini_jax as gj
    from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
    from gemini_jax.data import corpus
    from gemini_jax.eval.record import StudyResult, make_record, write_record

    model = gj.load_tiny()
    _, held = corpus.load_split("heldout")
    rng = np.random.default_rng(a.seed)
    start = int(rng.integers(0, len(held) - a.context))
    prompt = [int(t) for t in held[start:start + a.context]]
    sp = SparseConfig(enabled=True, budget=1024, sink_pages=1, local_pages=2, sparse_prefill=True, score_queries=64)
    variants = {"all-resident": TierConfig(),
                "tiers 25% depth 0": TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=0),
                "tiers 25% depth 2": TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=2)}
    N = a.tokens
    many = SamplingParams(max_new_tokens=N, temperature=0.0, stop_at_eos=False)
    engines = {name: gj.Engine(model, EngineConfig(max_seq_len=a.context + N + 8, max_batch=1, prefill_chunk=512,
                                                   cache=CacheConfig(block_size=16, prefix_caching=False),
                                                   sparse=sp, tier=tier))
               for name, tier in variants.items()}
    times = {name: {"generate": [], "session": []} for name in engines}
    tokens = {}

    def round_(name, eng, timed: bool):
        out = eng.generate(prompt, many)
        with eng.start(prompt, many) as sess:
            jax.block_until_ready(sess.logits)  # the prefill runs asynchronously: its end, not its dispatch
            t0 = time.perf_counter()
            toks = [t for t in sess]
            t1 = time.perf_counter()
        tokens[name] = (out.tokens, toks)
        if timed:
            times[name]["generate"].append(out.seconds["decode"] / (N - 1))
            times[name]["session"].append((t1 - t0) / N)

    try:
        for name, eng in tqdm(engines.items(), desc="tiers_generate: warm-up"):
            round_(name, eng, timed=False)
        for rep in tqdm(range(a.repeats), desc="tiers_generate: repeats"):
            order = list(engines)
            order = order[rep % len(order):] + order[:rep % len(order)]
            for name in order:
                round_(name, engines[name], timed=True)
    finally:
        for eng in engines.values():
            eng.close()
    ref = tokens["all-resident"][0]
    records = []
    for name, t in times.items():
        gen = t["generate"]
        ratio = [g / s for g, s in zip(gen, t["session"])]
        records.append({"variant": name, "generate_per_token_all": gen, "session_per_token_all": t["session"],
                        "generate_per_token_median": statistics.median(gen),
                        "session_per_token_median": statistics.median(t["session"]),
                        "generate_vs_session_all": ratio, "generate_vs_session_median": statistics.median(ratio),
                        "tokens_equal_all_resident": tokens[name][0] == ref and tokens[name][1] == ref,
                        **({} if name == "all-resident" else
                           {"goal": GOAL, "goal_met": statistics.median(ratio) <= GOAL})})
    cmd = " ".join(["python experiments/tiers_generate.py", *sys.argv[1:]])
    rec = make_record("tiers_generate", StudyResult(name="tiers_generate", records=records, split=None,
                                                    seeds=[a.seed]),
                      command=cmd, config={"context": a.context, "tokens": N, "repeats": a.repeats, "block_size": 16,
                                           "sparse_budget": 1024, "prefill_chunk": 512, "model": "shipped tiny",
                                           "variants": {k: str(v) for k, v in variants.items()}})
    mark = lambda ok: "✓" if ok else "✗"  # noqa: E731
    res = {r["variant"]: r for r in records}
    md = "\n".join([
        "| engine | generate / token | session / token | generate / session | tokens = all-resident |",
        "|---|---|---|---|---|",
        *[f"| {r['variant']} | {r['generate_per_token_median'] * 1e3:.1f} ms | {r['session_per_token_median'] * 1e3:.1f} ms "
          f"| **{r['generate_vs_session_median']:.2f}×** ({min(r['generate_vs_session_all']):.2f}–"
          f"{max(r['generate_vs_session_all']):.2f}) {mark(r['goal_met']) if 'goal' in r else ''} | "
          f"{mark(r['tokens_equal_all_resident'])} |"
          for r in records], "",
        f"Goal (tiered engines): `generate` per token ≤ {GOAL}× the same engine's `Session` per token. Tiered vs all-resident "
        f"(generate): depth 0 {res['all-resident']['generate_per_token_median'] / res['tiers 25% depth 0']['generate_per_token_median']:.2f}×, "
        f"depth 2 {res['all-resident']['generate_per_token_median'] / res['tiers 25% depth 2']['generate_per_token_median']:.2f}× "
        f"of all-resident speed.", "",
        f"The shipped tiny model, {a.context} held-out bytes (seed {a.seed}), {N} greedy tokens, block 16, sparse "
        f"(budget 1024, sparse prefill, chunk 512); tiers: device_fraction 0.25, real links. `generate` per token: "
        f"its decode time over its {N - 1} decode calls; session per token: from the prefill's end to the {N}-th "
        f"token, over {N}. Medians of {a.repeats} interleaved repeats after an untimed round; the two CPU cores are "
        f"shared with whatever else runs. `{cmd}`, commit `{rec['commit']}`."])
    paths = write_record(a.out, rec, md)
    print(md)
    print(f"tiers_generate: wrote {paths['json']}")


if __name__ == "__main__":
    main()
