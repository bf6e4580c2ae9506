"""The one result record every study writes: `<results_dir>/<study>/<name>.json` and `.md`.

The JSON holds what it takes to reproduce and to trust a figure:

    {"study", "name", "date", "command", "config", "commit", "split", "seeds", "records", ...}

`code` lists the checkout's files the job ran (its script and every module it imported, paths
from the checkout's top): `experiments/results.py --stale` counts a record stale only when one of
these, or conf/, pyproject.toml or the shipped model, changed since `commit`.
`commit` is `git rev-parse HEAD` of the checkout the code was imported from, with "+dirty" when
its tracked files outside `experiments/results/` have uncommitted changes (None outside a git
checkout); `split` is the trial split, dev or test, the seeded trials were drawn from
(`gemini_jax.eval.trials`; None when the study draws no seeded trials); `seeds` the base seed(s) the
trial seeds derive from (None likewise); `records` the study's rows, flat dicts where possible.
Study-specific fields (e.g. a model's layer count) sit beside them.
"""

from __future__ import annotations

import datetime
import json
import os
import subprocess
import sys
from dataclasses import dataclass, field

from gemini_jax import tiny
from gemini_jax.errors import ConfigError

REQUIRED = ("command", "config", "commit", "split", "seeds", "records")


def git_commit(path: str | None = None) -> str | None:
    """`git rev-parse HEAD` of the checkout holding `path` (default: this package), "+dirty" appended
    when `git status --porcelain` lists changes to tracked files outside `experiments/results/`
    (results a run has just rewritten are its output, not its code); None when git or the
    checkout is not there."""
    where = path or os.path.dirname(os.path.abspath(__file__))
    try:
        head = subprocess.run(["git", "rev-parse", "HEAD"], cwd=where, capture_output=True, text=True,
                              check=True, timeout=30).stdout.strip()
        top = subprocess.run(["git", "rev-parse", "--show-toplevel"], cwd=where, capture_output=True, text=True,
                             check=True, timeout=30).stdout.strip()
        # The whole checkout (from its top: a path below it would see only its own directory).
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no", "--", ".",
                                ":(exclude)experiments/results"], cwd=top,
                               capture_output=True, text=True, check=True, timeout=60).stdout.strip()
    except (OSError, subprocess.SubprocessError):
        return None
    return head + ("+dirty" if dirty else "")


def code_files() -> list[str]:
    """The project's Python files this process has run: `sys.argv[0]` and every imported module
    under `gemini_jax/` or `experiments/` of the checkout holding this package (not a virtual
    environment inside it), as sorted paths from its top. Call it when the job's work is done, so
    modules imported on the way are in."""
    top = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    files = {getattr(m, "__file__", None) for m in list(sys.modules.values())} | {sys.argv[0] if sys.argv else None}
    out = set()
    for f in files:
        if f and f.endswith(".py"):
            rel = os.path.relpath(os.path.abspath(f), top)
            if rel.split(os.sep)[0] in ("gemini_jax", "experiments"):
                out.add(rel.replace(os.sep, "/"))
    return sorted(out)


def utc_now() -> str:
    return datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")


@dataclass(frozen=True, kw_only=True)
class StudyResult:
    """What a study's workload returns: the file stem, its rows, and how its trials were drawn."""

    name: str                 # file stem under <results_dir>/<study>/
    records: list             # the study's rows
    split: str | None         # data split the seeded trials came from; None: no seeded trials
    seeds: list | None        # base seed(s) the trial seeds derive from; None likewise
    extra: dict = field(default_factory=dict)  # study-specific fields beside the records


def make_record(study: str, result: StudyResult, *, command: str, config: dict, commit: str | None = None) -> dict:
    """The record for `result`: the fields above, `result.extra` beside them. `commit` defaults to
    `git_commit()`. Raises ConfigError when a name is not a plain file name or `extra` shadows a key."""
    for label, value in (("study", study), ("name", result.name)):
        if not value or os.sep in value or value.startswith("."):
            raise ConfigError(f"record {label}={value!r} must be a plain file name (no '{os.sep}', not hidden).")
    clash = sorted(set(result.extra) & {"study", "name", "date", "code", *REQUIRED})
    if clash:
        raise ConfigError(f"record extra fields {clash} shadow the record's own keys; rename them.")
    return {"study": study, "name": result.name, **provenance(command=command, config=config, split=result.split,
                                                              seeds=result.seeds, commit=commit),
            **result.extra, "records": result.records}


