"""Digest recall of the shipped model on real text, per digest kind and block size.

    python experiments/digest_recall.py                    # -> experiments/results/digest_recall.{md,json}
    python experiments/digest_recall.py --contexts 2048 --windows 4

For windows of held-out standard-library text, `gemini_jax.eval.digest_recall` compares, for each
of the last `--queries` positions, layer and kv head, the top-k pages by exact attention mass
with the top-k pages by digest score (sink and local pages excluded on both sides). k is the
budget in pages: `--budget` tokens / block size.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import sys
import time

import numpy as np
from tqdm import tqdm

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))

import gemini_jax as gj  # noqa: E402
from gemini_jax.data import corpus, tasks  # noqa: E402
from gemini_jax.eval.recall import RecallSetting, digest_recall  # noqa: E402
from gemini_jax.tokenizer import ByteTokenizer  # noqa: E402


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--contexts", default="2048,8192", help="comma-separated context lengths")
    p.add_argument("--windows", type=int, default=6, help="text windows per context")
    p.add_argument("--block-sizes", default="8,16,32,64")
    p.add_argument("--budget", type=int, default=512, help="tokens selected beyond sink + local")
    p.add_argument("--queries", type=int, default=16, help="last positions of each window scored")
    p.add_argument("--rerank", type=int, default=2,
                   help="also report each kind reranked: n*k digest candidates, exact q.k picks k (0 = off)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--out", default=os.path.join(HERE, "results"))
    a = p.parse_args(argv)
    model = gj.load_tiny()
    _, held = corpus.load_split("heldout")
    contexts = [int(x) for x in a.contexts.split(",")]
    blocks = [int(x) for x in a.block_sizes.split(",")]
    records = []
    bar = tqdm(total=len(contexts) * a.windows * len(blocks), desc="digest recall")
    t0 = time.time()
    for T in contexts:
        for w in range(a.windows):
            rng = np.random.default_rng([a.seed, T, w])
            toks = np.concatenate([[ByteTokenizer.BOS], tasks.text_window(held, T - 1, rng)]).astype(np.int32)
            for bs in blocks:
                r = digest_recall(model, toks, RecallSetting(block_size=bs, k_pages=a.budget // bs, rerank=a.rerank),
                                  queries=a.queries)
                records.append({"context": T, "window": w, "block_size": bs, "k_pages": a.budget // bs,
                                **{k: float(np.mean(v)) for k, v in r.items()}})
                bar.update(1)
    bar.close()
    kinds = [k for k in records[0] if k not in ("context", "window", "block_size", "k_pages")]
    lines = ["# Digest recall of the shipped model on held-out text", "",
             f"Run {datetime.datetime.now(datetime.timezone.utc).isoformat(timespec='seconds')}, command "
             f"`python experiments/digest_recall.py {' '.join(sys.argv[1:] if argv is None else argv)}` "
             f"({time.time() - t0:.0f} s). Recall = |digest top-k ∩ exact-attention top-k| / k over the last "
             f"{a.queries} positions of each window, every layer and kv head; k = {a.budget} tokens / block "
             f"size; sink (1) and local (2) pages excluded on both sides; {a.windows} windows per context; "
             f"mean (min–max over windows). *kind+rerankN*: the kind's top N·k pages, of which the k with the "
             f"largest exact q·k (`sparse.rerank=N`).", "",
             "| context | block | k pages | " + " | ".join(kinds) + " |", "|---" * (3 + len(kinds)) + "|"]
    for T in contexts:
        for bs in blocks:
            rs = [r for r in records if r["context"] == T and r["block_size"] == bs]
            cells = [f"{np.mean([r[k] for r in rs]):.3f} ({min(r[k] for r in rs):.2f}–{max(r[k] for r in rs):.2f})"
                     for k in kinds]
            lines.append(f"| {T} | {bs} | {a.budget // bs} | " + " | ".join(cells) + " |")
    os.makedirs(a.out, exist_ok=True)
    with open(os.path.join(a.out, "digest_recall.json"), "w") as fh:
        # The output directory as given relative to the repository, not this machine's checkout.
        args = dict(vars(a), out=os.path.relpath(a.out, os.path.dirname(HERE)))
        json.dump({"args": args, "records": records}, fh, indent=1)
    with open(os.path.join(a.out, "digest_recall.md"), "w") as fh:
        fh.write("\n".join(lines) + "\n")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
