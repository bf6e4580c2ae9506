"""The generated results tables of docs/results.md, and the checks every committed result file must pass.

A block is the text between `<!-- results:NAME -->` and `<!-- /results:NAME -->` in docs/results.md;
it is rendered here from the record files under experiments/results/ and nothing else, so
`python experiments/results.py --render` rewrites it and tests/test_results_files.py fails when
the page and the files disagree. A record that a subset has not produced yet renders as
"not run yet" with the command that makes it, never as a number. Links in a block are relative to
docs/ (`LINK_BASE`).
"""

from __future__ import annotations

import json
import os
import re

from gemini_jax.eval.intervals import mean_t95, paired_difference, wilson
from gemini_jax.eval.ruler_grid import MODE_NAMES as RULER_MODES, with_columns

# docs/architecture.md §9: every committed result records these
REQUIRED = ("command", "config", "commit", "split", "seeds")
NEEDLE_GOAL = 0.95  # needle exact match at 8K and 32K with compact positions (the shipped presets' goal)
COMMIT = re.compile(r"^[0-9a-f]{40}$")
DOC = os.path.join("docs", "results.md")  # the page the blocks live in, relative to the checkout
LINK_BASE = "../experiments/results"  # experiments/results/ as a link from DOC


# ---- checks ---------------------------------------------------------------------------------
def record_problems(record) -> list[str]:
    """What a committed result record lacks: the required keys, a clean 40-hex commit (a figure from
    uncommitted code cannot be regenerated), a dev / test split with its seeds when trials were drawn."""
    if not isinstance(record, dict):
        return [f"is a {type(record).__name__}, not a record (a JSON object)"]
    out = [f"lacks '{k}'" for k in REQUIRED if k not in record]
    if not out:
        if not isinstance(record["command"], str) or not record["command"].strip():
            out.append("has an empty command")
        if not isinstance(record["commit"], str) or not COMMIT.match(record["commit"]):
            out.append(f"commit {record['commit']!r} is not a clean 40-hex commit (uncommitted code, or none)")
        if record["split"] not in (None, "dev", "test"):
            out.append(f"split {record['split']!r} is not dev, test or null")
        if record["split"] is not None and not (isinstance(record["seeds"], list) and record["seeds"]):
            out.append(f"split {record['split']} drew trials but seeds is {record['seeds']!r}")
    return out


# experiments/results/gpu/: what experiments/gpu_check.sh measured on a lent GPU machine. `make results`
# cannot rerun them here (no GPU), and the machine's copy of the checkout can trail the commit its files
# were copied from (its records may say "<commit>+dirty"); gpu/README.md says which code they measured.
GPU = "gpu"


def result_files(results_dir: str) -> list[str]:
    """The JSON records under results_dir, as paths relative to it."""
    current = []
    for dirpath, _, files in os.walk(results_dir):
        for f in files:
            rel = os.path.relpath(os.path.join(dirpath, f), results_dir)
            if rel.split(os.sep)[0] == GPU:  # device records: their README says how they were made
                continue
            if f.endswith(".json"):
                current.append(rel)
    return sorted(current)


# ---- rendering ------------------------------------------------------------------------------
def _load(results_dir: str, record: str):
    path = os.path.join(results_dir, record + ".json")
    if not os.path.exists(path):
        return None
    with open(path) as fh:
        return json.load(fh)


def _pct(hits: int, n: int) -> str:
    lo, hi = wilson(hits, n)
    return f"{100 * hits / n:.1f}% [{100 * lo:.1f}, {100 * hi:.1f}] ({hits}/{n})"


def _link(record: str) -> str:
    return f"[{record.split('/')[-1]}]({LINK_BASE}/{record}.md)"


def _missing(subset: str) -> str:
    return f"not run yet (`make results SUBSET={subset}`)"


def _length_label(L: int) -> str:
    """1024 -> '1K'; a length that is no multiple of 1024 in tokens (8000 -> '8,000')."""
    return f"{L // 1024}K" if L % 1024 == 0 else f"{L:,}"


def _commits(recs) -> str:
    seen = sorted({r["commit"][:7] for r in recs if r is not None})
    return ", ".join(f"`{c}`" for c in seen) if seen else "—"


def needle_block(results_dir: str) -> str:
    rows = ["| preset | context | test trials: exact match [95% Wilson] | dev trials (knobs chosen here) | "
            "goal ≥ 95% (test estimate) | files |", "|---|---|---|---|---|---|"]
    loaded = []
    for preset, key in (("`sparse=extrapolate_rerank`", "rerank"), ("`sparse=extrapolate`", "extrapolate")):
        for length, tag in ((8192, "8k"), (32768, "32k")):
            test, dev = (_load(results_dir, f"needle/{key}_{tag}_{s}") for s in ("test", "dev"))
            loaded += [test, dev]
            cells = []
            for rec in (test, dev):
                bl = rec["by_length"][0] if rec else None
                cells.append(_pct(bl["hits"], bl["trials"]) if bl else _missing("needle"))
            met = "—"
            if test:
                bl = test["by_length"][0]
                met = "✓" if bl["accuracy"] >= NEEDLE_GOAL else "✗"
                if met == "✓" and bl["ci95"][0] < NEEDLE_GOAL:
                    met += " (interval reaches below)"
            files = " / ".join(_link(f"needle/{key}_{tag}_{s}") for s, r in (("test", test), ("dev", dev)) if r)
            rows.append(f"| {preset} | {length // 1024}K | {cells[0]} | {cells[1]} | {met} | {files or '—'} |")
    dense = _load(results_dir, "needle/dense_test")
    loaded.append(dense)
    if dense:
        for bl in dense["by_length"]:
            rows.append(f"| dense attention | {bl['length'] // 1024}K | {_pct(bl['hits'], bl['trials'])} | — "
                        f"(no knob) | — | {_link('needle/dense_test')} |")
    else:
        rows.append(f"| dense attention | 1K–8K | {_missing('needle')} | — | — | — |")
    return "\n".join(rows + ["", f"Commit(s) the files came from: {_commits(loaded)}."])


