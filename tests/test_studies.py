"""Studies run by `experiments/run.py experiment=<study>` (gemini_jax.eval.studies) and the one result
record they write (gemini_jax.eval.record)."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import subprocess
import sys

import numpy as np
import pytest
from omegaconf import OmegaConf

from gemini_jax.errors import ConfigError
from gemini_jax.eval import studies
from gemini_jax.eval.record import REQUIRED, StudyResult, make_record, write_record
from gemini_jax.hydra_schema import build
from test_ablate import ROOT, sandbox_env


@pytest.mark.parametrize("name", studies.NAMES)
def test_each_study_yaml_builds_its_config_with_the_documented_defaults(name):
    data = OmegaConf.to_container(OmegaConf.load(os.path.join(ROOT, "conf", "experiment", f"{name}.yaml")))
    assert data.pop("name") == name
    study = studies.load(name)
    cfg = build(study.Config, data)
    # The yaml states every key, and its values are the workload's defaults.
    assert sorted(data) == sorted(f.name for f in dataclasses.fields(study.Config))
    assert cfg == study.Config()
    with pytest.raises(ConfigError, match="unknown field"):
        build(study.Config, {**data, "no_such_key": 1})


def test_study_configs_name_the_bad_field():
    with pytest.raises(ConfigError, match="digest='max'"):
        studies.load("needle_diagnose").Config(digest="max")
    with pytest.raises(ConfigError, match="5 digits"):
        studies.load("needle_keys").Config(keys=["1234"])
    with pytest.raises(ConfigError, match="not one of"):
        studies.load("no_such_study")


def test_record_holds_the_required_fields_and_refuses_shadowing(tmp_path):
    res = StudyResult(name="demo", records=[{"x": 1.5}], split="heldout", seeds=[3], extra={"model": "m"})
    rec = make_record("demo_study", res, command="python experiments/run.py experiment=demo", config={"a": 1},
                      commit="0" * 40)
    paths = write_record(str(tmp_path), rec, "# demo")
    assert paths == {"json": str(tmp_path / "demo_study" / "demo.json"), "md": str(tmp_path / "demo_study" / "demo.md")}
    back = json.loads((tmp_path / "demo_study" / "demo.json").read_text())
    assert {k: back[k] for k in REQUIRED} == {"command": "python experiments/run.py experiment=demo", "config": {"a": 1},
                                              "commit": "0" * 40, "split": "heldout", "seeds": [3],
                                              "records": [{"x": 1.5}]}
    assert back["model"] == "m" and (tmp_path / "demo_study" / "demo.md").read_text() == "# demo\n"
    with pytest.raises(ConfigError, match="shadow"):
        make_record("s", dataclasses.replace(res, extra={"seeds": 1}), command="c", config={}, commit="x")
    with pytest.raises(ConfigError, match="plain file name"):
        make_record("s", dataclasses.replace(res, name="../up"), command="c", config={}, commit="x")


def test_needle_keys_study_through_run_py(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=needle_keys",
           "experiment.keys=[22679,78734]", "experiment.lengths=[256]", "experiment.depths=[0.5]",
           f"results_dir={tmp_path / 'results'}", f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "results" / "needle_keys" / "needle_keys.json").read_text())
    assert rec["config"]["keys"] == ["22679", "78734"] and rec["seeds"] == [7] and rec["split"] == "dev"
    assert [(r["length"], r["depth"], r["of"]) for r in rec["records"]] == [(256, 0.5, 2)]
    md = (tmp_path / "results" / "needle_keys" / "needle_keys.md").read_text()
    assert md.startswith("# Dense needle on chosen keys") and "| 256 | 0.5 |" in md and rec["command"] in md


def test_tier_scale_refuses_a_directory_it_did_not_make_and_deletes_nothing(tmp_path):
    keep = tmp_path / "mine" / "notes.txt"
    keep.parent.mkdir()
    keep.write_text("not a disk tier")
    study = studies.load("tier_scale")
    with pytest.raises(ConfigError, match="experiment.disk_path=.* is not empty"):
        study.run(study.Config(disk_path=str(keep.parent), context=256, random_model=True))
    assert keep.read_text() == "not a disk tier"


def test_record_commit_is_dirty_for_code_changes_not_for_rewritten_results(tmp_path):
    """A results run rewrites tracked result files: that is its output, so the record's commit
    stays clean; an uncommitted code change marks it "+dirty"."""
    import subprocess

    from gemini_jax.eval.record import git_commit

    def git(*args):
        subprocess.run(["git", "-c", "user.email=t@t", "-c", "user.name=t", *args], cwd=tmp_path, check=True,
                       capture_output=True)

    (tmp_path / "experiments" / "results").mkdir(parents=True)
    (tmp_path / "code.py").write_text("x = 1\n")
    (tmp_path / "experiments" / "results" / "r.json").write_text("{}\n")
    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "c")
    head = git_commit(str(tmp_path))
    assert head is not None and not head.endswith("+dirty")
    (tmp_path / "experiments" / "results" / "r.json").write_text('{"new": 1}\n')
    assert git_commit(str(tmp_path)) == head
    (tmp_path / "code.py").write_text("x = 2\n")
    assert git_commit(str(tmp_path)) == head + "+dirty"


# ---------------------------------------------------------------- exactness


def _meets_test_tolerance(row) -> bool:
    """The row's error against the tolerance its test asserts, recomputed from the row's own figures."""
    on, tol = row["tolerance_on"], row["tolerance_asserted_in_tests"]
    if on == "tokens":
        return row["tokens_equal"]
    err = {"max_rel_err": row["max_rel_err"], "max_abs_err": row["max_abs_err"],
           "max_abs_err / max(1, max|ref|)": row["max_abs_err"] / max(1.0, row["ref_max_abs"])}[on]
    return err <= tol


# `make test` runs the study's wiring through run.py on the paths that build one engine each (every
# path has its own exactness tests in the suite); `make test-slow` runs every path, the stateful too.
EXACTNESS_PATHS = [pytest.param(("hf", "engine", "sparse", "soft"), id="ci"),
                   pytest.param(tuple(studies.load("exactness").PATHS), marks=pytest.mark.slow, id="every")]


@pytest.mark.parametrize("paths", EXACTNESS_PATHS)
def test_exactness_study_through_run_py(tmp_path, paths):
    """The study's paths on one family: finite errors, each within the tolerance its test asserts."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=exactness",
           "experiment.families=[gemma2]", "experiment.tiered_families=[gemma2]",
           "experiment.resume_families=[gemma2]", "experiment.aligned_families=[llama]",
           "experiment.aligned_lengths=[200]", "experiment.new_tokens=4", "experiment.hf_length=12",
           f"experiment.paths=[{','.join(paths)}]",
           f"results_dir={tmp_path / 'results'}", f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "results" / "exactness" / "exactness.json").read_text())
    assert rec["split"] is None and rec["seeds"] == [0] and rec["config"]["families"] == ["gemma2"]
    rows = {r["path"]: r for r in rec["records"]}
    assert sorted(rows) == sorted(paths)
    have_hf = importlib.util.find_spec("transformers") is not None and importlib.util.find_spec("torch") is not None
    for path, row in rows.items():
        if path == "hf" and not have_hf:  # no figure is made up for a comparison that did not run
            assert row["max_abs_err"] is None and "not installed" in row["note"]
            continue
        assert np.isfinite(row["max_abs_err"]) and np.isfinite(row["max_rel_err"]), row
        assert row["within_tolerance"] and _meets_test_tolerance(row), row
    if "tiered" in rows:
        assert "page fetches from host" in rows["tiered"]["note"] and not rows["tiered"]["note"].startswith("0 ")
    assert rec["all_within_tolerance"]
    md = (tmp_path / "results" / "exactness" / "exactness.md").read_text()
    assert md.startswith("# Exactness: measured logit errors") and "FAIL" not in md
    assert all(f"| {path} | {'llama' if path == 'aligned' else 'gemma2'} |" in md for path in paths), md


