"""The RULER-style grid: task x context length x {dense, sparse fixed, sparse top-p, compact + rerank}.

    python experiments/ruler_grid.py calibrate=true     # dev trials: choose top_p at fixed's KV bytes
    python experiments/ruler_grid.py                    # test trials: the grid, every model and mode

Every cell runs the same trials (gemini_jax.eval.ruler: one prompt per (task, length, trial) of a
split and seed, whatever engine reads it) through an engine built from the main job's config with the
mode's overrides (conf/ruler_grid.yaml), and scores the greedy answer by exact match. A cell records
its hits with a 95% Wilson interval, the mean recall, and the KV bytes one sequence read per generated
token (digests beside). Writes {results_dir}/ruler/{out_name}.{json,md} (calibrate=true:
ruler/calibration.{json,md}, which the grid reads its top_p from when top_p is null).
"""

from __future__ import annotations

import json
import os

import hydra
import numpy as np
from hydra import compose
from omegaconf import DictConfig, OmegaConf
from tqdm import tqdm

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.data import ruler as suite
from gemini_jax.errors import ConfigError
from gemini_jax.eval.intervals import wilson
from gemini_jax.eval.journal import CellJournal
from gemini_jax.eval.record import StudyResult, make_record, write_record
from gemini_jax.eval.ruler import answer, score, trial_example
from gemini_jax.eval.trials import Draw
from gemini_jax.config import EngineConfig
from gemini_jax.data import corpus
from gemini_jax.hydra_schema import build, one_line_errors
from run import ROOT, emulate_hardware  # this script's directory is on sys.path

MODE_NAMES = {"dense": "dense", "fixed": "sparse fixed", "topp": "sparse top-p", "compact_rerank": "compact + rerank"}
RETRIEVAL_GOAL = 0.9  # the retrained model, dense at 1K, on every retrieval task
TOPP_GOAL_TASKS = 5   # top-p as accurate as fixed (or better) on at least this many tasks
DENSE_WORKS = 0.5     # a cell compares methods only where dense reaches this accuracy