SMOLLM2_QUANT_POINTS = 3.0  # int8 KV non-inferior: the paired interval's lower end >= -3 points ...
SMOLLM2_QUANT_PAIRS = 300  # ... pooled over lengths, with at least this many pairs


def _quant_needle_ok(p: dict) -> bool:
    """The SmolLM2 quantized-needle goal on a `paired_needle` result: non-inferior over enough pairs."""
    return p["lo"] >= -SMOLLM2_QUANT_POINTS and p["n"] >= SMOLLM2_QUANT_PAIRS


def smollm2_needle_block(results_dir: str) -> str:
    """SmolLM2-135M-Instruct: dense vs sparse at budgets 512 / 1024 / 2048 tokens and int8 KV vs
    float32, on the same test trials (chat prompts); below, the quantized-KV decisions on 300 pairs."""
    columns = {"dense": "dense", "quest512": "sparse, budget 512", "quest1024": "sparse, budget 1024",
               "quest2048": "sparse, budget 2048", "quest1024_mean": "sparse 1024, mean digests",
               "int8_dense": "int8 KV, dense", "rerank_b4096_mean": "compact + rerank 4096, mean digests"}
    recs = {name: _load(results_dir, f"needle/smollm2_{name}_test") for name in columns}
    if not any(recs.values()):
        return _missing("smollm2")
    shown = {name: r for name, r in recs.items() if r or name in ("dense", "quest1024", "int8_dense")}
    lengths = sorted({bl["length"] for r in recs.values() if r for bl in r["by_length"]})
    rows = ["| context | " + " | ".join(columns[n] for n in shown) + " | int8 − float32 [paired 95%] |",
            "|---|" + "---|" * (len(shown) + 1)]
    dense, int8 = recs["dense"], recs["int8_dense"]
    for length in lengths:
        cells = []
        for rec in shown.values():
            bl = next((b for b in rec["by_length"] if b["length"] == length), None) if rec else None
            cells.append(_pct(bl["hits"], bl["trials"]) if bl else "—")
        pair = "—"
        if dense and int8 and any(b["length"] == length for b in int8["by_length"]):
            p = paired_needle(int8, dense, length)
            pair = f"{p['diff']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}] points ({p['fixed']} fixed, {p['lost']} lost)"
        label = _length_label(length) + ("" if length % 1024 == 0 else " tokens")
        rows.append(f"| {label} | {' | '.join(cells)} | {pair} |")
    files = " / ".join(_link(f"needle/smollm2_{name}_test") for name, r in recs.items() if r)
    tail = [f"Test trials, 5 depths x 2 trials per context, the same prompts in every column (8000 tokens: the "
            f"prompt and its answer inside the model's 8K window); sparse columns are `sparse=quest` with dense "
            f"prefill, budget in tokens (—: not run at that context, where the budget covers most of it); compact + "
            f"rerank is `sparse=extrapolate_rerank` past the 8K window (sparse prefill, compact positions); files "
            f"{files}; commit(s) {_commits(recs.values())}."]
    if dense and int8:
        p = paired_needle(int8, dense)
        ok = _quant_needle_ok(p)
        tail.append(f"int8 KV against float32, pooled over the lengths both hold: {p['diff']:+.1f} "
                    f"[{p['lo']:+.1f}, {p['hi']:+.1f}] points over {p['n']} pairs (same text {p['same_text']}/{p['n']}). "
                    f"Goal: the interval's lower end ≥ −{SMOLLM2_QUANT_POINTS:.0f} points over ≥ {SMOLLM2_QUANT_PAIRS} "
                    f"pairs {'✓' if ok else '✗'}" + ("" if ok or p["n"] >= SMOLLM2_QUANT_PAIRS else
                                                     f" ({p['n']} pairs: too few to decide)") + ".")
    # The decisions: 30 trials per (length, depth) at 1K and 2K, float32 and each KV dtype on the same prompts.
    f32 = _load(results_dir, "needle/smollm2_f32_pairs_test")
    for tag in ("int8", "fp8"):
        q = _load(results_dir, f"needle/smollm2_{tag}_pairs_test")
        if not (f32 and q):
            continue
        p = paired_needle(q, f32)
        ok = _quant_needle_ok(p)
        tail.append(f"{tag} KV against float32 on {p['n']} paired test trials at 1K and 2K (5 depths x 30 trials per "
                    f"length; float32 {p['base']}/{p['n']}, {tag} {p['quant']}/{p['n']}; "
                    f"{_link('needle/smollm2_f32_pairs_test')} / {_link(f'needle/smollm2_{tag}_pairs_test')}, "
                    f"commit(s) {_commits([f32, q])}): {p['diff']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}] points, "
                    f"{p['fixed']} fixed, {p['lost']} lost, same text {p['same_text']}/{p['n']}. Goal: lower end "
                    f"≥ −{SMOLLM2_QUANT_POINTS:.0f} points over ≥ {SMOLLM2_QUANT_PAIRS} pairs {'✓' if ok else '✗'}.")
    return "\n".join(rows + [""] + tail)


SMOLLM2_BPB_MARGIN = 0.01  # quantized KV non-inferior on bits per byte: paired upper end <= +0.01 bits/byte


def smollm2_bpb_block(results_dir: str) -> str:
    """SmolLM2: bits per byte with float32, int8 and fp8 KV on the same test windows, quantized minus
    float32 paired by window."""
    recs = {tag: _load(results_dir, f"perplexity/smollm2_bpb_{tag}_test") for tag in ("f32", "int8", "fp8")}
    base = recs["f32"]
    if base is None:
        return _missing("smollm2")
    rows = ["| KV dtype | context (tokens) | bits/byte [95% t over windows] | − float32, paired [95%] | "
            f"goal: upper end ≤ +{SMOLLM2_BPB_MARGIN} | file |", "|---|---|---|---|---|---|"]
    for tag, rec in recs.items():
        if rec is None:
            continue
        for r in rec["records"]:
            b = next(x for x in base["records"] if x["context"] == r["context"])
            cell, goal = "—", "—"
            if tag != "f32":
                n = min(len(r["per_window"]), len(b["per_window"]))  # the first windows are the same ones
                diff, lo, hi = mean_t95([q - f for q, f in zip(r["per_window"][:n], b["per_window"][:n])])
                cell = f"{diff:+.4f} [{lo:+.4f}, {hi:+.4f}] ({n} windows)"
                goal = "✓" if hi <= SMOLLM2_BPB_MARGIN else "✗"
            rows.append(f"| {'float32' if tag == 'f32' else tag} | {r['context']} | {r['bits_per_byte']:.4f} "
                        f"[{r['ci95'][0]:.4f}, {r['ci95'][1]:.4f}] | {cell} | {goal} | "
                        f"{_link(f'perplexity/smollm2_bpb_{tag}_test')} |")
    w = base["records"][0]
    tail = (f"Test windows of held-out standard-library text, {w['windows']} windows x the last "
            f"{w['scored_per_window']} of {w['context']} tokens scored (about {w['scored_bytes_mean']:.0f} bytes a "
            f"window) through `engine.score`, dense attention; bits over the UTF-8 bytes the scored tokens decode "
            f"to. Commit(s) the files came from: {_commits(recs.values())}.")
    return "\n".join(rows + ["", tail])


