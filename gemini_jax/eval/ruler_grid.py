"""The RULER-style grid's records read back: the goals its cells decide and the tables they print.
The grid itself (task x length x {dense, sparse fixed, sparse top-p, compact + rerank}, one engine
per mode from the main job's config) runs from `experiments/ruler_grid.py`; a cell is
{model, mode, task, length, hits, trials, accuracy, ci95, recall, kv_bytes_per_token,
digest_bytes_per_token}."""

from __future__ import annotations

import json
import os

import numpy as np

from gemini_jax.data import ruler as suite
from gemini_jax.errors import ConfigError

MODE_NAMES = {"dense": "dense", "fixed": "sparse fixed", "topp": "sparse top-p", "compact_rerank": "compact + rerank"}
RETRIEVAL_GOAL = 0.9  # the retrained model, dense at 1K, on every retrieval task
TOPP_GOAL_TASKS = 5   # top-p as accurate as fixed (or better) on at least this many tasks
DENSE_WORKS = 0.5     # a cell compares methods only where dense reaches this accuracy


def choose_top_p(rows: list[dict]) -> float:
    """rows[0]: fixed; the rest: one per top_p candidate. The candidate reading the most KV bytes
    per token without passing fixed's; when every one passes them, the one reading the fewest."""
    target = rows[0]["kv_bytes_per_token"]
    under = [r for r in rows[1:] if r["kv_bytes_per_token"] <= target]
    if under:
        return max(under, key=lambda r: r["kv_bytes_per_token"])["top_p"]
    return min(rows[1:], key=lambda r: r["kv_bytes_per_token"])["top_p"]


def primary_model(cells: list[dict]) -> str | None:
    """The model whose cells the goals read: the retrained tiny model when present, else the grid's first."""
    return "tiny_ruler" if any(c["model"] == "tiny_ruler" for c in cells) else (cells[0]["model"] if cells else None)


def summary(cells: list[dict], tasks: list[str]) -> dict:
    """The goals read off the cells: the retrained model's dense retrieval at 1K, and top-p vs fixed."""
    def pooled(model, mode, task):
        cs = [c for c in cells if (c["model"], c["mode"], c["task"]) == (model, mode, task)]
        return (sum(c["hits"] for c in cs), sum(c["trials"] for c in cs), float(np.mean([c["kv_bytes_per_token"] for c in cs]))) if cs else None

    out = {"retrieval_1k": {}, "topp_vs_fixed": {}}
    # Methods compared only where dense works: each (model, task, length) whose dense cell reaches
    # DENSE_WORKS, with every other mode's hits and KV bytes on the same trials.
    out["where_dense_works"] = [
        {"model": d["model"], "task": d["task"], "length": d["length"], "dense": [d["hits"], d["trials"]],
         "modes": {c["mode"]: [c["hits"], c["trials"], c["kv_bytes_per_token"]] for c in cells
                   if (c["model"], c["task"], c["length"]) == (d["model"], d["task"], d["length"]) and c["mode"] != "dense"}}
        for d in cells if d["mode"] == "dense" and d["accuracy"] >= DENSE_WORKS]
    primary = primary_model(cells)
    for task in tasks:
        if task in suite.RETRIEVAL:
            c = next((c for c in cells if (c["model"], c["mode"], c["task"], c["length"]) == ("tiny_ruler", "dense", task, 1024)), None)
            if c:
                out["retrieval_1k"][task] = {"accuracy": c["accuracy"], "ci95": c["ci95"], "met": c["accuracy"] >= RETRIEVAL_GOAL}
        f, p = pooled(primary, "fixed", task), pooled(primary, "topp", task)
        if f and p:
            # A task where both score 0 compares nothing (None); top-p reading more bytes is not a tie at equal bytes.
            told = p[0] + f[0] > 0
            out["topp_vs_fixed"][task] = {"fixed": f[:2], "topp": p[:2], "fixed_kv_bytes": f[2], "topp_kv_bytes": p[2],
                                          "as_good": (p[0] / p[1] >= f[0] / f[1] and p[2] <= f[2]) if told else None}
    # Aggregation tasks: where selecting the top pages should fail. Exact match and recall (the share
    # of expected words named) per mode of the retrained model, lengths pooled.
    out["aggregation"] = {}
    for task in (t for t in tasks if t in suite.AGGREGATION):
        for mode in dict.fromkeys(c["mode"] for c in cells):
            cs = [c for c in cells if (c["model"], c["mode"], c["task"]) == (primary, mode, task)]
            if cs:
                out["aggregation"].setdefault(task, {})[mode] = {
                    "hits": sum(c["hits"] for c in cs), "trials": sum(c["trials"] for c in cs),
                    "recall": float(np.average([c["recall"] for c in cs], weights=[c["trials"] for c in cs]))}
    won = sum(bool(v["as_good"]) for v in out["topp_vs_fixed"].values())
    out["topp_as_good_tasks"] = won
    out["topp_goal_met"] = won >= TOPP_GOAL_TASKS if out["topp_vs_fixed"] else None
    out["retrieval_goal_met"] = all(v["met"] for v in out["retrieval_1k"].values()) if out["retrieval_1k"] else None
    return out