def test_exactness_tolerances_are_the_ones_the_tests_assert():
    """The tolerance each row quotes appears in the test it names."""
    import ast

    for path, (tol, on, test) in studies.load("exactness").TOLERANCES.items():
        file, name = test.split("::")
        tree = ast.parse(open(os.path.join(ROOT, file)).read())
        fn = next(n for n in ast.walk(tree) if isinstance(n, ast.FunctionDef) and n.name == name)
        if tol is None:  # asserted on tokens
            continue
        names = {n.id for n in ast.walk(fn) if isinstance(n, ast.Name)}
        module_consts = {t.id: n.value.value for n in tree.body if isinstance(n, ast.Assign)
                         and isinstance(n.value, ast.Constant) for t in n.targets if isinstance(t, ast.Name)}
        used = {n.value for n in ast.walk(fn) if isinstance(n, ast.Constant)}
        used |= {v for k, v in module_consts.items() if k in names}  # e.g. TOL = 1e-4 at module level
        assert tol in used, f"{path}: {tol} is neither a literal in {test} nor a module constant it uses"


def test_exactness_reports_a_planted_bug(monkeypatch):
    """The study can fail: a wrong rope theta (1/100 of it) in our decoder (hf path) and a resume that loses the
    last token before the resume point (resume path) come out far above the tolerances."""
    from gemini_jax import weights
    from gemini_jax.config import replace
    from gemini_jax.engine import Engine

    study = studies.load("exactness")
    load_hf, resume = weights.load_hf, Engine.resume

    def wrong_theta(path, **kw):
        model = load_hf(path, **kw)
        return weights.decoder_from_arrays(replace(model.cfg, rope=replace(model.cfg.rope, theta=model.cfg.rope.theta / 100)),
                                           weights.model_arrays(model))

    def loses_last_token(self, path, *args, **kw):
        sess = resume(self, path, *args, **kw)
        sess.rewind(sess.position - 1)
        return sess

    monkeypatch.setattr(weights, "load_hf", wrong_theta)
    monkeypatch.setattr(Engine, "resume", loses_last_token)
    paths = ("hf", "resume") if importlib.util.find_spec("transformers") else ("resume",)
    res = study.run(study.Config(families=("llama",), resume_families=("llama",), paths=paths, new_tokens=4,
                                 hf_length=12))
    assert [r["path"] for r in res.records] == list(paths)
    for row in res.records:
        assert np.isfinite(row["max_abs_err"]) and not row["within_tolerance"] and not _meets_test_tolerance(row), row
    rows = {r["path"]: r for r in res.records}
    assert rows["resume"]["max_abs_err"] > 1e-2 and not rows["resume"]["tokens_equal"]
    if "hf" in rows:
        assert rows["hf"]["max_rel_err"] > 1e-3
    assert not res.extra["all_within_tolerance"]
    record = make_record("exactness", res, command="c", config={}, commit="x")
    assert "✗ FAIL" in study.markdown(record) and "NO" in study.markdown(record)


