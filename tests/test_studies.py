"""Studies run by `experiments/run.py experiment=<study>` (gemini_jax.eval.studies) and the one result
record they write (gemini_jax.eval.record)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys

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