def provenance(*, command: str, config: dict, split: str | None, seeds: list | None,
               commit: str | None = None) -> dict:
    """The record's fields besides study, name and records: date, command, config, commit, split,
    seeds (for writers that lay out the rest of their JSON themselves, e.g. `write_needle`)."""
    out = {"date": utc_now(), "command": command, "config": config,
           "commit": commit if commit is not None else git_commit(), "code": code_files(),
           "split": split, "seeds": seeds}
    if split is not None:  # trials drawn from the corpus: say whether it is the model's own
        out["corpus"] = tiny.corpus_check().as_dict()
    return out


def write_record(results_dir: str, record: dict, markdown: str) -> dict[str, str]:
    """Write `record` to `<results_dir>/<study>/<name>.json` and `markdown` beside it as `.md`;
    returns {"json": path, "md": path}. Raises ConfigError when a required key is missing."""
    missing = [k for k in ("study", "name", *REQUIRED) if k not in record]
    if missing:
        raise ConfigError(f"result record lacks {missing}; build it with make_record().")
    out = os.path.join(results_dir, record["study"])
    os.makedirs(out, exist_ok=True)
    paths = {"json": os.path.join(out, f"{record['name']}.json"), "md": os.path.join(out, f"{record['name']}.md")}
    with open(paths["json"], "w") as fh:
        json.dump(record, fh, indent=1, default=float)
    with open(paths["md"], "w") as fh:
        fh.write(markdown if markdown.endswith("\n") else markdown + "\n")
    return paths


def adds_only_definitions(old_src: str, new_src: str) -> bool:
    """Whether `new_src` is `old_src` plus new top-level functions or classes (no decorators, names
    the old module did not bind), every old statement kept as it was and in order: what ran then
    runs the same now. Docstrings and comments do not count (`experiments/results.py --stale`)."""
    import ast

    try:
        old, new = _without_docstrings(ast.parse(old_src)).body, _without_docstrings(ast.parse(new_src)).body
    except SyntaxError:
        return False
    bound = {n.id for s in old for n in ast.walk(s) if isinstance(n, ast.Name) and isinstance(n.ctx, ast.Store)}
    bound |= {s.name for s in old if isinstance(s, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))}
    bound |= {(a.asname or a.name).split(".")[0] for s in old if isinstance(s, (ast.Import, ast.ImportFrom))
              for a in s.names}
    kept = iter(ast.dump(s) for s in old)
    want = next(kept, None)
    for stmt in new:
        if ast.dump(stmt) == want:
            want = next(kept, None)
        elif not (isinstance(stmt, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))
                  and not stmt.decorator_list and stmt.name not in bound):
            return False
        else:
            bound.add(stmt.name)
    return want is None


def _without_docstrings(tree):
    """`tree` with the docstring of every module, class and function dropped (a body left empty
    gets a `pass`), so two sources that differ only there dump alike."""
    import ast

    for node in ast.walk(tree):
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) \
                    and isinstance(first.value.value, str):
                node.body = node.body[1:] or [ast.Pass()]
    return tree


def same_installs(old_toml: str, new_toml: str) -> bool:
    """Whether two pyproject.toml texts install the same: the Python range, the dependencies and
    every extra the old one had. Tool settings (pytest, ruff, import-linter), the version string
    and a new extra change no measurement."""
    import tomllib

    old, new = tomllib.loads(old_toml).get("project", {}), tomllib.loads(new_toml).get("project", {})
    if any(old.get(k) != new.get(k) for k in ("requires-python", "dependencies")):
        return False
    new_extras = new.get("optional-dependencies", {})
    return all(new_extras.get(name) == deps for name, deps in old.get("optional-dependencies", {}).items())
