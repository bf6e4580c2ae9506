"""Every committed result file can be trusted to say where it came from; the generated pages are what
their sources render to (docs/results.md: the record files, experiments/results_tables.py; docs/knobs.md:
gemini_jax/config/, experiments/knobs.py); every relative link in README.md and docs/ names a file here."""

from __future__ import annotations

import dataclasses
import importlib.util
import json
import os
import re
import subprocess
import sys

import pytest

from gemini_jax.eval.record import adds_only_definitions, same_installs
from test_ablate import ROOT

RESULTS = os.path.join(ROOT, "experiments", "results")


def _tables():
    spec = importlib.util.spec_from_file_location("results_tables", os.path.join(ROOT, "experiments",
                                                                                 "results_tables.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


rt = _tables()


def _results_module():
    """experiments/results.py as a module (it is a script, not a package member)."""
    spec = importlib.util.spec_from_file_location("results", os.path.join(ROOT, "experiments", "results.py"))
    mod = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("results", mod)  # dataclasses look the module up
    spec.loader.exec_module(mod)
    return mod


def _git(*args) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=60)


def test_every_current_result_file_records_command_config_commit_split_and_seeds():
    current = rt.result_files(RESULTS)
    assert current, "no result records under experiments/results/"
    bad = {}
    for rel in current:
        with open(os.path.join(RESULTS, rel)) as fh:
            problems = rt.record_problems(json.load(fh))
        if problems:
            bad[rel] = problems
    assert not bad, f"result files without provenance: {bad}"


def test_result_commits_are_in_this_history():
    if _git("rev-parse", "--is-inside-work-tree").returncode != 0:
        pytest.skip("not a git checkout: commits cannot be looked up")
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "true":
        pytest.skip("shallow clone: older commits are not here")
    current = rt.result_files(RESULTS)
    for rel in current:
        with open(os.path.join(RESULTS, rel)) as fh:
            commit = json.load(fh)["commit"]
        proc = _git("merge-base", "--is-ancestor", commit, "HEAD")
        assert proc.returncode == 0, f"{rel}: commit {commit} is not an ancestor of HEAD ({proc.stderr.strip()})"


def test_record_problems_name_each_planted_defect():
    good = {"command": "python experiments/run.py", "config": {}, "commit": "a" * 40, "split": "test",
            "seeds": [0], "records": []}
    assert rt.record_problems(good) == []
    planted = {"command": ({k: v for k, v in good.items() if k != "command"}, "lacks 'command'"),
               "dirty": ({**good, "commit": "a" * 40 + "+dirty"}, "not a clean 40-hex commit"),
               "none": ({**good, "commit": None}, "not a clean 40-hex commit"),
               "seeds": ({**good, "seeds": None}, "drew trials but seeds"),
               "split": ({**good, "split": "heldout"}, "is not dev, test or null"),
               "list": ([good], "not a record")}
    for name, (rec, want) in planted.items():
        problems = rt.record_problems(rec)
        assert any(want in p for p in problems), (name, problems)


def test_results_page_tables_are_what_the_files_render_to():
    with open(os.path.join(ROOT, rt.DOC)) as fh:
        text = fh.read()
    assert set(re.findall(r"<!-- results:(\w+) -->", text)) == set(rt.BLOCKS), f"{rt.DOC} lacks a generated block"
    rendered, changed = rt.render(text, RESULTS)
    assert changed == 0, f"{rt.DOC} tables differ from the files: run `python experiments/results.py --render`"


def test_knobs_page_is_what_config_py_renders_to():
    spec = importlib.util.spec_from_file_location("knobs", os.path.join(ROOT, "experiments", "knobs.py"))
    knobs = importlib.util.module_from_spec(spec)
    sys.modules.setdefault("knobs", knobs)  # dataclasses look the module up
    spec.loader.exec_module(knobs)
    with open(os.path.join(ROOT, knobs.DOC)) as fh:
        text = fh.read()
    assert text == knobs.render(ROOT), f"{knobs.DOC} differs from config/: run `python experiments/knobs.py`"
    from gemini_jax import config

    every = {c for c in vars(config).values() if isinstance(c, type) and dataclasses.is_dataclass(c)
             and c.__module__.startswith(config.__name__ + ".")}
    assert {s.cls for s in knobs.SECTIONS} == every, "a config dataclass has no section in docs/knobs.md"
    missing = [f"{s.key}.{f.name}" for s in knobs.SECTIONS for f in dataclasses.fields(s.cls)
               if f"| `{s.key}.{f.name}` |" not in text]
    assert not missing, missing


def _anchors(path: str) -> set[str]:
    """The heading anchors GitHub gives a markdown page: lowercased, punctuation dropped, spaces as '-'."""
    with open(path) as fh:
        text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in re.findall(r"^#+ (.*)$", text, re.M)}


