"""The RULER-style grid (experiments/ruler_grid.py): its config checks, how it chooses top_p on dev
trials and reads it back, the goals it reads off the cells, and one real cell end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from gemini_jax.errors import ConfigError
from test_ablate import ROOT, sandbox_env

sys.path.insert(0, os.path.join(ROOT, "experiments"))  # the script imports its sibling run.py
_spec = importlib.util.spec_from_file_location("ruler_grid", os.path.join(ROOT, "experiments", "ruler_grid.py"))
rg = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(rg)
from test_results_files import rt  # noqa: E402  (experiments/results_tables.py as a module)


def grid_cfg(**changes):
    cfg = OmegaConf.load(os.path.join(ROOT, "conf", "ruler_grid.yaml"))
    cfg.pop("hydra")
    cfg.pop("defaults")
    for k, v in changes.items():
        OmegaConf.update(cfg, k, v, merge=False)
    return cfg


def top_p_of(cfg):
    """The grid's top_p as the script reads it (results_dir absolute here)."""
    return rg.read_top_p(cfg, str(cfg.results_dir), ROOT)


def test_config_errors_name_what_is_wrong():
    rg.check(grid_cfg())  # the shipped config passes
    cases = {"tasks": (["niah_single", "needle_soup"], "needle_soup"),
             "modes.fixed.models": (["tiny", "giant"], "giant"),
             "top_p": (1.5, "top_p=1.5"),
             "trials": (0, "trials=0")}
    for key, (value, named) in cases.items():
        with pytest.raises(ConfigError, match=named):
            rg.check(grid_cfg(**{key: value}))
    with pytest.raises(ConfigError, match="calibrate=true"):
        rg.modes_of(grid_cfg(), None)


def test_top_p_is_the_candidate_closest_to_fixed_bytes_from_below():
    rng = np.random.default_rng(7)
    for trial in range(20):
        fixed = float(rng.uniform(500, 1500))
        cands = [{"top_p": float(p), "kv_bytes_per_token": float(b)}
                 for p, b in zip(rng.uniform(0.3, 1.0, 5), rng.uniform(200, 2000, 5))]
        chosen = rg.choose_top_p([{"top_p": None, "kv_bytes_per_token": fixed}, *cands])
        under = [c for c in cands if c["kv_bytes_per_token"] <= fixed]
        want = (max(under, key=lambda c: c["kv_bytes_per_token"]) if under
                else min(cands, key=lambda c: c["kv_bytes_per_token"]))["top_p"]
        assert chosen == want, f"seed 7 trial {trial}: {fixed}, {cands}"


def test_grid_reads_top_p_from_a_matching_calibration_only(tmp_path):
    cfg = grid_cfg(results_dir=str(tmp_path))
    with pytest.raises(ConfigError, match="calibrate=true"):
        top_p_of(cfg)
    os.makedirs(tmp_path / "ruler")
    rec = {"config": {"fixed_budget": 256, "topp_max_budget": 512, "topp_min_budget": 64}, "outcome": {"top_p": 0.8}}
    (tmp_path / "ruler" / "calibration.json").write_text(json.dumps(rec))
    assert top_p_of(cfg)[0] == 0.8
    assert top_p_of(grid_cfg(results_dir=str(tmp_path), top_p=0.7)) == (0.7, "set on the command line")
    with pytest.raises(ConfigError, match="rerun calibrate=true"):
        top_p_of(grid_cfg(results_dir=str(tmp_path), fixed_budget=128))


def test_a_mode_and_the_calibration_may_name_their_own_tasks_and_record(tmp_path):
    """conf/ruler_grid_smollm2_methods.yaml: top-p and compact + rerank on two tasks only, top_p read
    from its own calibration record; a task no suite has is refused wherever it is named."""
    from hydra import compose, initialize_config_dir

    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = compose("ruler_grid_smollm2_methods", overrides=[f"results_dir={tmp_path}"])
    rg.check(cfg)
    assert rg.tasks_of(cfg) == ["niah_single", "niah_multikey"] and len(cfg.tasks) == 7
    with pytest.raises(ConfigError, match="calibration_smollm2.json"):
        top_p_of(cfg)
    os.makedirs(tmp_path / "ruler")
    rec = {"config": {"fixed_budget": 256, "topp_max_budget": 512, "topp_min_budget": 64}, "outcome": {"top_p": 0.7}}
    (tmp_path / "ruler" / "calibration.json").write_text(json.dumps({**rec, "outcome": {"top_p": 0.9}}))
    (tmp_path / "ruler" / "calibration_smollm2.json").write_text(json.dumps(rec))
    top_p, _ = top_p_of(cfg)
    assert top_p == 0.7  # its own record, not the shipped model's
    modes = rg.modes_of(cfg, top_p)
    assert sorted(modes) == ["compact_rerank", "topp"]
    assert all(m["tasks"] == ["niah_single", "niah_multikey"] for m in modes.values())
    assert rg.modes_of(grid_cfg(top_p=0.9), 0.9)["dense"]["tasks"] == list(grid_cfg().tasks)  # no own list: the grid's
    for key in ("modes.topp.tasks", "calibration_tasks"):
        bad = cfg.copy()
        OmegaConf.update(bad, key, ["niah_single", "needle_soup"], merge=False)
        with pytest.raises(ConfigError, match="needle_soup"):
            rg.check(bad)