def bpb_block(results_dir: str) -> str:
    lengths = (2048, 4096, 8192, 16384, 32768)
    rows = ["| preset | trials | " + " | ".join(f"{L // 1024}K" for L in lengths) + " | file |",
            "|---|---|" + "---|" * len(lengths) + "---|"]
    loaded = []
    for preset, key in (("`sparse=extrapolate`", "extrapolate"), ("dense attention", "dense")):
        for split in ("test", "dev"):
            rec = _load(results_dir, f"perplexity/bpb_{key}_{split}")
            loaded.append(rec)
            if rec is None:
                rows.append(f"| {preset} | {split} | " + " | ".join(["—"] * len(lengths)) + f" | {_missing('bpb')} |")
                continue
            by = {r["context"]: r for r in rec["records"]}
            cells = [f"{by[L]['bits_per_byte']:.3f} [{by[L]['ci95'][0]:.3f}, {by[L]['ci95'][1]:.3f}]" if L in by
                     else "—" for L in lengths]
            w = rec["records"][0]
            rows.append(f"| {preset} | {split} ({w['windows']} × {w['scored_per_window']} B) | " + " | ".join(cells)
                        + f" | {_link(f'perplexity/bpb_{key}_{split}')} |")
    uni = next((r["unigram_bits_per_byte"] for r in loaded if r), None)
    tail = f"Unigram baseline: {uni:.3f} bits/byte. " if uni is not None else ""
    return "\n".join(rows + ["", tail + f"Commit(s) the files came from: {_commits(loaded)}."])


def make_run_block(results_dir: str) -> str:
    recs = {n: r for n in ("make_run", "make_run_dense") if (r := _load(results_dir, f"fullstack/{n}"))}
    if "make_run" not in recs:
        return _missing("fullstack")
    rows = ["| | " + " | ".join(f"`{n}`" for n in recs) + " |", "|---|" + "---|" * len(recs)]
    rows += [f"| {k} | " + " | ".join(str(r["table"].get(k, "—")) for r in recs.values()) + " |" for k in recs["make_run"]["table"]]
    return "\n".join(rows + ["", f"From {' / '.join(_link('fullstack/' + n) for n in recs)}, commit(s) {_commits(recs.values())}, "
                                 f"seed {recs['make_run']['seeds'][0]}; `make_run_dense`: the same job, `engine.sparse.enabled=false`."])


def exactness_block(results_dir: str) -> str:
    rec = _load(results_dir, "exactness/exactness")
    if rec is None:
        return _missing("exactness")
    paths = {}
    for r in rec["records"]:
        paths.setdefault(r["path"], []).append(r)
    rows = ["| path | families | max abs logit error | max relative error | tolerance the tests assert | within |",
            "|---|---|---|---|---|---|"]
    for path, rs in paths.items():
        measured = [r for r in rs if r.get("max_abs_err") is not None]
        if not measured:
            rows.append(f"| {path} | {', '.join(r['family'] for r in rs)} | — | — | — | {rs[0].get('note', '')} |")
            continue
        tol = rs[0]["tolerance_asserted_in_tests"]
        tol_s = (f"{tol:g} on {rs[0]['tolerance_on']}" if tol is not None else "tokens equal").replace("|", "\\|")
        ok = all(r["within_tolerance"] for r in measured)
        rows.append(f"| {path} | {', '.join(r['family'] for r in measured)} | "
                    f"{max(r['max_abs_err'] for r in measured):.2e} | {max(r['max_rel_err'] for r in measured):.2e} | "
                    f"{tol_s} | {'✓' if ok else '✗'} |")
    return "\n".join(rows + ["", f"fp32; from {_link('exactness/exactness')}, commit `{rec['commit'][:7]}`, "
                                 f"seed {rec['seeds'][0]}."])


def _mark(rec) -> str:
    return "" if "goal_met" not in rec else (" ✓" if rec["goal_met"] else " ✗")


