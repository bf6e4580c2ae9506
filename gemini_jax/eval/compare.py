"""Sparse vs dense on the shipped model: needle accuracy and bits per byte per context length,
from the committed result files of `experiments/run.py experiment=needle|perplexity`.

    python experiments/report.py --sparse-vs-dense --results-dir experiments/results/legacy
        # writes experiments/results/legacy/reports/sparse_vs_dense.md (files from before records
        # carried their commit; experiments/results/legacy/README.md)

Every figure is read from a JSON under the results directory (`needle/`, `perplexity/`; each file
records its own command and engine config); nothing is recomputed here. A missing file leaves its
column out.
"""

from __future__ import annotations

import json
import os

# (column, needle file(s), bpb file), paths under the results directory: the dense reference first.
VARIANTS = [
    ("dense", ["needle/needle_dense", "needle/needle_dense_32k"], "perplexity/bpb_dense"),
    ("sparse 1K", ["needle/needle_sparse_1k"], "perplexity/bpb_sparse_1k"),
    ("sparse 2K", ["needle/needle_sparse_2k"], "perplexity/bpb_sparse_2k"),
    ("compact 1K", ["needle/needle_compact_1k"], None),
    ("compact 2K", ["needle/needle_compact_2k_8k_100_alone", "needle/needle_compact_2k_32k_50_alone",
                    "needle/needle_compact_2k"], "perplexity/bpb_compact_2k"),
    ("compact 1.5K rerank", ["needle/needle_compact_1536_8k_100_rerank2", "needle/needle_compact_1536_32k_50_rerank2"],
     None),
]
GOAL_POINTS = 2.0  # needle: sparse within 2 points of dense
GOAL_BPB = 0.02  # bits per byte: sparse within 2 % of dense