def _cell(model, mode, task, length, hits, trials=10, kv=1024.0, recall=None):
    return {"model": model, "mode": mode, "task": task, "length": length, "hits": hits, "trials": trials,
            "accuracy": hits / trials, "ci95": [0.0, 1.0], "recall": hits / trials if recall is None else recall,
            "kv_bytes_per_token": kv, "digest_bytes_per_token": 0.0}


def test_summary_marks_each_goal_from_the_cells():
    tasks = ["niah_single", "vt", "cwe", "fwe"]
    cells = [_cell("tiny_ruler", "dense", "niah_single", 1024, 10), _cell("tiny_ruler", "dense", "vt", 1024, 8),
             _cell("tiny_ruler", "dense", "cwe", 1024, 0, recall=0.4)]
    for task, (f, p) in {"niah_single": (9, 9), "vt": (5, 4), "cwe": (1, 2), "fwe": (0, 0)}.items():
        for L in (1024, 2048):
            cells += [_cell("tiny_ruler", "fixed", task, L, f), _cell("tiny_ruler", "topp", task, L, p, kv=900.0)]
    s = rg.summary(cells, tasks)
    assert s["retrieval_1k"]["niah_single"]["met"] and not s["retrieval_1k"]["vt"]["met"]
    assert s["retrieval_goal_met"] is False  # vt at 80%
    assert "cwe" not in s["retrieval_1k"]  # aggregation is not retrieval
    assert [t for t, v in s["topp_vs_fixed"].items() if v["as_good"]] == ["niah_single", "cwe"]
    assert s["topp_vs_fixed"]["fwe"]["as_good"] is None  # both 0: compares nothing, not a tie
    assert s["topp_vs_fixed"]["vt"]["fixed"] == (10, 20) and s["topp_vs_fixed"]["vt"]["topp"] == (8, 20)
    assert s["topp_as_good_tasks"] == 2 and s["topp_goal_met"] is False
    assert s["aggregation"]["cwe"]["dense"] == {"hits": 0, "trials": 10, "recall": 0.4}


def test_one_cell_end_to_end_writes_a_record_the_readme_block_renders(tmp_path):
    """A real run of the script (the shipped model, dense, one trial at 1K) over two tasks, continued
    from a journal an interrupted run left with the first task's cell: that cell is taken from it, the
    other measured; the record has its provenance, says what it continued from, and the README block
    renders from it."""
    from hydra import compose, initialize_config_dir

    overrides = [f"results_dir={tmp_path}", "trials=1", "batch=1", "lengths_cap=1024", "tasks=[niah_single,vt]",
                 "top_p=0.9", "~modes.fixed", "~modes.topp", "~modes.compact_rerank", "modes.dense.models=[tiny]"]
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        cfg = compose("ruler_grid", overrides=overrides)
    journal = rg.open_journal(cfg, str(tmp_path), "grid", top_p_of(cfg)[0])
    kept = {"model": "tiny", "mode": "dense", "task": "niah_single", "length": 1024, "trial": 0, "tokens": 1000,
            "answers": ["123"], "generated": "from the earlier run", "exact": False, "recall": 0.0}
    journal.add(("tiny", "dense", "sparse=off", "niah_single", 1024),
                {"cell": _cell("tiny", "dense", "niah_single", 1024, 0, trials=1), "records": [kept]})
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "ruler_grid.py"), *overrides,
           f"hydra.run.dir={tmp_path / 'run'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "resuming grid: 1 cell(s)" in proc.stdout
    with open(tmp_path / "ruler" / "grid.json") as fh:
        rec = json.load(fh)
    # Only the commit may be flagged: a checkout with uncommitted changes records "+dirty".
    assert [p for p in rt.record_problems(rec) if "commit" not in p] == []
    assert [(c["task"], c["length"], c["trials"]) for c in rec["cells"]] == [("niah_single", 1024, 1), ("vt", 1024, 1)]
    old, trial = rec["records"]
    assert old == kept  # not measured again
    cell = rec["cells"][1]
    assert cell["hits"] == int(trial["exact"]) and trial["answers"] and isinstance(trial["generated"], str)
    assert cell["kv_bytes_per_token"] > 0
    assert rec["journal"]["resumed_cells"] == 1 and sum(rec["journal"]["cell_commits"].values()) == 2
    assert not (tmp_path / "ruler" / "grid.partial.jsonl").exists()
    assert "1 cell(s) from the earlier run" in (tmp_path / "ruler" / "grid.md").read_text()
    block = rt.ruler_block(str(tmp_path))
    assert "| niah_single |" in block and "| vt |" in block and "tiny dense (1K)" in block