def decode_block(results_dir: str) -> str:
    rec = _load(results_dir, "bench_decode/bench")
    if rec is None:
        return _missing("decode")
    hf = rec["rows"]["decode_steps_vs_hf"]["records"]
    bw = rec["rows"]["decode_bandwidth"]["records"]
    ks = sorted({int(r["variant"].split("=")[1]) for r in hf if r["variant"] != "transformers"})
    rows = ["| prompt | batch | transformers tokens/s | " + " | ".join(f"k={k}: ours / HF" for k in ks) + " |",
            "|---|---|---|" + "---|" * len(ks)]
    for plen, batch in dict.fromkeys((r["prompt_len"], r["batch"]) for r in hf):
        cell = {r["variant"]: r for r in hf if (r["prompt_len"], r["batch"]) == (plen, batch)}
        base = cell["transformers"]
        rows.append(f"| {plen} | {batch} | {base['tokens_per_s']:.1f} | " + " | ".join(
            f"{c['vs_hf_ratio']:.2f}× ({c['vs_hf_ratio_min']:.2f}–{c['vs_hf_ratio_max']:.2f}){_mark(c)}"
            for c in (cell[f"ours k={k}"] for k in ks)) + " |")
    rows += ["", "| context | batch | " + " | ".join(f"k={k}: of bound (tokens/s)" for k in ks) + " |",
             "|---|---|" + "---|" * len(ks)]
    for context, batch in dict.fromkeys((r["context"], r["batch"]) for r in bw):
        cell = {r["k"]: r for r in bw if (r["context"], r["batch"]) == (context, batch)}
        rows.append(f"| {context} | {batch} | " + " | ".join(
            f"{c['fraction_of_bound']:.0%} ({batch / c['step_seconds_median']:.1f}){_mark(c)}"
            for c in (cell[k] for k in ks)) + " |")
    gbs = bw[0]["bandwidth_gbs"] if bw else float("nan")
    # transformers against the same bound: bytes our batch-1 step reads at that context (weights +
    # KV, from the bandwidth row) times its tokens/s; and what the 2x goal needs for the weights alone.
    ours1 = {r["context"]: r for r in bw if r["batch"] == 1 and r["k"] == 1}
    notes = []
    for r in hf:
        if r["variant"] == "transformers" and r["batch"] == 1 and r["prompt_len"] in ours1:
            o = ours1[r["prompt_len"]]
            rate = (o["weight_bytes_per_step"] + o["kv_bytes_per_step"]) * r["tokens_per_s"] / 1e9
            notes.append(f"transformers at {r['prompt_len']}, batch 1, reads about {rate:.1f} GB/s "
                         f"({rate / gbs:.0%} of the bound).")
        if r["variant"] == "transformers" and (r["prompt_len"], r["batch"]) == (2048, 1) and bw:
            need = 2 * r["tokens_per_s"] * bw[0]["weight_bytes_per_step"] / 1e9
            notes.append(f"2× transformers at 2K needs ≥ {need:.1f} GB/s for the weights alone "
                         f"(measured bandwidth {gbs:.1f} GB/s).")
    return "\n".join(rows + ["", " ".join(notes), "", *profile_lines(results_dir), f"Goals: batch 1 at 2K ≥ 2× transformers; ≥ 60% of the bandwidth bound "
                                 f"(weights + KV bytes per step at the {gbs:.1f} GB/s measured in the same run) "
                                 f"at 16K. Ratios are medians of per-repeat ratios (min–max), all variants "
                                 f"interleaved in one process. From [BENCH.md]({LINK_BASE}/bench_decode/BENCH.md) "
                                 f"(raw: `bench.json`), commit `{rec['commit'][:7]}`, seed {rec['seeds'][0]}."])


def profile_lines(results_dir: str) -> list[str]:
    """Where a batch-1 step's time goes (the `decode_profile` bench row), when its record exists."""
    from gemini_jax.bench.rows.decode_profile import summary_lines

    rec = _load(results_dir, "bench_profile/bench")
    return [] if rec is None else summary_lines(rec, f"{LINK_BASE}/bench_profile/BENCH.md")


TIER_LINKS = ("real", "nominal PCIe 5", "h200 PCIe 4", "h200 PCIe 5", "l40s PCIe 5", "rtx4090 PCIe 5")


def tiers_block(results_dir: str) -> str:
    rec = _load(results_dir, "bench_tiers/bench")
    if rec is None:
        return _missing("tiers")
    recs = [r for r in rec["rows"]["tiers_link"]["records"] if "metric" not in r]
    links = [ln for ln in TIER_LINKS if any(r["link"] == ln for r in recs)]
    rows = ["| context | device | depth | " + " | ".join(links) + " |", "|---|---|---|" + "---|" * len(links)]
    cell = {(r["context"], r["device_fraction"], r["prefetch_depth"], r["link"]): r for r in recs}

    def fmt(r):
        hit = "-" if r["hit_rate"] is None else f"{r['hit_rate']:.0%}"
        return f"{r['speed_vs_all_resident_ratio']:.2f}× · {hit}"

    for context, share, depth in dict.fromkeys((r["context"], r["device_fraction"], r["prefetch_depth"]) for r in recs):
        rows.append(f"| {context} | {share:.0%} | {depth} | " + " | ".join(
            fmt(cell[context, share, depth, ln]) if (context, share, depth, ln) in cell else "-" for ln in links) + " |")
    goals = []
    for r in recs:
        if r["device_fraction"] == 0.25 and r["prefetch_depth"] == 2 and r["link"].endswith("PCIe 5"):
            ok = r["speed_vs_all_resident_ratio"] >= 0.9 and (r["hit_rate"] or 0) >= 0.95
            goals.append(f"{r['context']}, {r['link']}: {r['speed_vs_all_resident_ratio']:.2f}× and "
                         f"{(r['hit_rate'] or 0):.0%} {'✓' if ok else '✗'}")
    still = [f"{r['context']}: {r['speed_vs_all_resident_ratio']:.2f}× {'✓' if r['speed_vs_all_resident_ratio'] >= 0.95 else '✗'}"
             for r in recs if r["device_fraction"] == 1.0 and r["prefetch_depth"] == 0 and r["link"] == "real"]
    same = all(r["tokens_equal_all_resident"] for r in recs)
    return "\n".join(rows + [
        "", "Cells: speed vs all-resident (median of per-repeat ratios) · prefetch hit rate (pages that had landed "
        "when their layer needed them). Goal, 25% device, depth 2, PCIe 5 (≥ 0.9× and ≥ 95%): " + "; ".join(goals)
        + ". Goal, real links with no page moving (100%, depth 0, ≥ 0.95×): " + "; ".join(still)
        + f". Greedy tokens equal to the all-resident engine's in every cell: {'✓' if same else '✗'}. Every link, "
        f"the matched time scales and the min–max of each ratio: [BENCH.md]({LINK_BASE}/bench_tiers/BENCH.md) "
        f"(raw: `bench.json`), commit `{rec['commit'][:7]}`, seed {rec['seeds'][0]}."])


