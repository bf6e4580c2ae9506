"""Dense needle accuracy on chosen keys, by length and depth: does the model itself copy a key
right when the needle sits near the edge of its training window?

    python experiments/needle_keys.py --keys 22679 78734 22245 --lengths 1024 2048

Writes experiments/results/needle_keys.{json,md}: per (length, depth) how many keys came back
exactly, and the wrong answers. Dense attention through the paged engine (no sparsity).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import numpy as np

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gemini_jax as gj  # noqa: E402
from gemini_jax.data import corpus, tasks  # noqa: E402
from gemini_jax.eval.needle import is_correct  # noqa: E402
from gemini_jax.tokenizer import ByteTokenizer  # noqa: E402

# Keys that sparse runs with compact positions miscopied at 8K / 32K (most repeat a digit).
DEFAULT_KEYS = ["22679", "78734", "22245", "84037", "86812", "36113", "68623", "44920", "83793"]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--keys", nargs="+", default=DEFAULT_KEYS)
    p.add_argument("--lengths", type=int, nargs="+", default=[1024, 2048])
    p.add_argument("--depths", type=float, nargs="+", default=[0.05, 0.5, 0.95])
    p.add_argument("--seed", type=int, default=7)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    bad = [k for k in a.keys if len(k) != tasks.KEY_DIGITS or not k.isdigit()]
    if bad:
        p.error(f"keys must be {tasks.KEY_DIGITS} digits: {bad}")
    _, hay = corpus.load_split("heldout")
    eng = gj.Engine(gj.load_tiny(), gj.config.from_dict(gj.EngineConfig, dict(
        max_seq_len=max(a.lengths) + 16, max_batch=len(a.keys), prefill_chunk=1024)))
    tok = ByteTokenizer()
    params = gj.SamplingParams(max_new_tokens=tasks.KEY_DIGITS + 1, temperature=0.0, stop_at_eos=False)
    rows = []
    for length in a.lengths:
        for depth in a.depths:
            exs = [tasks.needle_example(hay, length, depth, np.random.default_rng([a.seed, i]), key=k)
                   for i, k in enumerate(a.keys)]
            out = eng.generate([list(map(int, e.prompt)) for e in exs], params)
            got = [tok.decode([t for t in g if t < 256]) for g in out.tokens]
            wrong = [(k, g) for k, g in zip(a.keys, got) if not is_correct(g, k)]
            rows.append({"length": length, "depth": depth, "right": len(a.keys) - len(wrong), "of": len(a.keys),
                         "wrong": wrong})
            print(f"{length:6d} {depth:.2f} {len(a.keys) - len(wrong)}/{len(a.keys)} {wrong}", flush=True)
    cmd = "python experiments/needle_keys.py " + " ".join(sys.argv[1:] if argv is None else argv)
    lines = ["# Dense needle on chosen keys", "",
             f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, command `{cmd}`. "
             f"The shipped tiny model, dense attention; keys {', '.join(a.keys)}.", "",
             "| length | depth | right | wrong answers (key → answer) |", "|---|---|---|---|"]
    lines += [f"| {r['length']} | {r['depth']} | {r['right']} / {r['of']} | "
              + (", ".join(f"{k} → `{g!r}`" for k, g in r["wrong"]) or "—") + " |" for r in rows]
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "needle_keys.json"), "w") as fh:
        json.dump({"command": cmd, "keys": a.keys, "rows": rows}, fh, indent=1)
    with open(os.path.join(a.out, "needle_keys.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