def test_the_retrained_model_ships_small_and_loads_checked():
    from gemini_jax import tiny

    path = os.path.join(ROOT, "gemini_jax", "assets", "tiny_ruler")
    size = sum(os.path.getsize(os.path.join(path, f)) for f in os.listdir(path))
    assert size <= 20 * 2 ** 20, f"gemini_jax/assets/tiny_ruler holds {size / 2 ** 20:.1f} MiB"
    card = tiny.card(path)
    assert card["train_config"]["mix"]["ruler"] > 0 and card["step"] >= 1
    model = tiny.load_tiny_ruler()  # the weights' sha256 is checked against the card on load
    assert model.cfg == tiny.load_tiny().cfg


def test_smollm2_block_shows_the_methods_record_as_more_columns_on_the_same_trials(tmp_path):
    """The SmolLM2 block joins ruler/smollm2_grid (dense, fixed: every task) and
    ruler/smollm2_grid_methods (top-p, compact + rerank: two tasks) into one table; a task a mode did
    not run shows "—", the methods count where dense works, and top-p vs fixed is set no goal."""
    rng = np.random.default_rng(11)
    tasks = ["niah_single", "niah_multikey", "vt"]
    base = [_cell("smollm2", m, t, L, int(rng.integers(0, 6)), trials=5) for m in ("dense", "fixed") for t in tasks
            for L in (1024, 2048)]
    base[0]["hits"], base[0]["accuracy"] = 5, 1.0  # dense niah_single 1K works
    more = [_cell("smollm2", m, t, L, int(rng.integers(0, 6)), trials=5, kv=512.0)
            for m in ("topp", "compact_rerank") for t in tasks[:2] for L in (1024, 2048)]
    os.makedirs(tmp_path / "ruler")
    for name, cells, top_p in (("smollm2_grid", base, None), ("smollm2_grid_methods", more, 0.8)):
        rec = {"cells": cells, "commit": "a" * 40, "split": "test", "summary": rg.summary(cells, tasks),
               "top_p": {"value": top_p, "source": "set on the command line" if top_p else "not used"}}
        (tmp_path / "ruler" / f"{name}.json").write_text(json.dumps(rec))
    block = rt.smollm2_ruler_block(str(tmp_path))
    head, _, *body = block.splitlines()
    assert [h.strip() for h in head.split("|")[2:-1]] == [
        "smollm2 dense (1K, 2K)", "smollm2 sparse fixed (1K, 2K)", "smollm2 sparse top-p (1K, 2K)",
        "smollm2 compact + rerank (1K, 2K)"], f"seed 11: {head}"
    vt = next(r for r in body if r.startswith("| vt |"))
    assert vt.count("—") == 2, f"seed 11: {vt}"
    works = next(r for r in body if r.startswith("- Where dense reaches 50%"))
    top = next(c for c in more if (c["mode"], c["task"], c["length"]) == ("topp", "niah_single", 1024))
    assert f"sparse top-p {top['hits']}/5" in works and "compact + rerank" in works, f"seed 11: {works}"
    assert "smollm2_grid_methods" in block and "top_p 0.8" in block
    topp = [r for r in body if r.startswith("- Sparse top-p as accurate")]
    assert all("no goal set" in r and "✓" not in r and "✗" not in r for r in topp), f"seed 11: {topp}"


def test_a_grid_record_names_the_model_its_aggregation_lines_read():
    """The committed records: the tiny model's grid speaks of the retrained model, SmolLM2's of smollm2."""
    def aggregation_lines(name):
        with open(os.path.join(ROOT, "experiments", "results", "ruler", f"{name}.json")) as fh:
            md = rg.grid_markdown(json.load(fh))
        return [line for line in md.splitlines() if "(aggregation)" in line]
    tiny, smol = aggregation_lines("grid"), aggregation_lines("smollm2_grid_long")
    assert tiny and all("the retrained model" in line for line in tiny), tiny
    assert smol and all(", smollm2," in line and "retrained" not in line for line in smol), smol


def test_a_grid_block_where_no_task_compares_top_p_says_so():
    """SmolLM2's 4K / 8,000 grid: top-p ran on one task, where both modes scored 0, so nothing compares."""
    block = rt.smollm2_ruler_block(os.path.join(ROOT, "experiments", "results"))
    long = block.split("\n\n| task |")[1]
    assert "- Sparse top-p against sparse fixed: no task compares them." in long, long
    assert "Both modes score 0 on niah_multikey" in long and " 0 of 0" not in long, long