def prefix_block(results_dir: str) -> str:
    rec = _load(results_dir, "persistent_prefix/persistent_prefix")
    if rec is None:
        return _missing("prefix")
    s = rec["summary"]
    mark = lambda ok: "✓" if ok else "✗"  # noqa: E731
    rows = ["| step (each its own process) | time to first token | prompt tokens reused | computed |", "|---|---|---|---|"]
    rows += [f"| {r['step']} | {r['ttft_seconds']:.2f} s | {r['prefill_tokens_reused']} | {r['prefill_tokens_computed']} |"
             for r in rec["records"]]
    none = s["reused_other_block_size"] == 0 and s["reused_other_weights"] == 0
    return "\n".join(rows + [
        "", f"Loaded by a new process vs a cold prefill: **{s['ttft_speedup_warm_vs_cold']:.1f}×** lower time to first "
        f"token (goal ≥ {s['goal_speedup']:.0f}× {mark(s['speedup_met'])}); last-prompt logits max |diff| "
        f"{s['max_abs_logit_diff_warm_vs_cold']:.1e} (goal ≤ {s['logit_atol']:g} {mark(s['logits_met'])}); another block "
        f"size reused {s['reused_other_block_size']} tokens, other weights {s['reused_other_weights']} (goal: none "
        f"{mark(none)}). {rec['config']['context']} held-out bytes, from {_link('persistent_prefix/persistent_prefix')}, "
        f"commit `{rec['commit'][:7]}`, seed {rec['seeds'][0]}."])


def serve_block(results_dir: str) -> str:
    rec = _load(results_dir, "serve_load/serve_load")
    if rec is None:
        return _missing("serve")
    from gemini_jax.bench.serve_load import markdown  # one renderer for the record's .md and docs/results.md

    return markdown(rec) + f"\n\nFrom {_link('serve_load/serve_load')}."


QUANT_TAGS = (("int8", "int8"), ("float8_e4m3fn", "fp8"))
QUANT_NEEDLE_POINTS = 2.0  # goal: quantized within 2 points of float32 (paired 95% interval, Newcombe)
QUANT_BPB_REL = 0.01       # goal: bits per byte within 1% of float32 (paired 95% interval)


def paired_needle(quant: dict, base: dict, length: int | None = None) -> dict:
    """Quantized vs float32 needle outcomes on the same trials: quantized record trial t of cell c is
    the float32 record's trial t of cell c (same draw index, so the same prompt; keys are checked)."""
    tq, tb = int(quant["trials"]), int(base["trials"])
    if quant["depths"] != base["depths"] or tq > tb:
        raise ValueError(f"{quant['name']} cannot be paired with {base['name']}: other depths or more trials")
    d, hits_q, hits_b, both, same = [], 0, 0, 0, 0
    for k, rq in enumerate(quant["records"]):
        if length is not None and rq["length"] != length:
            continue
        cell, t = divmod(k, tq)
        rb = base["records"][cell * tb + t]
        if (rq["length"], rq["depth"], rq["key"]) != (rb["length"], rb["depth"], rb["key"]):
            raise ValueError(f"{quant['name']} trial {k} is not {base['name']} trial {cell * tb + t}")
        d.append(int(rq["ok"]) - int(rb["ok"]))
        hits_q += rq["ok"]
        hits_b += rb["ok"]
        both += rq["ok"] and rb["ok"]
        same += rq["generated"] == rb["generated"]
    fixed, lost = d.count(1), d.count(-1)
    diff, lo, hi = paired_difference(both, fixed, lost, len(d) - both - fixed - lost)
    return {"n": len(d), "quant": hits_q, "base": hits_b, "diff": 100 * diff, "lo": 100 * lo, "hi": 100 * hi,
            "fixed": fixed, "lost": lost, "same_text": same}


def paired_bpb(quant: dict, base: dict) -> list[dict]:
    """Per context: quantized vs float32 bits per byte over the same windows (the first n of each)."""
    out = []
    by = {r["context"]: r for r in base["records"]}
    for rq in quant["records"]:
        rb = by[rq["context"]]
        q = rq["per_window"]
        b = rb["per_window"][:len(q)]
        mean_b = sum(b) / len(b)
        _, lo, hi = mean_t95([x - y for x, y in zip(q, b)])
        out.append({"context": rq["context"], "n": len(q), "quant": sum(q) / len(q), "base": mean_b,
                    "rel": (sum(q) / len(q) - mean_b) / mean_b, "lo": lo / mean_b, "hi": hi / mean_b})
    return out


