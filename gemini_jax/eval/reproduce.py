"""Does a committed figure still hold at this commit? Rerun a sample of a record's trials and compare.

Needle and bits-per-byte records keep every trial's outcome (the generated text; each window's
bits per byte), and each trial is drawn from its index alone (`gemini_jax.eval.trials`), so any
trial reruns on its own, through the engine configuration the record says it ran with. The paths
are deterministic on one machine: a needle trial must generate the same text; a window's bits per
byte must agree within `BPB_TOL` (scoring windows one group at a time changes the summation order,
nothing else: the engine's batched-scoring test holds that to 1e-5).

A full rerun of the long subsets takes hours of CPU; a sample of it, minutes. The sample is spread
evenly over the record's trials (first and last included), so every length, depth and window
position is represented.
"""

from __future__ import annotations

import numpy as np

from gemini_jax import tiny
from gemini_jax.config import EngineConfig, from_dict
from gemini_jax.engine import Engine
from gemini_jax.errors import ConfigError
from gemini_jax.eval.heldout import heldout_text
from gemini_jax.eval.needle import NeedlePrompts, answer, trial_example
from gemini_jax.eval.perplexity import window_bits, window_pair
from gemini_jax.eval.trials import Draw

BPB_TOL = 1e-4
SHIPPED = "shipped tiny model (gj.load_tiny())"
KINDS = ("needle", "perplexity")


def spread(total: int, n: int) -> list[int]:
    """n indices of range(total), evenly spread, first and last included (all of them if n >= total)."""
    if total <= 0 or n <= 0:
        raise ConfigError(f"a sample needs total > 0 and n > 0 (got total={total}, n={n}).")
    return sorted({int(round(x)) for x in np.linspace(0, total - 1, min(n, total))})


def draw_of(record: dict) -> Draw:
    seeds = record.get("seeds") or []
    if record.get("split") not in ("dev", "test") or len(seeds) != 1:
        raise ConfigError(f"record {record.get('name')!r} has split={record.get('split')!r} and seeds={seeds}: "
                          "only a record drawn from one seed of a dev / test split can be rerun.")
    return Draw(record["split"], int(seeds[0]))


def engine_for(record: dict, longest: int) -> Engine:
    """The engine the record ran with: its own `engine` config (max_seq_len raised to `longest`, as
    the job raised it) over the shipped model. Another model is refused: its weights are not here."""
    if record.get("model") != SHIPPED:
        raise ConfigError(f"record {record.get('name')!r} ran model {record.get('model')!r}; only records of the "
                          f"{SHIPPED} can be rerun here.")
    data = dict(record["engine"])
    data["max_seq_len"] = max(int(data.get("max_seq_len") or 0), longest)
    return Engine(tiny.load_tiny(), from_dict(EngineConfig, data, where=f"record {record['name']!r} engine"))


def rerun_needle(engine, record: dict, n: int, haystack: np.ndarray | None = None) -> dict:
    """Rerun n of the record's needle trials one by one; each must generate the recorded text."""
    cfg = record["config"]
    lengths, depths, trials = record["lengths"], record["depths"], int(record["trials"])
    draw = draw_of(record)
    haystack = heldout_text() if haystack is None else haystack
    if len(record["records"]) != len(lengths) * len(depths) * trials:
        raise ConfigError(f"record {record['name']!r} holds {len(record['records'])} trials, not "
                          f"{len(lengths)} x {len(depths)} x {trials}: it cannot be indexed.")
    rows = []
    for k in spread(len(record["records"]), n):
        cell, t = divmod(k, trials)
        i, j = divmod(cell, len(depths))
        ex = trial_example(haystack, lengths, depths, (i, j, t), draw,
                           NeedlePrompts(distractors=int(cfg.get("distractors", 0))))
        was = record["records"][k]
        if ex.answer != was["key"]:  # the trial drawn is not the one recorded: the draw itself changed
            raise ConfigError(f"record {record['name']!r} trial {k}: key {ex.answer!r} drawn now, "
                              f"{was['key']!r} recorded; the trial derivation changed.")
        now = answer(engine, [ex])[0]
        rows.append({"trial": k, "length": int(lengths[i]), "depth": float(depths[j]), "key": was["key"],
                     "recorded": was["generated"], "now": now, "equal": now == was["generated"]})
    return {"kind": "needle", "checked": len(rows), "equal": sum(r["equal"] for r in rows), "rows": rows}