def test_relative_links_in_readme_and_docs_name_files_in_the_repository():
    pages = ["README.md"] + [os.path.join("docs", f) for f in sorted(os.listdir(os.path.join(ROOT, "docs")))
                             if f.endswith(".md")]
    broken = []
    for page in pages:
        with open(os.path.join(ROOT, page)) as fh:
            text = re.sub(r"```.*?```", "", fh.read(), flags=re.S)  # code blocks hold commands, not links
        for target in re.findall(r"\]\(([^)\s]+)\)", text):
            if re.match(r"[a-z]+:", target):
                continue
            file, _, anchor = target.partition("#")
            path = os.path.normpath(os.path.join(ROOT, os.path.dirname(page), file)) if file else os.path.join(ROOT, page)
            if not os.path.exists(path) or (anchor and path.endswith(".md") and anchor not in _anchors(path)):
                broken.append((page, target))
    assert not broken, broken


def test_render_fills_a_stale_block_and_refuses_an_unknown_one(tmp_path):
    (tmp_path / "needle").mkdir()
    stale = "a\n<!-- results:needle -->\n| old | 99% |\n<!-- /results:needle -->\nb\n"
    new, changed = rt.render(stale, str(tmp_path))
    assert changed == 1 and "99%" not in new and "not run yet (`make results SUBSET=needle`)" in new
    rec = {"by_length": [{"length": 8192, "hits": 190, "trials": 200, "accuracy": 0.95, "ci95": [0.91, 0.97]}],
           "commit": "b" * 40}
    (tmp_path / "needle" / "rerank_8k_test.json").write_text(json.dumps(rec))
    new, _ = rt.render(stale, str(tmp_path))
    assert "95.0% [91.0, 97.3] (190/200)" in new and "✓ (interval reaches below)" in new, new
    with pytest.raises(ValueError, match="no renderer"):
        rt.render("<!-- results:nope -->\n<!-- /results:nope -->\n", str(tmp_path))


def test_quantized_records_pair_with_the_float_trials_they_share():
    """kv_quant_block pairs trial t of cell c of a quantized run with trial t of cell c of the float32
    record (which drew more trials per cell); a trial whose key differs is refused, never paired."""
    seed = 7
    rng = __import__("numpy").random.default_rng(seed)
    depths = [0.1, 0.9]
    base = {"name": "base", "trials": 4, "depths": depths, "records": [
        {"length": 8192, "depth": d, "key": f"{i}{t}", "ok": bool(rng.integers(2)), "generated": f"{i}{t}."}
        for i, d in enumerate(depths) for t in range(4)]}
    quant = {"name": "q", "trials": 2, "depths": depths, "records": [
        {**base["records"][i * 4 + t], "ok": bool(rng.integers(2))} for i in range(2) for t in range(2)]}
    p = rt.paired_needle(quant, base)
    pairs = [(quant["records"][i * 2 + t]["ok"], base["records"][i * 4 + t]["ok"]) for i in range(2) for t in range(2)]
    assert p["n"] == 4 and p["quant"] == sum(a for a, _ in pairs) and p["base"] == sum(b for _, b in pairs), seed
    assert (p["fixed"], p["lost"]) == (sum(a and not b for a, b in pairs), sum(b and not a for a, b in pairs)), seed
    assert p["lo"] <= p["diff"] <= p["hi"]
    quant["records"][3]["key"] = "x"
    with pytest.raises(ValueError, match="trial 3 is not base trial 5"):
        rt.paired_needle(quant, base)
    bq = {"records": [{"context": 2048, "per_window": [1.0, 1.1]}]}
    bb = {"records": [{"context": 2048, "per_window": [1.0, 1.0, 5.0]}]}
    (row,) = rt.paired_bpb(bq, bb)
    assert row["n"] == 2 and row["rel"] == pytest.approx(0.05) and row["base"] == 1.0


def test_stale_check_tells_code_changes_from_none():
    """`results.py --stale`: a record measured at HEAD is current, one measured at the first commit is
    not, and a commit this clone lacks is said to be missing, not taken as current."""
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git checkout: older commits are not here")
    mod = _results_module()
    head = _git("rev-parse", "HEAD").stdout.strip()
    first = _git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    assert mod._changed_since(head) == 0
    assert mod._changed_since(first) > 0
    assert mod._changed_since("f" * 40) == -1 and mod._changed_since("") == -1