def kv_quant_block(results_dir: str) -> str:
    rows = ["| KV dtype | measurement | float32, same trials | quantized | quantized − float32 [paired 95%] | goal | file |",
            "|---|---|---|---|---|---|---|"]
    loaded = []
    needles = (("rerank_8k", "needle/rerank_8k_test", "needle 8K, `extrapolate_rerank`", None),
               ("rerank_32k", "needle/rerank_32k_test", "needle 32K, `extrapolate_rerank`", None),
               *(("dense", "needle/dense_test", f"needle {L // 1024}K, dense", L) for L in (1024, 2048, 4096)))
    for dtype, tag in QUANT_TAGS:
        for name, base_rec, what, length in needles:
            q, b = _load(results_dir, f"needle/{tag}_{name}_test"), _load(results_dir, base_rec)
            loaded += [q, b]
            if q is None or b is None:
                rows.append(f"| {dtype} | {what} | — | — | — | — | {_missing('kv_quant')} |")
                continue
            p = paired_needle(q, b, length)
            ok = -QUANT_NEEDLE_POINTS <= p["lo"] and p["hi"] <= QUANT_NEEDLE_POINTS
            why = "" if ok or p["fixed"] + p["lost"] else f" (no trial differs; {p['n']} trials cannot bound it closer)"
            rows.append(f"| {dtype} | {what} | {p['base']}/{p['n']} | {p['quant']}/{p['n']} | "
                        f"{p['diff']:+.1f} [{p['lo']:+.1f}, {p['hi']:+.1f}] points ({p['fixed']} fixed, "
                        f"{p['lost']} lost; same text {p['same_text']}/{p['n']}) | {'✓' if ok else '✗'}{why} | "
                        f"{_link(f'needle/{tag}_{name}_test')} |")
        q, b = (_load(results_dir, f"perplexity/bpb_{tag}_extrapolate_test"),
                _load(results_dir, "perplexity/bpb_extrapolate_test"))
        loaded += [q, b]
        if q is None or b is None:
            rows.append(f"| {dtype} | bits per byte, `extrapolate` | — | — | — | — | {_missing('kv_quant')} |")
        else:
            for p in paired_bpb(q, b):
                ok = -QUANT_BPB_REL <= p["lo"] and p["hi"] <= QUANT_BPB_REL
                rows.append(f"| {dtype} | bits per byte {p['context'] // 1024}K, `extrapolate` ({p['n']} windows) | "
                            f"{p['base']:.4f} | {p['quant']:.4f} | {100 * p['rel']:+.2f}% [{100 * p['lo']:+.2f}, "
                            f"{100 * p['hi']:+.2f}] | {'✓' if ok else '✗'} | "
                            f"{_link(f'perplexity/bpb_{tag}_extrapolate_test')} |")
    bench = _load(results_dir, "bench_kv_quant/bench")
    tail = ["", f"Goals: within ±{QUANT_NEEDLE_POINTS:.0f} points of float32 (needle) and ±{100 * QUANT_BPB_REL:.0f}% "
                f"(bits per byte), the whole paired interval inside. Commit(s) the files came from: {_commits(loaded)}."]
    if bench is None:
        return "\n".join(rows + tail + ["", f"Step time and bytes: {_missing('kv_quant')}"])
    b = bench["rows"]["kv_quant"]["records"]
    brow = ["| attention | KV dtype | context | step time quantized / float32 (min–max) | KV bytes read per step | "
            "snapshot KV + scales | … + float32 digests |", "|---|---|---|---|---|---|---|"]
    for r in (r for r in b if r["mode"] != "tiers"):
        brow.append(f"| {r['mode']} | {r['dtype']} | {r['context'] // 1024}K | {r['time_ratio']:.2f}× "
                    f"({r['time_ratio_min']:.2f}–{r['time_ratio_max']:.2f}) | {r['kv_bytes_ratio']:.3f}× "
                    f"{'✓' if r['kv_bytes_ratio'] <= 0.27 else '✗'} | {r['snapshot_kv_ratio']:.3f}× "
                    f"{'✓' if r['snapshot_kv_ratio'] <= 0.27 else '✗'} | {r['snapshot_payload_ratio']:.3f}× |")
    tiers = [r for r in b if r["mode"] == "tiers"]
    if tiers:
        brow += ["", "| over tiers | KV dtype | prompt | pages down / up, float32 vs quantized | bytes the tiers moved, "
                 "quantized / float32 |", "|---|---|---|---|---|"]
        brow += [f"| sparse, 25% of pages on device | {r['dtype']} | {r['context'] // 1024}K | "
                 f"{r['float32']['pages_down']} / {r['float32']['pages_up']} vs {r['quant']['pages_down']} / "
                 f"{r['quant']['pages_up']} | {r['tier_bytes_ratio']:.3f}× {'✓' if r['tier_bytes_ratio'] <= 0.27 else '✗'} |"
                 for r in tiers]
    return "\n".join(rows + tail + ["", *brow, "", f"Bytes goal ≤ 0.27× of float32, scales included. From "
                                     f"[BENCH.md]({LINK_BASE}/bench_kv_quant/BENCH.md) (raw: `bench.json`), "
                                     f"commit `{bench['commit'][:7]}`, seed {bench['seeds'][0]}."])


def reproduce_block(results_dir: str) -> str:
    """One row per needle / bits-per-byte record docs/results.md shows: a sample of its trials rerun at a
    later commit (`experiments/results.py --reproduce`), and how many came out the same."""
    import importlib.util

    # experiments/results.py names the records (this module may be loaded by path, off sys.path)
    import sys

    results = sys.modules.get("results")
    if results is None:
        spec = importlib.util.spec_from_file_location("results", os.path.join(os.path.dirname(__file__), "results.py"))
        results = sys.modules["results"] = importlib.util.module_from_spec(spec)  # dataclasses look it up
        spec.loader.exec_module(results)
    rows = ["| record | measured at | rerun at | trials rerun | same as recorded | file |", "|---|---|---|---|---|---|"]
    loaded = []
    for job in results.SUBSETS["reproduce"]:
        rec = _load(results_dir, job.record)
        loaded.append(rec)
        source = job.source
        if rec is None:
            rows.append(f"| {_link(source)} | — | — | — | {_missing('reproduce')} | — |")
            continue
        o = rec["outcome"]
        same = f"{o['equal']}/{o['checked']} {'✓' if o['equal'] == o['checked'] else '✗'}"
        if o["kind"] == "bpb":
            same += f" (max abs diff {o['max_abs_diff']:.1e} bits/byte, tolerance {o['tolerance']:.0e})"
        what = ("trials" if o["kind"] == "needle" else
                f"windows ({rec['config']['sample']} sampled per context, each with its scoring batch)" if o.get("batches")
                else f"windows ({rec['config']['sample']} per context, each alone)")
        rows.append(f"| {_link(source)} | `{rec['source_commit'][:7]}` | `{rec['commit'][:7]}` | {o['checked']} {what} | "
                    f"{same} | {_link(job.record)} |")
    return "\n".join(rows + ["", f"Commit(s) the reruns came from: {_commits(loaded)}."])


# The design's example: Python `if` vs Verilog `if` at cosine distance 0.12, Python `if` vs `while` at 0.41.
CODE_CROSS_GOAL, CODE_WITHIN_GOAL = 0.12, 0.41
CODE_ROWS = (("seen_templates", "held-out seeds, seen templates"), ("heldout_templates", "held-out templates"),
             ("real_code", "real code: Python stdlib vs C headers"))