def rerun_bpb(engine, record: dict, n: int, text: np.ndarray | None = None) -> dict:
    """Rerun n windows of each context of a bits-per-byte record, each in the batch the record
    scored it in (windows w // max_batch together, as `perplexity` groups them), and compare every
    window of those batches: each must agree within BPB_TOL. (A batch's other rows change the
    order of float sums by an ulp; quantized KV can round such a key to the next int8 step,
    which moves a window's figure by ~1e-4, so the batch is rerun whole.)"""
    draw = draw_of(record)
    text = heldout_text() if text is None else text
    step = max(1, int(engine.config.max_batch))
    rows = []
    for row in record["records"]:
        total = len(row["per_window"])
        starts = sorted({w // step * step for w in spread(total, n)})
        picks, now = [], []
        for g in starts:
            group = list(range(g, min(g + step, total)))
            pairs = [window_pair(text, int(row["context"]), int(row["scored_per_window"]), draw, w) for w in group]
            picks += group
            now += window_bits(engine, pairs, [len(t) for _, t in pairs])  # byte-model records
        for w, b in zip(picks, now):
            was = float(row["per_window"][w])
            rows.append({"context": int(row["context"]), "window": w, "recorded": was, "now": b,
                         "abs_diff": abs(b - was), "equal": abs(b - was) <= BPB_TOL})
    return {"kind": "bpb", "batches": True, "checked": len(rows), "equal": sum(r["equal"] for r in rows),
            "max_abs_diff": max(r["abs_diff"] for r in rows), "tolerance": BPB_TOL, "rows": rows}


def rerun(record: dict, n: int) -> dict:
    """Rerun a sample of a needle or perplexity record through the engine it names."""
    study = record.get("study")
    if study == "needle":
        return rerun_needle(engine_for(record, max(record["lengths"]) + 16), record, n)
    if study == "perplexity":
        return rerun_bpb(engine_for(record, max(r["context"] for r in record["records"]) + 16), record, n)
    raise ConfigError(f"record {record.get('name')!r} is a {study!r} record; only {KINDS} records can be rerun "
                      "trial by trial (rerun the others whole: `make results SUBSET=...`).")


def markdown(rec: dict) -> str:
    """The table of a reproduction record (`experiments/results.py --reproduce`)."""
    r = rec["outcome"]
    head = (f"### Reproduction of [{rec['source']}](../{rec['source']}.md) at `{rec['commit'][:7]}`\n\n"
            f"Recorded at `{rec['source_commit'][:7]}`; {r['checked']} trials rerun one by one through the engine "
            f"configuration the record names: **{r['equal']}/{r['checked']} reproduce**"
            + (f" (max |Δ bits/byte| {r['max_abs_diff']:.2e}, tolerance {r['tolerance']:.0e})" if r["kind"] == "bpb"
               else " (the same generated text)") + ".\n\n")
    if r["kind"] == "needle":
        rows = ["| trial | length | depth | key | recorded | now | same |", "|---|---|---|---|---|---|---|"]
        rows += [f"| {x['trial']} | {x['length']} | {x['depth']} | {x['key']} | `{x['recorded']!r}` | `{x['now']!r}` | "
                 f"{'✓' if x['equal'] else '✗'} |" for x in rec["records"]]
    else:
        rows = ["| context | window | recorded | now | abs diff | same |", "|---|---|---|---|---|---|"]
        rows += [f"| {x['context']} | {x['window']} | {x['recorded']:.6f} | {x['now']:.6f} | {x['abs_diff']:.1e} | "
                 f"{'✓' if x['equal'] else '✗'} |" for x in rec["records"]]
    return head + "\n".join(rows) + "\n"