def test_stale_check_ignores_added_files_and_tool_settings():
    """A file added since a record's commit, and a pyproject.toml change to tool settings or a new
    extra, leave the record current; a changed dependency or extra does not."""
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git checkout: older commits are not here")
    mod = _results_module()
    first = _git("rev-list", "--max-parents=0", "HEAD").stdout.split()[0]
    added = _git("diff", "--name-only", "--diff-filter=A", first, "HEAD", "--", "gemini_jax").stdout.split()
    assert added, "no file under gemini_jax/ was added since the first commit"
    assert mod._changed_since(first, added[:5]) == mod._changed_since(first, [])
    base = '[project]\nrequires-python = ">=3.10"\ndependencies = ["jax>=0.7"]\n' \
           '[project.optional-dependencies]\nhf = ["torch==2.13.0"]\n'
    assert same_installs(base, base + '[tool.pytest.ini_options]\naddopts = "-q"\n')
    assert same_installs(base, base.replace('hf = ["torch==2.13.0"]', 'hf = ["torch==2.13.0"]\ncode = ["x"]'))
    assert not same_installs(base, base.replace("jax>=0.7", "jax>=0.8"))
    assert not same_installs(base, base.replace("torch==2.13.0", "torch==2.14.0"))
    assert not same_installs(base, base.replace(">=3.10", ">=3.11"))


def test_stale_check_lets_a_module_gain_new_definitions_only():
    """A module that only gains new undecorated top-level functions or classes runs its old code
    the same; any other edit (a changed or removed statement, a rebound name, a decorator, a new
    assignment) counts as a change."""
    old = '"""Errors."""\nimport os\n\nLIMIT = 3\n\n\nclass Base(Exception):\n    pass\n\n\ndef f(x):\n    return x + LIMIT\n'
    new_class = "\n\nclass SourceError(Base, ValueError):\n    \"\"\"Bad source.\"\"\"\n"
    assert adds_only_definitions(old, old)
    assert adds_only_definitions(old, old + new_class)
    assert adds_only_definitions(old, old.replace("\n\ndef f", new_class + "\n\ndef f"))  # in between
    assert adds_only_definitions(old, old.replace("return x + LIMIT", "return x  +  LIMIT"))  # layout only
    assert not adds_only_definitions(old, old.replace("LIMIT = 3", "LIMIT = 4"))
    assert not adds_only_definitions(old, old.replace("return x + LIMIT", "return x - LIMIT"))
    assert not adds_only_definitions(old, old + "\n\ndef f(x):\n    return 0\n")  # rebinds f
    assert not adds_only_definitions(old, old + "\n\ndef os():\n    pass\n")  # rebinds an import
    assert not adds_only_definitions(old, old + "\n\n@register\ndef g():\n    pass\n")
    assert not adds_only_definitions(old, old + "\nEXTRA = 1\n")
    assert not adds_only_definitions(old, old.replace("LIMIT = 3\n", ""))  # a statement removed
    assert not adds_only_definitions(old, "def (:\n")
    # Docstrings are not code: rewording one (or adding, or dropping it) changes nothing that runs.
    assert adds_only_definitions(old, old.replace('"""Errors."""', '"""Errors, reworded."""'))
    assert adds_only_definitions(old, old.replace("    return x + LIMIT", '    """Add."""\n    return x + LIMIT'))
    assert adds_only_definitions(old.replace("    pass\n", '    """Base."""\n'), old)
    assert not adds_only_definitions(old, old.replace("    return x + LIMIT", '    "Add."\n    return x - LIMIT'))
    assert not adds_only_definitions(old, old.replace("LIMIT = 3", 'LIMIT = "3"'))  # a string that is data


def test_stale_check_counts_only_the_code_a_record_ran():
    """A record that lists its code is stale when one of those files changed, not when another did."""
    if _git("rev-parse", "--is-shallow-repository").stdout.strip() != "false":
        pytest.skip("not a full git checkout: older commits are not here")
    mod = _results_module()
    tracked = set(_git("ls-files", "gemini_jax", "experiments").stdout.split())
    for commit in _git("rev-list", "--max-count=200", "HEAD").stdout.split():
        if mod._changed_since(commit, []) != 0:
            break  # older commits differ in configs, dependencies or the model too: nothing clean to compare
        changed = [f for f in _git("diff", "--name-only", "--diff-filter=a", commit, "HEAD", "--", "gemini_jax").stdout.split()
                   if f.endswith(".py") and f in tracked and not mod._only_adds_definitions(commit, f)]
        if changed:
            differ = set(_git("diff", "--name-only", commit, "HEAD").stdout.split())
            same = sorted(f for f in tracked if f.endswith(".py") and f not in differ)[0]
            assert mod._changed_since(commit, [same]) == 0, (commit, same)
            assert mod._changed_since(commit, [changed[0], same]) == 1, (commit, changed[0])
            assert mod._changed_since(commit) >= 1
            return
    pytest.skip("no recent commit changed gemini_jax/ alone")