def with_columns(rec: dict, extra: dict) -> dict:
    """Grid record `rec` with `extra`'s cells (other modes on the same trials) as more columns: its
    top_p, and the summary read off every cell."""
    cells = rec["cells"] + extra["cells"]
    return {**rec, "cells": cells, "top_p": extra["top_p"], "summary": summary(cells, list(dict.fromkeys(c["task"] for c in cells)))}


def mark(ok) -> str:
    return "—" if ok is None else ("✓" if ok else "✗")


def resumed_note(rec: dict) -> str:
    """' N cells came from an earlier run ...' when the grid was continued from its journal."""
    j = rec.get("journal") or {}
    if not j.get("resumed_cells"):
        return ""
    at = ", ".join(f"`{c[:7]}` ({n})" for c, n in j["cell_commits"].items())
    return f" Continued after an interruption: {j['resumed_cells']} cell(s) from the earlier run; cells per commit: {at}."


def tasks_of(cfg, part=None) -> list[str]:
    """The tasks a mode (`part`: its config) or the calibration (`part`: None) runs: its own `tasks`
    or `calibration_tasks` where the config names them, else the grid's."""
    own = cfg.get("calibration_tasks") if part is None else part.get("tasks")
    return list(own or cfg.tasks)


def calibration_name(cfg) -> str:
    """The calibration record's name under ruler/ (one per model the top-p mode runs)."""
    return str(cfg.get("calibration_name") or "calibration")


def read_top_p(cfg, results_dir: str, root: str) -> tuple[float, str]:
    """(top_p, where it came from) for a grid config: set on the command line, or read from its
    calibration record under `results_dir` (shown relative to `root`); (None, ...) when no mode reads it."""
    if not (cfg.modes.get("topp") and cfg.modes.topp.models and cfg.modes.topp.lengths):
        return None, "not used: the grid runs no top-p mode"
    if cfg.top_p is not None:
        return float(cfg.top_p), "set on the command line"
    path = os.path.join(results_dir, "ruler", f"{calibration_name(cfg)}.json")
    if not os.path.exists(path):
        raise ConfigError(f"top_p is null and {path} does not exist: run `python experiments/ruler_grid.py "
                          f"calibrate=true` (dev trials) or give top_p=...")
    with open(path) as fh:
        rec = json.load(fh)
    want = {k: int(cfg[k]) for k in ("fixed_budget", "topp_max_budget", "topp_min_budget")}
    have = {k: int(rec["config"][k]) for k in want}
    if want != have:
        raise ConfigError(f"the calibration record was chosen for {have}, this grid asks {want}; rerun calibrate=true.")
    return float(rec["outcome"]["top_p"]), f"chosen on dev trials ({os.path.relpath(path, root)})"