def test_exactness_without_transformers_records_no_figure(monkeypatch):
    study = studies.load("exactness")
    real = study.importlib.import_module

    def no_hf(name, *args):
        if name in ("torch", "transformers"):
            raise ImportError(f"No module named {name!r}")
        return real(name, *args)

    monkeypatch.setattr(study.importlib, "import_module", no_hf)
    res = study.run(study.Config(families=("llama",), paths=("hf",)))
    [row] = res.records
    assert row["max_abs_err"] is None and row["max_rel_err"] is None and row["within_tolerance"] is None
    assert row["note"].startswith("transformers not installed") and res.extra["versions"]["transformers"] is None


def test_digest_recall_study_runs_and_scores_each_block_size():
    study = studies.load("digest_recall")
    res = study.run(study.Config(contexts=(160,), windows=1, block_sizes=(8, 16), budget=48, queries=2, rerank=2))
    assert [r["block_size"] for r in res.records] == [8, 16]
    for r in res.records:
        assert 0.0 <= r["minmax"] <= 1.0 and 0.0 <= r["minmax+rerank2"] <= 1.0, r


def test_align_pages_study_pairs_every_mode_on_the_same_trials():
    study = studies.load("align_pages")
    cfg = study.Config(lengths=(384,), depths=(0.5,), trials=2, windows=1, budget=96, block_size=16, queries=2)
    res = study.run(cfg)
    needles = [r for r in res.records if r["kind"] == "needle"]
    assert len(needles) == 2 and {r["trial"] for r in needles} == {0, 1}
    for r in needles:
        for m in study.MODES:
            assert isinstance(r[f"{m}_ok"], bool) and r[f"{m}_kv_bytes"] > 0, (m, r)
        assert r["fixed_kv_bytes"] < r["dense_kv_bytes"], "sparse read as much as dense: the budget did not apply"
    summary = res.extra["summary"]["384"]
    for lay in study.ALIGNED:
        s = summary[f"{lay}_vs_fixed"]
        lo, hi = s["needle_diff"]["ci95"]
        assert lo <= s["needle_diff"]["points"] <= hi and s["verdict"] in (
            "helps", "hurts", "mixed", "no measurable difference")
    record = {"config": dataclasses.asdict(cfg), "date": "d", "command": "c", "seconds": 1.0,
              "commit": "x", "summary": res.extra["summary"]}
    assert "| top-level definitions |" in study.markdown(record)


def test_align_pages_verdict_reads_the_intervals():
    v = studies.load("align_pages").verdict
    assert v({"needle_diff": {"ci95": [1, 5]}, "recall_diff": {"ci95": [-0.1, 0.1]}}) == "helps"
    assert v({"needle_diff": {"ci95": [-5, -1]}, "recall_diff": {"ci95": [-0.1, 0.1]}}) == "hurts"
    assert v({"needle_diff": {"ci95": [1, 5]}, "recall_diff": {"ci95": [-0.3, -0.1]}}) == "mixed"
    assert v({"needle_diff": {"ci95": [-5, 5]}, "recall_diff": {"ci95": [-0.1, 0.1]}}) == "no measurable difference"
