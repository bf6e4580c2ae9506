"""The RULER-style grid: task x context length x {dense, sparse fixed, sparse top-p, compact + rerank}.

    python experiments/ruler_grid.py calibrate=true     # dev trials: choose top_p at fixed's KV bytes
    python experiments/ruler_grid.py                    # test trials: the grid, every model and mode

Every cell runs the same trials (gemini_jax.eval.ruler: one prompt per (task, length, trial) of a
split and seed, whatever engine reads it) through an engine built from the main job's config with the
mode's overrides (conf/ruler_grid.yaml), and scores the greedy answer by exact match. A cell records
its hits with a 95% Wilson interval, the mean recall, and the KV bytes one sequence read per generated
token (digests beside). Writes {results_dir}/ruler/{out_name}.{json,md} (calibrate=true:
ruler/{calibration_name}.{json,md}, which the grid reads its top_p from when top_p is null).
"""

from __future__ import annotations

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
from gemini_jax.eval.ruler_grid import (calibration_markdown, calibration_name, choose_top_p, grid_markdown, read_top_p,
                                        summary, tasks_of)
from run import ROOT, emulate_hardware  # this script's directory is on sys.path


def in_checkout(path: str) -> str:
    return path if os.path.isabs(path) else os.path.join(ROOT, path)


def check(cfg: DictConfig) -> None:
    """ConfigError for a grid that cannot run, before any model loads."""
    named = [*cfg.tasks, *tasks_of(cfg), *(t for m in cfg.modes.values() for t in tasks_of(cfg, m))]
    if unknown := sorted({t for t in named if t not in suite.TASKS}):
        raise ConfigError(f"tasks {unknown} are not RULER-style tasks; choose from {list(suite.TASKS)}.")
    for name, mode in cfg.modes.items():
        if missing := [m for m in mode.models if m not in cfg.models]:
            raise ConfigError(f"modes.{name}.models names {missing}, which `models` does not define ({list(cfg.models)}).")
    if int(cfg.trials) < 1 or int(cfg.batch) < 1:
        raise ConfigError(f"trials={cfg.trials} and batch={cfg.batch} must be positive.")
    if cfg.top_p is not None and not 0 < float(cfg.top_p) <= 1:
        raise ConfigError(f"top_p={cfg.top_p} must be in (0, 1].")


def load_model(spec: str):
    """(model, chat tokenizer or None, identity) of a `models` entry: a native checkpoint directory (card +
    weights sha256), or `pretrained:<name>` (`gj.list_pretrained()`: asked through its chat template)."""
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
    """The main job's engine (conf/config.yaml) + `mode_overrides`, fitting `longest` tokens + an answer."""
    job = compose("config", overrides=[*mode_overrides, "experiment=ruler"])
    data = OmegaConf.to_container(job.engine, resolve=True)
    data["max_seq_len"] = max(int(data["max_seq_len"]), longest + 128)
    data["max_batch"] = max(int(data["max_batch"]), batch)
    return gj.Engine(model, emulate_hardware(job, build(EngineConfig, data), model)[0])


def run_cells(cfg, named: tuple, mode: str, overrides: list[str], lengths: list[int], draw: Draw,
              trials: int, bar, journal: CellJournal, tasks: list[str]) -> tuple[list[dict], list[dict]]:
    """(cells, trial records) of one (model, mode) over every task and length. `named` = (name,
    model, chat tokenizer or None). A cell the journal holds (an earlier, interrupted run of the same
    grid) is taken from it; each cell measured here is added to it as soon as it is done."""
    model_name, model, tok = named
    hay = haystack(str(cfg.haystack))
    eng = None  # built for the first cell the journal lacks
    cells, records = [], []
    try:
        for task in tasks:
            for i, L in enumerate(lengths):
                key = (model_name, mode, " ".join(overrides), task, L)
                done = journal.get(key)
                if done is not None:
                    cells.append(done["cell"])
                    records += done["records"]
                    bar.update(done["cell"]["trials"])
                    continue
                examples = [trial_example(hay, task, lengths, (i, t), draw, str(cfg.kind), tok) for t in range(trials)]
                # a chat prompt is its length to within 3% (data.chat): hold 5% over, rebuild if one does not fit
                longest = max([int(max(lengths) * 1.05)] + [len(e.prompt) for e in examples])
                if eng is not None and longest + 128 > eng.config.max_seq_len:
                    eng.close()
                    eng = None
                eng = eng or engine_for(overrides, longest, model, int(cfg.batch))
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
            out[name] = {"models": list(mode.models), "lengths": lengths, "overrides": over, "tasks": tasks_of(cfg, mode)}
    return out


def calibrate(cfg, journal: CellJournal) -> dict:
    """Choose top_p on dev trials: the candidate closest to fixed's KV bytes without passing them (choose_top_p)."""
    draw = Draw("dev", int(cfg.seed))
    trials = int(cfg.calibration_trials)
    lengths = [int(x) for x in cfg.calibration_lengths]
    model_name = cfg.modes.topp.models[0]
    model, tok, _ = load_model(str(cfg.models[model_name]))
    runs = [("fixed", None, list(cfg.modes.fixed.overrides))]
    runs += [("topp", float(p), [*cfg.modes.topp.overrides, f"engine.sparse.top_p={float(p)}"]) for p in cfg.top_p_grid]
    tasks = tasks_of(cfg)
    bar = tqdm(total=len(runs) * len(tasks) * len(lengths) * trials, desc="calibrate top_p", unit="trial")
    rows = []
    for mode, p, over in runs:
        cells, _ = run_cells(cfg, (model_name, model, tok), mode, over, lengths, draw, trials, bar, journal, tasks)
        rows.append({"mode": mode, "top_p": p, "kv_bytes_per_token": float(np.mean([c["kv_bytes_per_token"] for c in cells])),
                     "accuracy": float(np.mean([c["accuracy"] for c in cells]))})
    bar.close()
    return {"rows": rows, "fixed_kv_bytes_per_token": rows[0]["kv_bytes_per_token"], "top_p": choose_top_p(rows),
            "model": model_name, "lengths": lengths, "trials_per_cell": trials, "tasks": tasks}


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
        journal = open_journal(cfg, results, calibration_name(cfg), None)
        out = calibrate(cfg, journal)
        rec = make_record("ruler", StudyResult(name=calibration_name(cfg), records=out.pop("rows"), split="dev",
                                               seeds=[int(cfg.seed)], extra={"outcome": out,
                                                                             "journal": journal_note(journal)}),
                          command=command, config=config)
        paths = write_record(results, rec, calibration_markdown(rec))
        journal.close()
        print(calibration_markdown(rec), end="")
        print(f"written {paths['md']}")
        return
    top_p, source = read_top_p(cfg, in_checkout(cfg.results_dir), ROOT)
    modes = modes_of(cfg, top_p)
    draw = Draw(str(cfg.split), int(cfg.seed))
    trials = int(cfg.trials)
    total = sum(len(m["models"]) * len(m["lengths"]) * len(m["tasks"]) for m in modes.values()) * trials
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
                             journal, m["tasks"])
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


if __name__ == "__main__":
    main()