def code_block(results_dir: str) -> str:
    rec = _load(results_dir, "code/node_distances")
    if rec is None:
        return _missing("code")
    rows = ["| evaluation | nodes | kinds | same kind, across languages | different kinds, one language | "
            "features alone: across / within | goal |", "|---|---:|---:|---:|---:|---:|---|"]
    for key, label in CODE_ROWS:
        s = rec["summary"][key]
        cross, within = s["encoder_same_kind_cross_language"], s["encoder_different_kind_same_language"]
        met = "✓" if cross <= CODE_CROSS_GOAL and within >= CODE_WITHIN_GOAL else "✗"
        rows.append(f"| {label} | {s['nodes']} | {s['kinds']} | {cross:.3f} | {within:.3f} | "
                    f"{s['features_same_kind_cross_language']:.3f} / {s['features_different_kind_same_language']:.3f} | "
                    f"{met} |")
    return "\n".join(rows + ["", f"Mean cosine distance (1 - cos) between groups of nodes, {len(rec['languages'])} "
                                 f"languages; goal: across ≤ {CODE_CROSS_GOAL} and within ≥ {CODE_WITHIN_GOAL} (the "
                                 f"design's example: Python `if` vs Verilog `if` {CODE_CROSS_GOAL}, `if` vs "
                                 f"`while` {CODE_WITHIN_GOAL}). Per kind: {_link('code/node_distances')}, commit "
                                 f"`{rec['commit'][:7]}`."])


ALIGN_LABELS = {"aligned": "top-level definitions", "aligned_methods": "definitions and methods"}


def align_block(results_dir: str) -> str:
    rec = _load(results_dir, "align_pages/align_pages")
    if rec is None:
        return _missing("align")
    a = rec["config"]
    rows = ["| context | pages start at | needle, fixed pages | needle, aligned | aligned - fixed (paired, 95%) | KV "
            "bytes vs fixed | padding per prompt | recall fixed | recall aligned | aligned - fixed (95%) | verdict |",
            "|---:|---|---|---|---|---:|---:|---:|---:|---|---|"]

    def acc(c):
        return f"{c['hits']}/{c['trials']}"
    for base in rec["summary"].values():
        for lay, label in ALIGN_LABELS.items():
            s = base[lay + "_vs_fixed"]
            nd, rd = s["needle_diff"], s["recall_diff"]
            rows.append(f"| {base['length']} | {label} | {acc(base['fixed'])} | {acc(base[lay])} | {nd['points']:+.1f} "
                        f"[{nd['ci95'][0]:+.1f}, {nd['ci95'][1]:+.1f}] points | {s['kv_bytes_vs_fixed']:.3f}× | "
                        f"{s['pads_per_prompt']:.0f} slots | {base['fixed_recall']['mean']:.3f} | {s['recall']['mean']:.3f} | "
                        f"{rd['mean']:+.3f} [{rd['ci95'][0]:+.3f}, {rd['ci95'][1]:+.3f}] | {s['verdict']} |")
    dense = "; ".join(f"{b['length']}: {acc(b['dense'])}" for b in rec["summary"].values())
    return "\n".join(rows + ["", f"Sparse budget {a['budget']} tokens (sink {a['sink_pages']}, local {a['local_pages']} "
                                 f"pages of {a['block_size']}), the same for both layouts; needle {a['trials']} test "
                                 f"trials per depth x {len(a['depths'])} depths, the same prompts for every mode (dense "
                                 f"ceiling {dense}); recall: {a['windows']} windows, minmax digests. No target: the "
                                 f"question is whether alignment helps; *verdict* says whether a paired interval excludes "
                                 f"zero. {_link('align_pages/align_pages')}, commit `{rec['commit'][:7]}`."])


def encoders_block(results_dir: str) -> str:
    rec = _load(results_dir, "encoders/digits")
    if rec is None:
        return _missing("encoders")
    goal = rec["goal"]
    rows = ["| encoder | width, soft tokens | held-out answer | goal | the encoder's own classifier, held out |",
            "|---|---|---|---|---|"]
    for r in rec["records"]:
        a, c = r["heldout_answer"], r["heldout_classifier"]
        rows.append(f"| {r['encoder']} | {r['d_enc']}, {r['soft_tokens']} | {_pct(a['hits'], a['n'])} | "
                    f"{'✓' if a['accuracy'] >= goal else '✗'} | {_pct(c['hits'], c['n'])} |")
    swap = rec["swap"]
    own = swap["own_projector_heldout_answer"]
    return "\n".join(rows + [
        "", f"Goal: held-out answer ≥ {100 * goal:.0f}% with either encoder. Decoder weights' sha256 before and after "
            f"projector training identical: {'✓' if rec['decoder_unchanged'] else '✗'}. Swap: `{swap['encoder']}` "
            f"with its own projector {_pct(own['hits'], own['n'])}; with the projector of `{swap['projector_of']}`: "
            f"{'refused ✓' if swap['refused'] else 'not refused ✗'}. {rec['split_facts']['heldout']} held-out and "
            f"{rec['split_facts']['train']} training digits; 95% Wilson intervals. From {_link('encoders/digits')}, "
            f"commit `{rec['commit'][:7]}`."])


