"""Study `align_pages`: do syntax-aligned pages (`cache.align="syntax"`) help sparse attention on code?

Haystacks are held-out standard-library Python. Two measures, fixed pages against aligned pages at the
same sparse budget (the same number of pages read, so the same KV bytes; aligned pages hold fewer
tokens, their padding counted in the bytes):

- needle: a pass key planted at a depth of a `length`-token prompt, answered greedily by the shipped
  model through the engine, sparse with fixed pages, sparse with aligned pages, and dense (the
  ceiling). The same trials for each, so differences are paired (Newcombe's interval).
- digest recall: for windows of the same text, the share of the k pages carrying the most exact
  attention mass that the minmax digests pick (`gemini_jax.eval.recall`), each layout scored on its
  own pages (k = budget / block size, sink and local pages excluded), paired per window.

Every trial comes from the test split; nothing here is tuned (the budget is a quarter of the context,
chosen before any run).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SparseConfig
from gemini_jax.data import tasks
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.intervals import mean_t95, paired_difference, wilson
from gemini_jax.eval.needle import answer, is_correct, trial_example
from gemini_jax.eval.recall import RecallSetting, digest_recall
from gemini_jax.eval.record import StudyResult
from gemini_jax.eval.studies import as_tuple
from gemini_jax.eval.trials import Draw
from gemini_jax.runtime import aligned
from gemini_jax.tokenizer import ByteTokenizer

MODES = ("dense", "fixed", "aligned", "aligned_methods")  # aligned: top-level definitions; _methods: depth 1 too


@dataclass(frozen=True, kw_only=True)
class Config:
    lengths: tuple[int, ...] = (2048,)
    depths: tuple[float, ...] = (0.1, 0.3, 0.5, 0.7, 0.9)
    trials: int = 40                # needles per (length, depth)
    budget: int = 512               # sparse tokens per (sequence, kv head, layer), sink and local included
    block_size: int = 16
    sink_pages: int = 1
    local_pages: int = 2
    windows: int = 16               # digest-recall windows per length
    queries: int = 16               # last positions of each window scored
    seed: int = 0
    out_name: str = "align_pages"

    def __post_init__(self):
        as_tuple(self, "lengths", int)
        as_tuple(self, "depths", float)


def engine_config(cfg: Config, mode: str, length: int) -> EngineConfig:
    """The engine of one mode. Room for the padding of aligned pages: an eighth of the context (the
    layout is checked against it; a prompt needing more is refused, not truncated)."""
    sparse = SparseConfig(enabled=mode != "dense", budget=cfg.budget, sink_pages=cfg.sink_pages,
                          local_pages=cfg.local_pages)
    cache = CacheConfig(block_size=cfg.block_size, align="syntax" if mode.startswith("aligned") else "none",
                        align_depth=1 if mode == "aligned_methods" else 0)
    return EngineConfig(max_seq_len=length + length // 8 + 32, max_batch=1, prefill_chunk=512, cache=cache,
                        sparse=sparse, decode_steps_per_call=1)


ALIGNED = ("aligned", "aligned_methods")


def run(cfg: Config) -> StudyResult:
    model = gj.load_tiny()
    hay = heldout_text()
    draw = Draw("test", cfg.seed)
    records = []
    t0 = time.time()
    n_needles = len(cfg.lengths) * len(cfg.depths) * cfg.trials
    bar = tqdm(total=n_needles + len(cfg.lengths) * cfg.windows, desc="align_pages", unit="trial")
    for i, L in enumerate(cfg.lengths):
        engines = {m: gj.Engine(model, engine_config(cfg, m, L)) for m in MODES}
        try:
            for j, depth in enumerate(cfg.depths):
                for t in range(cfg.trials):
                    ex = trial_example(hay, cfg.lengths, cfg.depths, (i, j, t), draw)
                    row = {"kind": "needle", "length": L, "depth": depth, "trial": t, "key": ex.answer}
                    for m, eng in engines.items():
                        if m in ALIGNED:
                            row[f"{m}_pads"] = int(np.sum(aligned.slot_tokens(eng.config, ex.prompt) == aligned.PAD))
                        before = eng.stats["kv_bytes_read"]
                        text = answer(eng, [ex])[0]
                        row[f"{m}_ok"] = bool(is_correct(text, ex.answer))
                        row[f"{m}_answer"] = text
                        row[f"{m}_kv_bytes"] = int(eng.stats["kv_bytes_read"] - before)
                    records.append(row)
                    bar.update(1)
        finally:
            for eng in engines.values():
                eng.close()
        setting = RecallSetting(block_size=cfg.block_size, k_pages=(cfg.budget // cfg.block_size) - cfg.sink_pages
                                - cfg.local_pages, sink_pages=cfg.sink_pages, local_pages=cfg.local_pages)
        for w in range(cfg.windows):
            toks = np.concatenate([[ByteTokenizer.BOS], tasks.text_window(hay, L - 1, draw.rng(i, 1000 + w))]).astype(np.int32)
            row = {"kind": "recall", "length": L, "window": w,
                   "fixed_recall": digest_recall(model, toks, setting, kinds=("minmax",), queries=cfg.queries)["minmax"]}
            for m in ALIGNED:
                layout = aligned.slot_tokens(engine_config(cfg, m, L), toks)
                slots = np.flatnonzero(layout != aligned.PAD)
                row[f"{m}_pads"] = int(len(layout) - len(toks))
                row[f"{m}_recall"] = digest_recall(model, toks, setting, kinds=("minmax",), queries=cfg.queries,
                                                   slots=slots)["minmax"]
            records.append(row)
            bar.update(1)
    bar.close()
    return StudyResult(name=cfg.out_name, records=records, split="test", seeds=[cfg.seed],
                       extra={"seconds": time.time() - t0, "summary": summarize(records)})


def summarize(records: list) -> dict:
    """Per length and aligned layout: needle hits per mode with Wilson intervals, the layout - fixed
    pages paired (Newcombe), KV bytes per mode; recall mean per layout with t intervals and the paired
    mean difference; a verdict."""
    out = {}
    for L in sorted({r["length"] for r in records}):
        needles = [r for r in records if r["kind"] == "needle" and r["length"] == L]
        recalls = [r for r in records if r["kind"] == "recall" and r["length"] == L]
        base = {"length": L}
        if needles:
            n = len(needles)
            for m in MODES:
                hits = sum(r[f"{m}_ok"] for r in needles)
                base[m] = {"hits": hits, "trials": n, "ci95": list(wilson(hits, n)),
                           "kv_bytes_per_trial": float(np.mean([r[f"{m}_kv_bytes"] for r in needles]))}
        if recalls:
            m, lo, hi = mean_t95([r["fixed_recall"] for r in recalls])
            base["fixed_recall"] = {"mean": m, "ci95": [lo, hi], "windows": len(recalls)}
        for lay in ALIGNED:
            s = {}
            if needles:
                a, f = [r[f"{lay}_ok"] for r in needles], [r["fixed_ok"] for r in needles]
                counts = (sum(x and y for x, y in zip(a, f)), sum(x and not y for x, y in zip(a, f)),
                          sum(y and not x for x, y in zip(a, f)), sum(not x and not y for x, y in zip(a, f)))
                d, lo, hi = paired_difference(*counts)
                s["needle_diff"] = {"points": 100 * d, "ci95": [100 * lo, 100 * hi], "fixed_by_aligned": counts[1],
                                    "lost_by_aligned": counts[2]}
                s["pads_per_prompt"] = float(np.mean([r[f"{lay}_pads"] for r in needles]))
                s["kv_bytes_vs_fixed"] = base[lay]["kv_bytes_per_trial"] / base["fixed"]["kv_bytes_per_trial"]
            if recalls:
                m, lo, hi = mean_t95([r[f"{lay}_recall"] for r in recalls])
                s["recall"] = {"mean": m, "ci95": [lo, hi]}
                m, lo, hi = mean_t95([r[f"{lay}_recall"] - r["fixed_recall"] for r in recalls])
                s["recall_diff"] = {"mean": m, "ci95": [lo, hi], "windows": len(recalls)}
            s["verdict"] = verdict(s)
            base[lay + "_vs_fixed"] = s
        out[str(L)] = base
    return out


def verdict(s: dict) -> str:
    """'helps' / 'hurts' when the interval of a paired difference excludes 0 and the other measure's
    does not exclude it the other way; 'mixed' when they disagree; else 'no measurable difference'."""
    signs = []
    for key in ("needle_diff", "recall_diff"):
        if key in s:
            lo, hi = s[key]["ci95"]
            signs.append(1 if lo > 0 else -1 if hi < 0 else 0)
    if 1 in signs and -1 in signs:
        return "mixed"
    if 1 in signs:
        return "helps"
    if -1 in signs:
        return "hurts"
    return "no measurable difference"


LABELS = {"aligned": "top-level definitions", "aligned_methods": "definitions and methods"}


def markdown(record: dict) -> str:
    a = record["config"]
    lines = ["# Syntax-aligned vs fixed KV pages on code (sparse attention, shipped tiny model)", "",
             f"Run {record['date']}, command `{record['command']}` ({record['seconds']:.0f} s), commit "
             f"`{record['commit']}`. Held-out standard-library Python, test split, seed {a['seed']}. Sparse "
             f"budget {a['budget']} tokens per (sequence, kv head, layer) with sink {a['sink_pages']} and local "
             f"{a['local_pages']} pages, pages of {a['block_size']} tokens, the same for every layout (the same "
             f"number of pages read: the same KV bytes, though aligned pages hold fewer tokens). Needle: "
             f"{a['trials']} trials per depth {list(a['depths'])}, the same prompts for every mode; recall: "
             f"{a['windows']} windows, last {a['queries']} positions, minmax digests, each layout on its own pages.",
             ""]
    for base in record["summary"].values():
        def acc(m):
            c = base[m]
            return f"{c['hits']}/{c['trials']} [{100 * c['ci95'][0]:.0f}–{100 * c['ci95'][1]:.0f}%]"
        fr = base.get("fixed_recall")
        lines += [f"Context {base['length']}: dense needle {acc('dense')}; sparse, fixed pages: needle {acc('fixed')}, "
                  f"recall {fr['mean']:.3f} [{fr['ci95'][0]:.3f}, {fr['ci95'][1]:.3f}].", "",
                  "| pages start at | needle | vs fixed (paired, 95%) | KV bytes vs fixed | padding slots per "
                  "prompt | recall | vs fixed (95%) | alignment |", "|---" * 8 + "|"]
        for lay in ALIGNED:
            s = base[lay + "_vs_fixed"]
            nd, rd = s["needle_diff"], s["recall_diff"]
            lines.append(
                f"| {LABELS[lay]} | {acc(lay)} | {nd['points']:+.1f} [{nd['ci95'][0]:+.1f}, {nd['ci95'][1]:+.1f}] "
                f"points ({nd['fixed_by_aligned']} fixed, {nd['lost_by_aligned']} lost) | {s['kv_bytes_vs_fixed']:.3f}× | "
                f"{s['pads_per_prompt']:.0f} | {s['recall']['mean']:.3f} | {rd['mean']:+.3f} [{rd['ci95'][0]:+.3f}, "
                f"{rd['ci95'][1]:+.3f}] | **{s['verdict']}** |")
        lines.append("")
    return "\n".join(lines)