def test_stale_check_reads_only_the_experiment_a_run_selected():
    """conf/experiment/<x>.yaml counts for runs of x and of experiments whose file names x, not for others."""
    mod = _results_module()
    jobs = {j.record: j for js in mod.SUBSETS.values() for j in js}
    assert mod._experiment_of(jobs["align_pages/align_pages"]) == "align_pages"
    assert mod._experiment_of(jobs["needle/rerank_8k_test"]) == "needle"
    assert mod._experiment_of(jobs["reproduce/needle_rerank_8k_test"]) == "needle"  # the reproduced run's
    assert mod._experiment_of(jobs["bench_decode/bench"]) is None  # not a run.py job: every file counts
    assert mod._unread_experiment("conf/experiment/exactness.yaml", "needle")
    assert not mod._unread_experiment("conf/experiment/needle.yaml", "needle")
    assert not mod._unread_experiment("conf/experiment/exactness.yaml", None)
    assert not mod._unread_experiment("conf/engine/default.yaml", "needle")  # read by every run
    assert not mod._unread_experiment("conf/experiment/ablate_base.yaml", "ablate_block_size")  # named by its defaults
    assert mod._unread_experiment("conf/experiment/ablate_base.yaml", "needle")


def test_a_record_lists_the_project_code_its_job_imported():
    import gemini_jax.engine  # noqa: F401  (a job's imports)
    from gemini_jax.eval import record
    files = record.code_files()
    assert "gemini_jax/eval/record.py" in files and "gemini_jax/engine.py" in files
    assert all(f.split("/")[0] in ("gemini_jax", "experiments") and f.endswith(".py") for f in files), files


def test_stale_only_runs_the_stale_and_absent_jobs_alone(monkeypatch, tmp_path):
    """`results.py --stale-only`: a job runs when its record is absent or stale, not when current."""
    res = _results_module()
    present = tmp_path / "present.json"
    present.write_text("{}")
    jobs = [res.Job("x/current", (), 1), res.Job("x/stale", (), 1), res.Job("x/absent", (), 1)]
    paths = {"x/current": str(present), "x/stale": str(present), "x/absent": str(tmp_path / "absent.json")}
    monkeypatch.setattr(res.Job, "path", property(lambda self: paths[self.record]))
    monkeypatch.setitem(res.SUBSETS, "x", jobs)
    monkeypatch.setattr(res, "stale_records", lambda: [("x/stale", "abc1234", "1 code file(s) changed since")])
    ran = []

    class Done:
        returncode = 0

    monkeypatch.setattr(res.subprocess, "run", lambda cmd, **kw: ran.append(cmd[1]) or Done())
    assert res.run_subset("x", missing_only=False, stale_only=True) == 0
    assert len(ran) == 2, ran  # the stale and the absent job, not the current one


def test_gpu_records_name_a_commit_of_this_history_and_their_readme_says_which_code_ran():
    """experiments/results/gpu/ (gpu_check.sh on a lent machine) is not a `make results` record: each
    JSON there still carries its command and a commit of this history, and README.md names that commit."""
    gpu = os.path.join(RESULTS, rt.GPU)
    files = [os.path.join(d, f) for d, _, fs in os.walk(gpu) for f in fs if f.endswith(".json")]
    if not files:
        pytest.skip("no GPU records")
    with open(os.path.join(gpu, "README.md")) as fh:
        readme = fh.read()
    for path in files:
        with open(path) as fh:
            rec = json.load(fh)
        commit = rec["commit"].removesuffix("+dirty")
        assert rec.get("command") and commit, path
        assert commit[:7] in readme, f"{path}: commit {commit[:7]} is not named in gpu/README.md"
        if _git("rev-parse", "--is-shallow-repository").stdout.strip() == "false":
            assert _git("merge-base", "--is-ancestor", commit, "HEAD").returncode == 0, f"{path}: {commit}"