def ruler_block(results_dir: str, record: str = "ruler/grid", subset: str = "ruler", more: str | None = None,
                calibration: str = "ruler/calibration") -> str:
    """The grid `record` as one table, `more` (other modes on the same trials) as more columns."""
    rec, cal = _load(results_dir, record), _load(results_dir, calibration)
    if rec is None:
        return _missing(subset)
    extra = _load(results_dir, more) if more else None
    rec = rec if extra is None else with_columns(rec, extra)
    cells = rec["cells"]
    cols = list(dict.fromkeys((c["model"], c["mode"]) for c in cells))
    lengths = {col: sorted({c["length"] for c in cells if (c["model"], c["mode"]) == col}) for col in cols}
    by = {(c["model"], c["mode"], c["task"], c["length"]): c for c in cells}
    head = [f"{m} {RULER_MODES.get(mode, mode)} ({', '.join(_length_label(L) for L in lengths[(m, mode)])})"
            for m, mode in cols]
    rows = ["| task | " + " | ".join(head) + " |", "|---|" + "---|" * len(cols)]
    for task in dict.fromkeys(c["task"] for c in cells):
        rows.append(f"| {task} | " + " | ".join(" · ".join(f"{by[(m, mode, task, L)]['hits']}" for L in lengths[(m, mode)])
                                               + f" of {by[(m, mode, task, lengths[(m, mode)][0])]['trials']}"
                                               if (m, mode, task, lengths[(m, mode)][0]) in by else "—"
                                               for m, mode in cols) + " |")
    s = rec["summary"]
    mark = {True: "✓", False: "✗", None: "—"}
    notes = ["", "Exact-match hits per context length (in the header's order) out of the trials per cell; intervals "
                 "and KV bytes per token in the record."]
    if s["retrieval_1k"]:
        notes.append("- The retrained model, dense at 1K, ≥ 90% on every retrieval task: "
                     + ", ".join(f"{t} {100 * v['accuracy']:.0f}%" for t, v in s["retrieval_1k"].items())
                     + f" {mark[s['retrieval_goal_met']]}")
    if s["topp_vs_fixed"]:
        # Counted from the cells here: a task where both modes score 0 says nothing of either, and a
        # task where top-p read more KV bytes than fixed is not a comparison at equal bytes.
        tv = s["topp_vs_fixed"]
        told = [t for t, v in tv.items() if v["topp"][0] + v["fixed"][0] > 0]
        fair = [t for t in told if tv[t]["topp_kv_bytes"] <= tv[t]["fixed_kv_bytes"]]
        good = [t for t in fair if tv[t]["topp"][0] * tv[t]["fixed"][1] >= tv[t]["fixed"][0] * tv[t]["topp"][1]]
        goal = subset == "ruler"  # the retrained model's grid sets the goal; others only compare
        notes.append("- Sparse top-p against sparse fixed: no task compares them." if not told else
            f"- Sparse top-p as accurate as sparse fixed at no more KV bytes{', on ≥ 5 tasks' if goal else ''} (lengths pooled): "
            + ", ".join(f"{t} {tv[t]['topp'][0]}/{tv[t]['topp'][1]} vs {tv[t]['fixed'][0]}/{tv[t]['fixed'][1]} "
                        f"({tv[t]['topp_kv_bytes'] / 1024:.0f} vs {tv[t]['fixed_kv_bytes'] / 1024:.0f} KiB/token)"
                        for t in told)
            + (f": {len(good)} of {len(told)} {'✓' if len(good) >= 5 else '✗'}" if goal else f" (no goal set): {len(good)} of {len(told)}"))
        if len(told) < len(tv):
            notes.append(f"  Both modes score 0 on {', '.join(t for t in tv if t not in told)}: those tasks compare nothing and are not counted.")
    for task, modes in s.get("aggregation", {}).items():
        notes.append(f"- {task} (aggregation: every part of the context counts), recall of the expected words: "
                     + ", ".join(f"{RULER_MODES.get(m, m)} {v['recall']:.2f}" for m, v in modes.items()))
    works = s.get("where_dense_works")
    if works is not None and any(w["modes"] for w in works):
        notes.append("- Where dense reaches 50% (the only cells that compare methods): "
                     + "; ".join(f"{w['task']} {_length_label(w['length'])} dense {w['dense'][0]}/{w['dense'][1]}, "
                                 + ", ".join(f"{RULER_MODES.get(m, m)} {v[0]}/{v[1]}" for m, v in w["modes"].items())
                                 for w in works if w["modes"])
                     + (f". Dense stays under 50% on {sum(1 for c in cells if c['mode'] == 'dense') - len(works)} of "
                        f"{sum(1 for c in cells if c['mode'] == 'dense')} cells." if works else ""))
    if rec["top_p"]["value"] is None:
        src = "no top-p mode"
    elif cal is not None and rec["top_p"]["source"].startswith("chosen"):
        src = f"top_p {rec['top_p']['value']:g}, chosen on dev trials ({_link(calibration)}, commit `{cal['commit'][:7]}`)"
    else:
        src = f"top_p {rec['top_p']['value']:g} ({rec['top_p']['source']})"
    notes.append(f"- {rec['split']} trials; {src}. Per cell: {_link(record)}, commit `{rec['commit'][:7]}`"
                 + (f"; {_link(more)}, commit `{extra['commit'][:7]}`." if extra is not None else "."))
    return "\n".join(rows + notes)


def smollm2_ruler_block(results_dir: str) -> str:
    """The grid on SmolLM2-135M-Instruct (conf/ruler_grid_smollm2.yaml): tasks through its chat template;
    below it the 4K / 8,000-token grid (conf/ruler_grid_smollm2_long.yaml, its methods record beside it)."""
    cal = "ruler/calibration_smollm2"
    out = ruler_block(results_dir, "ruler/smollm2_grid", "smollm2", "ruler/smollm2_grid_methods", cal)
    if _load(results_dir, "ruler/smollm2_grid_long") is not None:
        out += "\n\n" + ruler_block(results_dir, "ruler/smollm2_grid_long", "smollm2", "ruler/smollm2_grid_methods_long", cal)
    return out


BLOCKS = {"needle": needle_block, "smollm2_needle": smollm2_needle_block, "smollm2_ruler": smollm2_ruler_block, "smollm2_bpb": smollm2_bpb_block, "bpb": bpb_block, "make_run": make_run_block, "exactness": exactness_block,
          "decode": decode_block, "tiers": tiers_block, "prefix": prefix_block,
          "serve": serve_block, "reproduce": reproduce_block,
          "kv_quant": kv_quant_block, "code": code_block,
          "encoders": encoders_block, "ruler": ruler_block, "align": align_block}


def render(text: str, results_dir: str) -> tuple[str, int]:
    """`text` with every known block re-rendered; (new text, number of blocks that changed).
    Raises ValueError for a block name nothing renders, or a block opened and never closed."""
    changed = 0
    for name in re.findall(r"<!-- results:(\w+) -->", text):
        if name not in BLOCKS:
            raise ValueError(f"block 'results:{name}' has no renderer; known: {sorted(BLOCKS)}")
        pat = re.compile(rf"(<!-- results:{name} -->\n)(.*?)(<!-- /results:{name} -->)", re.S)
        m = pat.search(text)
        if m is None:
            raise ValueError(f"block 'results:{name}' is not closed by <!-- /results:{name} -->")
        body = BLOCKS[name](results_dir) + "\n"
        changed += m.group(2) != body
        text = text[:m.start(2)] + body + text[m.end(2):]
    return text, changed


def render_file(path: str, results_dir: str) -> int:
    """Re-render every block of the page at `path` (docs/results.md) in place; blocks that changed."""
    with open(path) as fh:
        text = fh.read()
    new, changed = render(text, results_dir)
    if changed:
        with open(path, "w") as fh:
            fh.write(new)
    return changed
