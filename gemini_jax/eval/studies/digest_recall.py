"""Study `digest_recall`: digest recall of the shipped model on real text, per digest kind and block size.

For windows of held-out standard-library text, `gemini_jax.eval.digest_recall` compares, for each of
the last `queries` positions, layer and kv head, the top-k pages by exact attention mass with the
top-k pages by digest score (sink and local pages excluded on both sides). k is the budget in pages:
`budget` tokens / block size.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.data import tasks
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.recall import RecallSetting, digest_recall
from gemini_jax.eval.studies import as_tuple
from gemini_jax.tokenizer import ByteTokenizer
from gemini_jax.eval.trials import Draw

_KEYS = ("context", "window", "block_size", "k_pages")


@dataclass(frozen=True, kw_only=True)
class Config:
    contexts: tuple[int, ...] = (2048, 8192)
    windows: int = 6
    block_sizes: tuple[int, ...] = (8, 16, 32, 64)
    budget: int = 512
    queries: int = 16
    rerank: int = 2
    seed: int = 0
    out_name: str = "digest_recall"

    def __post_init__(self):
        as_tuple(self, "contexts", int)
        as_tuple(self, "block_sizes", int)


def run(cfg: Config) -> StudyResult:
    """Window w of context T is drawn from seed [seed, T, w]; every block size scores the same window."""
    model = gj.load_tiny()
    held = heldout_text()
    records = []
    bar = tqdm(total=len(cfg.contexts) * cfg.windows * len(cfg.block_sizes), desc="digest recall")
    t0 = time.time()
    for T in cfg.contexts:
        for w in range(cfg.windows):
            rng = Draw("dev", cfg.seed).rng(T, w)
            toks = np.concatenate([[ByteTokenizer.BOS], tasks.text_window(held, T - 1, rng)]).astype(np.int32)
            for bs in cfg.block_sizes:
                r = digest_recall(model, toks, RecallSetting(block_size=bs, k_pages=cfg.budget // bs, rerank=cfg.rerank),
                                  queries=cfg.queries)
                records.append({"context": T, "window": w, "block_size": bs, "k_pages": cfg.budget // bs,
                                **{k: float(np.mean(v)) for k, v in r.items()}})
                bar.update(1)
    bar.close()
    return StudyResult(name=cfg.out_name, records=records, split="dev", seeds=[cfg.seed],
                       extra={"seconds": time.time() - t0})


def markdown(record: dict) -> str:
    a, records = record["config"], record["records"]
    kinds = [k for k in records[0] if k not in _KEYS]
    lines = ["# Digest recall of the shipped model on held-out text", "",
             f"Run {record['date']}, command `{record['command']}` ({record['seconds']:.0f} s). Recall = "
             f"|digest top-k ∩ exact-attention top-k| / k over the last "
             f"{a['queries']} positions of each window, every layer and kv head; k = {a['budget']} tokens / block "
             f"size; sink (1) and local (2) pages excluded on both sides; {a['windows']} windows per context; "
             f"mean (min–max over windows). *kind+rerankN*: the kind's top N·k pages, of which the k with the "
             f"largest exact q·k (`sparse.rerank=N`).", "",
             "| context | block | k pages | " + " | ".join(kinds) + " |", "|---" * (3 + len(kinds)) + "|"]
    for T in a["contexts"]:
        for bs in a["block_sizes"]:
            rs = [r for r in records if r["context"] == T and r["block_size"] == bs]
            cells = [f"{np.mean([r[k] for r in rs]):.3f} ({min(r[k] for r in rs):.2f}–{max(r[k] for r in rs):.2f})"
                     for k in kinds]
            lines.append(f"| {T} | {bs} | {a['budget'] // bs} | " + " | ".join(cells) + " |")
    return "\n".join(lines) + "\n"