def grid_markdown(rec: dict) -> str:
    cells = rec["cells"]
    cols = [(m, mode) for mode in rec["modes"] for m in rec["modes"][mode]["models"]]
    cols = sorted(set(cols), key=lambda c: (list(rec["modes"]).index(c[1]), list(rec["models"]).index(c[0])))
    by = {(c["model"], c["mode"], c["task"], c["length"]): c for c in cells}
    lengths = sorted({c["length"] for c in cells})
    tasks = list(dict.fromkeys(c["task"] for c in cells))
    s = rec["summary"]
    lines = [f"### RULER-style grid ({rec['split']} trials, seed {rec['seeds'][0]}, {rec['config']['kind']} keys)", "",
             f"Commit `{rec['commit']}`, `{rec['command']}`. Exact match, hits / trials and the 95% Wilson interval; "
             "below it the KV bytes one sequence read per generated token (all layers and kv heads; digests not included). "
             f"top_p = {rec['top_p']['value']} ({rec['top_p']['source']})." + resumed_note(rec), ""]
    lines.append("| task | length | " + " | ".join(f"{m} {MODE_NAMES.get(mode, mode)}" for m, mode in cols) + " |")
    lines.append("|---|---|" + "---|" * len(cols))
    for task in tasks:
        for L in lengths:
            row = []
            for m, mode in cols:
                c = by.get((m, mode, task, L))
                row.append("" if c is None else f"{c['hits']}/{c['trials']} [{100 * c['ci95'][0]:.0f}, {100 * c['ci95'][1]:.0f}]"
                           f"<br>{c['kv_bytes_per_token'] / 1024:.0f} KiB")
            lines.append(f"| {task} | {L} | " + " | ".join(row) + " |")
    lines += ["", "Goals:"]
    r1 = s["retrieval_1k"]
    if r1:
        lines.append(f"- the retrained model, dense at 1K, ≥ {100 * RETRIEVAL_GOAL:.0f}% on every retrieval task: "
                     + ", ".join(f"{t} {100 * v['accuracy']:.0f}% {mark(v['met'])}" for t, v in r1.items())
                     + f" → {mark(s['retrieval_goal_met'])}")
    tv = s["topp_vs_fixed"]
    if tv:
        lines.append(f"- sparse top-p as accurate as sparse fixed (all lengths pooled) on ≥ {TOPP_GOAL_TASKS} tasks: "
                     + ", ".join(f"{t} {v['topp'][0]}/{v['topp'][1]} vs {v['fixed'][0]}/{v['fixed'][1]} "
                                 f"({v['topp_kv_bytes'] / 1024:.0f} vs {v['fixed_kv_bytes'] / 1024:.0f} KiB/token)"
                                 for t, v in tv.items())
                     + f" → {s['topp_as_good_tasks']} of {len(tv)} {mark(s['topp_goal_met'])}")
    who = primary_model(cells)
    who = "the retrained model" if who == "tiny_ruler" else who
    for task, modes in s["aggregation"].items():
        lines.append(f"- {task} (aggregation), {who}, lengths pooled: "
                     + ", ".join(f"{MODE_NAMES.get(m, m)} {v['hits']}/{v['trials']} exact, recall {v['recall']:.2f}"
                                 for m, v in modes.items()))
    return "\n".join(lines) + "\n"


def calibration_markdown(rec: dict) -> str:
    o = rec["outcome"]
    lines = [f"### top_p for the RULER-style grid, chosen on dev trials ({o['model']}, lengths {o['lengths']}, "
             f"{o['trials_per_cell']} trials per task and length)", "",
             f"Commit `{rec['commit']}`, `{rec['command']}`. The candidate whose mean KV bytes per generated token come "
             "closest to sparse fixed's without passing them." + resumed_note(rec), "",
             "| mode | top_p | KV KiB / token | mean exact |", "|---|---|---|---|"]
    for r in rec["records"]:
        p = "" if r["top_p"] is None else f"{r['top_p']:g}"
        lines.append(f"| {r['mode']} | {p} | {r['kv_bytes_per_token'] / 1024:.1f} | {r['accuracy']:.2f} |")
    lines += ["", f"Chosen: top_p = {o['top_p']:g} (fixed reads {o['fixed_kv_bytes_per_token'] / 1024:.1f} KiB / token)."]
    return "\n".join(lines) + "\n"