def in_checkout(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def check(cfg: DictConfig) -> None:
    """ConfigError for a grid that cannot run, before any model loads."""
    unknown = [t for t in cfg.tasks if t not in suite.TASKS]
    if unknown:
        raise ConfigError(f"tasks {unknown} are not RULER-style tasks; choose from {list(suite.TASKS)}.")
    for name, mode in cfg.modes.items():
        missing = [m for m in mode.models if m not in cfg.models]
        if missing:
            raise ConfigError(f"modes.{name}.models names {missing}, which `models` does not define ({list(cfg.models)}).")
    if int(cfg.trials) < 1 or int(cfg.batch) < 1:
        raise ConfigError(f"trials={cfg.trials} and batch={cfg.batch} must be positive.")
    if cfg.top_p is not None and not 0 < float(cfg.top_p) <= 1:
        raise ConfigError(f"top_p={cfg.top_p} must be in (0, 1].")


def load_model(spec: str):
    """(model, chat tokenizer or None, identity) of a `models` entry: a native checkpoint directory
    (card + weights sha256), or `pretrained:<name>` (`gj.list_pretrained()`: the tasks are then
    asked through the model's chat template)."""
    if spec.startswith("pretrained:"):
        name = spec.split(":", 1)[1]
        model, tok = gj.load_pretrained(name)
        return model, tok, {"pretrained": name, "file": os.path.basename(gj.pretrained_path(name))}
    full = in_checkout(spec)
    if not tiny.available(full):
        raise ConfigError(f"no model at {spec!r} (card.json missing); export one with experiments/export_tiny.py "
                          f"+out_dir={spec}, or name a pretrained model as pretrained:<name> ({gj.list_pretrained()}).")
    return tiny.load_tiny(full), None, {"path": spec, "weights_sha256": tiny.card(full)["weights_sha256"]}


def haystack(name: str) -> np.ndarray:
    """heldout | train (the corpus splits) | a path to any text file, as uint8."""
    if name in ("heldout", "train"):
        return corpus.load_split(name)[1]
    with open(in_checkout(name), "rb") as fh:
        return np.frombuffer(fh.read(), np.uint8)


def engine_for(mode_overrides: list[str], longest: int, model, batch: int):
    """An engine of the main job's config (conf/config.yaml) with `mode_overrides` applied, its
    max_seq_len raised to fit `longest` tokens and the longest answer, max_batch to `batch`."""
    job = compose("config", overrides=[*mode_overrides, "experiment=ruler"])
    data = OmegaConf.to_container(job.engine, resolve=True)
    data["max_seq_len"] = max(int(data["max_seq_len"]), longest + 128)
    data["max_batch"] = max(int(data["max_batch"]), batch)
    return gj.Engine(model, emulate_hardware(job, build(EngineConfig, data), model)[0])


def run_cells(cfg, named: tuple, mode: str, overrides: list[str], lengths: list[int], draw: Draw,
              trials: int, bar, journal: CellJournal) -> tuple[list[dict], list[dict]]:
    """(cells, trial records) of one (model, mode) over every task and length. `named` = (name,
    model, chat tokenizer or None). A cell the journal holds (an earlier, interrupted run of the same
    grid) is taken from it; each cell measured here is added to it as soon as it is done."""
    model_name, model, tok = named
    hay = haystack(str(cfg.haystack))
    eng = None  # built for the first cell the journal lacks
    cells, records = [], []
    try:
        for task in cfg.tasks:
            for i, L in enumerate(lengths):
                key = (model_name, mode, " ".join(overrides), task, L)
                done = journal.get(key)
                if done is not None:
                    cells.append(done["cell"])
                    records += done["records"]
                    bar.update(done["cell"]["trials"])
                    continue
                eng = eng or engine_for(overrides, max(lengths), model, int(cfg.batch))
                examples = [trial_example(hay, task, lengths, (i, t), draw, str(cfg.kind), tok) for t in range(trials)]
                kv = digest = steps = 0.0
                rows = []
                for b in range(0, trials, int(cfg.batch)):
                    group = examples[b:b + int(cfg.batch)]
                    before = dict(eng.stats)
                    texts = answer(eng, group, tok)
                    n = (eng.stats["decode_steps"] - before["decode_steps"]) * len(group)
                    kv += eng.stats["kv_bytes_read"] - before["kv_bytes_read"]
                    digest += eng.stats["digest_bytes_read"] - before["digest_bytes_read"]
                    steps += n
                    for t, (e, text) in enumerate(zip(group, texts), b):
                        exact, recall = score(text, e, tok is not None)
                        rows.append({"model": model_name, "mode": mode, "task": task, "length": L, "trial": t,
                                     "tokens": len(e.prompt), "answers": list(e.answers), "generated": text,
                                     "exact": exact, "recall": recall})
                    bar.update(len(group))
                hits = sum(r["exact"] for r in rows)
                lo, hi = wilson(hits, len(rows))
                cell = {"model": model_name, "mode": mode, "task": task, "length": L, "hits": hits,
                        "trials": len(rows), "accuracy": hits / len(rows), "ci95": [lo, hi],
                        "recall": float(np.mean([r["recall"] for r in rows])),
                        "kv_bytes_per_token": kv / max(steps, 1), "digest_bytes_per_token": digest / max(steps, 1)}
                journal.add(key, {"cell": cell, "records": rows})
                cells.append(cell)
                records += rows
    finally:
        if eng is not None:
            eng.close()
    return cells, records


def open_journal(cfg, results: str, name: str, top_p) -> CellJournal:
    """The journal of this grid's finished cells (`{results}/ruler/{name}.partial.jsonl`). Its
    fingerprint is every setting a cell depends on: not `lengths_cap` (which only leaves cells
    out), `resume` or where the results go."""
    settings = OmegaConf.to_container(cfg, resolve=True)
    for k in ("hydra", "lengths_cap", "resume", "results_dir"):
        settings.pop(k, None)
    journal = CellJournal(os.path.join(results, "ruler", f"{name}.partial.jsonl"), {**settings, "top_p": top_p},
                          resume=bool(cfg.resume))
    if journal.resumed:
        print(f"resuming {name}: {journal.resumed} cell(s) measured by an earlier run ({journal.path})", flush=True)
    return journal


def journal_note(journal: CellJournal) -> dict:
    """What the record says of the cells an earlier run measured, and at which commits."""
    return {"resumed_cells": journal.resumed, "cell_commits": journal.commits()}


def modes_of(cfg, top_p: float | None) -> dict[str, dict]:
    """mode -> {models, lengths, overrides} with top_p filled in and lengths capped."""
    out = {}
    cap = cfg.lengths_cap
    for name, mode in cfg.modes.items():
        over = list(mode.overrides)
        if not mode.models or not mode.lengths:
            continue  # a mode this grid does not run
        if name == "topp":
            if top_p is None:
                raise ConfigError("mode topp needs top_p: set top_p=..., or run calibrate=true first.")
            over.append(f"engine.sparse.top_p={top_p}")
        lengths = [int(x) for x in mode.lengths if cap is None or int(x) <= int(cap)]
        if lengths:
            out[name] = {"models": list(mode.models), "lengths": lengths, "overrides": over}
    return out


def calibrate(cfg, journal: CellJournal) -> dict:
    """Choose top_p on dev trials: fixed's mean KV bytes per token, then each candidate's; the
    candidate closest to fixed's without passing it (none under: the cheapest)."""
    draw = Draw("dev", int(cfg.seed))
    trials = int(cfg.calibration_trials)
    lengths = [int(x) for x in cfg.calibration_lengths]
    model_name = cfg.modes.topp.models[0]
    model, tok, _ = load_model(str(cfg.models[model_name]))
    runs = [("fixed", None, list(cfg.modes.fixed.overrides))]
    runs += [("topp", float(p), [*cfg.modes.topp.overrides, f"engine.sparse.top_p={float(p)}"]) for p in cfg.top_p_grid]
    bar = tqdm(total=len(runs) * len(cfg.tasks) * len(lengths) * trials, desc="calibrate top_p", unit="trial")
    rows = []
    for mode, p, over in runs:
        cells, _ = run_cells(cfg, (model_name, model, tok), mode, over, lengths, draw, trials, bar, journal)
        rows.append({"mode": mode, "top_p": p, "kv_bytes_per_token": float(np.mean([c["kv_bytes_per_token"] for c in cells])),
                     "accuracy": float(np.mean([c["accuracy"] for c in cells]))})
    bar.close()
    return {"rows": rows, "fixed_kv_bytes_per_token": rows[0]["kv_bytes_per_token"], "top_p": choose_top_p(rows),
            "model": model_name, "lengths": lengths, "trials_per_cell": trials}


def choose_top_p(rows: list[dict]) -> float:
    """rows[0]: fixed; the rest: one per top_p candidate. The candidate reading the most KV bytes
    per token without passing fixed's; when every one passes them, the one reading the fewest."""
    target = rows[0]["kv_bytes_per_token"]
    under = [r for r in rows[1:] if r["kv_bytes_per_token"] <= target]
    if under:
        return max(under, key=lambda r: r["kv_bytes_per_token"])["top_p"]
    return min(rows[1:], key=lambda r: r["kv_bytes_per_token"])["top_p"]


def calibrated_top_p(cfg) -> tuple[float, str]:
    """(top_p, where it came from); (None, ...) when no mode reads it."""
    if not (cfg.modes.get("topp") and cfg.modes.topp.models and cfg.modes.topp.lengths):
        return None, "not used: the grid runs no top-p mode"
    if cfg.top_p is not None:
        return float(cfg.top_p), "set on the command line"
    path = os.path.join(in_checkout(cfg.results_dir), "ruler", "calibration.json")
    if not os.path.exists(path):
        raise ConfigError(f"top_p is null and {path} does not exist: run `python experiments/ruler_grid.py "
                          f"calibrate=true` (dev trials) or give top_p=...")
    with open(path) as fh:
        rec = json.load(fh)
    want = {k: int(cfg[k]) for k in ("fixed_budget", "topp_max_budget", "topp_min_budget")}
    have = {k: int(rec["config"][k]) for k in want}
    if want != have:
        raise ConfigError(f"the calibration record was chosen for {have}, this grid asks {want}; rerun calibrate=true.")
    return float(rec["outcome"]["top_p"]), f"chosen on dev trials ({os.path.relpath(path, ROOT)})"


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
    primary = "tiny_ruler" if any(c["model"] == "tiny_ruler" for c in cells) else (cells[0]["model"] if cells else None)
    for task in tasks:
        if task in suite.RETRIEVAL:
            c = next((c for c in cells if (c["model"], c["mode"], c["task"], c["length"]) == ("tiny_ruler", "dense", task, 1024)), None)
            if c:
                out["retrieval_1k"][task] = {"accuracy": c["accuracy"], "ci95": c["ci95"], "met": c["accuracy"] >= RETRIEVAL_GOAL}
        f, p = pooled("tiny_ruler", "fixed", task), pooled("tiny_ruler", "topp", task)
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


@hydra.main(version_base=None, config_path="../conf", config_name="ruler_grid")
@one_line_errors
def main(cfg: DictConfig) -> None:
    check(cfg)
    hc = hydra.core.hydra_config.HydraConfig.get()
    named = [] if hc.job.config_name == "ruler_grid" else ["--config-name", hc.job.config_name]
    command = " ".join(["python experiments/ruler_grid.py", *named, *hc.overrides.task])
    config = OmegaConf.to_container(cfg, resolve=True)
    config.pop("hydra", None)
    results = in_checkout(str(cfg.results_dir))
    if cfg.calibrate:
        journal = open_journal(cfg, results, "calibration", None)
        out = calibrate(cfg, journal)
        rec = make_record("ruler", StudyResult(name="calibration", records=out.pop("rows"), split="dev",
                                               seeds=[int(cfg.seed)], extra={"outcome": out,
                                                                             "journal": journal_note(journal)}),
                          command=command, config=config)
        paths = write_record(results, rec, calibration_markdown(rec))
        journal.close()
        print(calibration_markdown(rec), end="")
        print(f"written {paths['md']}")
        return
    top_p, source = calibrated_top_p(cfg)
    modes = modes_of(cfg, top_p)
    draw = Draw(str(cfg.split), int(cfg.seed))
    trials = int(cfg.trials)
    total = sum(len(m["models"]) * len(m["lengths"]) for m in modes.values()) * len(cfg.tasks) * trials
    journal = open_journal(cfg, results, str(cfg.out_name), top_p)
    bar = tqdm(total=total, desc="ruler grid", unit="trial")
    cells, records, models = [], [], {}
    for model_name in cfg.models:
        runs = [(n, m) for n, m in modes.items() if model_name in m["models"]]
        if not runs:
            continue
        model, tok, models[model_name] = load_model(str(cfg.models[model_name]))
        for name, m in runs:
            c, r = run_cells(cfg, (model_name, model, tok), name, m["overrides"], m["lengths"], draw, trials, bar,
                             journal)
            cells += c
            records += r
    bar.close()
    extra = {"cells": cells, "modes": modes, "models": models, "top_p": {"value": top_p, "source": source},
             "summary": summary(cells, list(cfg.tasks)), "journal": journal_note(journal)}
    rec = make_record("ruler", StudyResult(name=str(cfg.out_name), records=records, split=draw.split,
                                           seeds=[draw.seed], extra=extra), command=command, config=config)
    md = grid_markdown(rec)
    paths = write_record(results, rec, md)
    journal.close()
    print(md, end="")
    print(f"written {paths['md']}")


def _mark(ok) -> str:
    return "—" if ok is None else ("✓" if ok else "✗")


def resumed_note(rec: dict) -> str:
    """' N cells came from an earlier run ...' when the grid was continued from its journal."""
    j = rec.get("journal") or {}
    if not j.get("resumed_cells"):
        return ""
    at = ", ".join(f"`{c[:7]}` ({n})" for c, n in j["cell_commits"].items())
    return f" Continued after an interruption: {j['resumed_cells']} cell(s) from the earlier run; cells per commit: {at}."


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
                     + ", ".join(f"{t} {100 * v['accuracy']:.0f}% {_mark(v['met'])}" for t, v in r1.items())
                     + f" → {_mark(s['retrieval_goal_met'])}")
    tv = s["topp_vs_fixed"]
    if tv:
        lines.append(f"- sparse top-p as accurate as sparse fixed (all lengths pooled) on ≥ {TOPP_GOAL_TASKS} tasks: "
                     + ", ".join(f"{t} {v['topp'][0]}/{v['topp'][1]} vs {v['fixed'][0]}/{v['fixed'][1]} "
                                 f"({v['topp_kv_bytes'] / 1024:.0f} vs {v['fixed_kv_bytes'] / 1024:.0f} KiB/token)"
                                 for t, v in tv.items())
                     + f" → {s['topp_as_good_tasks']} of {len(tv)} {_mark(s['topp_goal_met'])}")
    for task, modes in s["aggregation"].items():
        lines.append(f"- {task} (aggregation), the retrained model, lengths pooled: "
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


if __name__ == "__main__":
    main()