def _load(results_dir: str, name: str):
    path = os.path.join(results_dir, name + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def needle_by_length(results_dir: str, names) -> dict[int, tuple[float, int]]:
    """length -> (accuracy, trials) from the first file that has the length."""
    out = {}
    for name in names:
        d = _load(results_dir, name)
        if d is None:
            continue
        for L, accs in zip(d["lengths"], d["accuracy"]):
            if L not in out:
                out[L] = (sum(accs) / len(accs), len(accs) * d["trials"])
    return out


def bpb_by_length(results_dir: str, name) -> dict[int, float]:
    d = _load(results_dir, name) if name else None
    # "records" in the common record format, "rows" in files written before it
    return {} if d is None else {r["context"]: r["bits_per_byte"] for r in d.get("records", d.get("rows"))}


# Paired runs: the same trials (length, depth, key, haystack) for dense and each sparse budget.
PAIRED = [("sparse 1K", "needle/needle_paired_4k_sparse_1k"), ("sparse 2K", "needle/needle_paired_4k_sparse_2k")]
PAIRED_DENSE = "needle/needle_paired_4k_dense"


def paired_rows(results_dir: str) -> list[str]:
    """Markdown rows: per sparse budget, accuracy of both, the discordant trials and the paired
    difference with a 95 % interval (normal approximation of the paired difference)."""
    dense = _load(results_dir, PAIRED_DENSE)
    if dense is None:
        return []
    ref = {(r["length"], r["depth"], i): r for i, r in enumerate(dense["records"])}
    rows = []
    for col, name in PAIRED:
        d = _load(results_dir, name)
        if d is None:
            continue
        pairs = []
        for i, r in enumerate(d["records"]):
            q = ref.get((r["length"], r["depth"], i))
            if q is None or q["key"] != r["key"]:
                raise ValueError(f"{name} record {i} is not paired with {PAIRED_DENSE} (different trial or key): "
                                 f"rerun both with the same experiment.lengths / depths / trials and seed.")
            pairs.append((q["ok"], r["ok"]))
        n = len(pairs)
        b = sum(1 for x, y in pairs if y and not x)  # sparse right, dense wrong
        c = sum(1 for x, y in pairs if x and not y)
        diff = (b - c) / n
        se = ((b + c) - (b - c) ** 2 / n) ** 0.5 / n
        lo, hi = 100 * (diff - 1.96 * se), 100 * (diff + 1.96 * se)
        within = "✓" if -GOAL_POINTS <= lo and hi <= GOAL_POINTS else ("✗" if hi < -GOAL_POINTS or lo > GOAL_POINTS
                                                                        else "unresolved")
        not_worse = "✓" if lo >= -GOAL_POINTS else ("✗" if hi < -GOAL_POINTS else "unresolved")
        rows.append(f"| {dense['lengths'][0]} | {col} | {n} | {100 * sum(x for x, _ in pairs) / n:.0f}% | "
                    f"{100 * sum(y for _, y in pairs) / n:.0f}% | {b} / {c} | {100 * diff:+.1f} [{lo:+.1f}, {hi:+.1f}] "
                    f"| {within} | {not_worse} |")
    return rows


def sparse_vs_dense(results_dir: str) -> str:
    """The markdown report from the result files under `results_dir` (see VARIANTS / PAIRED).
    Raises ValueError when a paired file's trials do not match the dense file's."""
    needles = {col: needle_by_length(results_dir, files) for col, files, _ in VARIANTS}
    bpbs = {col: bpb_by_length(results_dir, f) for col, _, f in VARIANTS}
    cols = [c for c, _, _ in VARIANTS if needles[c] or bpbs[c]]
    lengths = sorted({L for c in cols for L in list(needles[c]) + list(bpbs[c])})
    dense_n, dense_b = needles["dense"], bpbs["dense"]

    def n_cell(c, L):
        if L not in needles[c]:
            return "-"
        acc, n = needles[c][L]
        cell = f"{100 * acc:.0f}% ({n})"
        if c.startswith("sparse") and L in dense_n:
            d = 100 * (acc - dense_n[L][0])
            cell += f" {d:+.0f} {'✓' if abs(d) <= GOAL_POINTS else '✗'}"
        return cell

    def b_cell(c, L):
        if L not in bpbs[c]:
            return "-"
        v = bpbs[c][L]
        cell = f"{v:.3f}"
        if c != "dense" and L in dense_b:
            rel = (v - dense_b[L]) / dense_b[L]
            cell += f" {100 * rel:+.1f}%" + (f" {'✓' if abs(rel) <= GOAL_BPB else '✗'}" if c.startswith("sparse") else "")
        return cell

    lines = ["# Sparse vs dense attention, shipped tiny model, held-out stdlib text", "",
             "Built by `python experiments/report.py --sparse-vs-dense` from the result files named in each column's source "
             "(each records its command and engine). *sparse N* = Quest-style minmax selection with an N-token budget "
             "and true positions; *compact N* = the same with compact positions (the length-extrapolation option); "
             "*compact 1.5K rerank* = the `sparse=extrapolate_rerank` preset (1536-token budget, pages scored at "
             "distance 512, 2x candidates reranked by exact q.k over their keys; 10 depths x 10 / x 5 trials). "
             "Sparse runs use sparse prefill (the last 64 queries of each 1024-token chunk score pages) and sparse "
             "decode; dense runs read every page. Needle: exact match of a 5-digit key, 5 depths × 2 trials per "
             "length (dense 32K: 3 depths × 1 trial; trials in parentheses); sparse cells show the difference "
             "to dense in points (goal: within 2). Bits per byte: the last 128 bytes of 2 held-out windows per "
             "length, scored through the engine; sparse cells show the change vs dense (goal: within 2 %).", "",
             "## Needle accuracy", "", "| length | " + " | ".join(cols) + " |", "|---" * (len(cols) + 1) + "|"]
    lines += [f"| {L} | " + " | ".join(n_cell(c, L) for c in cols) + " |" for L in lengths]
    bcols = [c for c in cols if bpbs[c]]
    lines += ["", "## Bits per byte", "", "| length | " + " | ".join(bcols) + " |", "|---" * (len(bcols) + 1) + "|"]
    lines += [f"| {L} | " + " | ".join(b_cell(c, L) for c in bcols) + " |" for L in lengths if any(L in bpbs[c] for c in bcols)]
    paired = paired_rows(results_dir)
    if paired:
        lines += ["", "## Paired needle trials at 4K", "",
                  "The same 100 trials (10 depths × 10 keys) run through the dense and each sparse engine, so the "
                  "difference is measured trial by trial. *Discordant*: trials only sparse got right / only dense "
                  "got right. Interval: 95 %, normal approximation of the paired difference. *Within ±2*: ✓ when "
                  "the interval lies inside ±2 points, ✗ when it lies outside, *unresolved* when it straddles a "
                  "bound. *Not worse by > 2*: ✓ when the interval's lower end is ≥ −2 points.", "",
                  "| length | variant | trials | dense | sparse | discordant (sparse / dense) | difference, points "
                  "[95 %] | within ±2 | not worse by > 2 |",
                  "|---|---|---|---|---|---|---|---|---|"] + paired
    src = [f"`{f}`" for _, fs, b in VARIANTS for f in fs + ([b] if b else []) if _load(results_dir, f) is not None]
    src += [f"`{f}`" for f in [PAIRED_DENSE] + [n for _, n in PAIRED] if _load(results_dir, f) is not None]
    lines += ["", "Sources (experiments/results/<study>/*.json): " + ", ".join(src) + "."]
    return "\n".join(lines) + "\n"
