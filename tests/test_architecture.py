"""Architecture checks: layers import only downward (import-linter's contract in pyproject.toml),
no import cycle inside gemini_jax (function-local imports count), ruff's rules. Each check is
also shown to fail on a planted violation, in a copy of the package."""

import ast
import json
import os
import re
import shutil
import subprocess
import sys


ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
BIN = os.path.dirname(sys.executable)


def _copy_tree(tmp_path):
    """gemini_jax, pallas_kernels and pyproject.toml copied to tmp_path (to plant violations in)."""
    for pkg in ("gemini_jax", "pallas_kernels"):
        shutil.copytree(os.path.join(ROOT, pkg), tmp_path / pkg, ignore=shutil.ignore_patterns("assets", "__pycache__"))
    shutil.copy(os.path.join(ROOT, "pyproject.toml"), tmp_path / "pyproject.toml")
    return tmp_path


def _lint_imports(cwd):
    env = dict(os.environ, PYTHONPATH=str(cwd))
    return subprocess.run([os.path.join(BIN, "lint-imports"), "--no-cache"], cwd=cwd, env=env,
                          capture_output=True, text=True, timeout=300)


def _cycles(path) -> list:
    """Import cycles among gemini_jax's modules in the tree at `path` (grimp's graph, function-
    local imports included), found in a fresh process so that tree is the one imported."""
    script = ("import grimp, json, networkx\n"
              "graph = grimp.build_graph('gemini_jax', cache_dir=None)\n"
              "g = networkx.DiGraph()\n"
              "for m in graph.modules:\n"
              "    for dep in graph.find_modules_directly_imported_by(m):\n"
              "        g.add_edge(m, dep)\n"
              "print(json.dumps([sorted(c) for c in networkx.strongly_connected_components(g) if len(c) > 1]))\n")
    out = subprocess.run([sys.executable, "-c", script], cwd=path, env=dict(os.environ, PYTHONPATH=str(path)),
                         capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    return json.loads(out.stdout)


def private_imports(root) -> list[str]:
    """`from x import _name` and `module._name` for a module bound by an import, in gemini_jax/:
    a leading underscore means "this file only" (NamedTuple's `_replace` and friends excepted)."""
    found = []
    for dirpath, _, files in os.walk(os.path.join(root, "gemini_jax")):
        for f in files:
            if not f.endswith(".py"):
                continue
            path = os.path.join(dirpath, f)
            tree = ast.parse(open(path).read(), path)
            modules = set()
            for node in ast.walk(tree):
                if isinstance(node, ast.ImportFrom):
                    for alias in node.names:
                        if alias.name.startswith("_") and not alias.name.startswith("__"):
                            found.append(f"{os.path.relpath(path, root)}:{node.lineno}: from {node.module} import "
                                         f"{alias.name}")
                        modules.add(alias.asname or alias.name)
                elif isinstance(node, ast.Import):
                    modules.update((a.asname or a.name).split(".")[0] for a in node.names)
            for node in ast.walk(tree):
                if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and node.value.id in modules
                        and node.attr.startswith("_") and not node.attr.startswith("__")
                        and node.attr not in ("_replace", "_asdict", "_fields", "_make")):
                    found.append(f"{os.path.relpath(path, root)}:{node.lineno}: {node.value.id}.{node.attr}")
    return found


def test_layers_contract_kept():
    out = _lint_imports(ROOT)
    assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-2000:]
    assert "gemini_jax layers import only downward KEPT" in out.stdout


def test_layers_contract_refuses_an_upward_import(tmp_path):
    tree = _copy_tree(tmp_path)
    with open(tree / "gemini_jax" / "cache" / "store.py", "a") as fh:  # a function-local one counts too
        fh.write("\n\ndef _planted():\n    from gemini_jax import engine  # noqa\n    return engine\n")
    out = _lint_imports(tree)
    assert out.returncode != 0, out.stdout[-3000:]
    assert "gemini_jax.cache is not allowed to import gemini_jax.engine" in out.stdout


def test_no_import_cycle_inside_gemini_jax():
    assert _cycles(ROOT) == []


def test_cycle_check_finds_a_planted_cycle(tmp_path):
    tree = _copy_tree(tmp_path)
    with open(tree / "gemini_jax" / "runtime" / "counters.py", "a") as fh:
        fh.write("\n\ndef _planted():\n    from gemini_jax.runtime import tiered  # noqa\n    return tiered\n")
    cycles = _cycles(tree)
    assert any("gemini_jax.runtime.counters" in c for c in cycles), cycles


def test_ruff_passes_and_refuses_more_than_8_parameters(tmp_path):
    ruff = [os.path.join(BIN, "ruff"), "check", "--output-format", "json", "--no-cache"]
    out = subprocess.run(ruff + ["."], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stdout[-3000:]
    tree = _copy_tree(tmp_path)
    bad = tree / "gemini_jax" / "planted.py"
    bad.write_text("def f(a, b, c, d, e, f_, g, h, i):\n    return a\n")
    out = subprocess.run(ruff + [str(bad)], cwd=tree, capture_output=True, text=True, timeout=300)
    assert out.returncode != 0 and "PLR0913" in {v["code"] for v in json.loads(out.stdout)}, out.stdout


def test_no_private_names_across_modules(tmp_path):
    assert private_imports(ROOT) == []
    tree = _copy_tree(tmp_path)
    (tree / "gemini_jax" / "planted.py").write_text(
        "from gemini_jax.runtime.tiered import _front\nfrom gemini_jax.runtime import tiered\n\n\n"
        "def f():\n    return _front, tiered._back\n")
    assert private_imports(tree) == ["gemini_jax/planted.py:1: from gemini_jax.runtime.tiered import _front",
                                      "gemini_jax/planted.py:6: tiered._back"]


# Training / experiment tooling that the GPU machine lacks: the package must not need it.
OPTIONAL = ("hydra", "omegaconf", "wandb")
_BLOCK = "import sys\nfor name in {names!r}:\n    sys.modules[name] = None  # `import name` raises ImportError\n"


def _run_blocked(code: str, names=OPTIONAL):
    return subprocess.run([sys.executable, "-c", _BLOCK.format(names=names) + code], cwd=ROOT,
                          env=dict(os.environ, PYTHONPATH=ROOT, JAX_PLATFORMS="cpu"),
                          capture_output=True, text=True, timeout=300)


def test_package_and_engine_need_no_hydra_or_wandb():
    """`import gemini_jax`, the shipped model and an Engine run with hydra, omegaconf and wandb
    unimportable (as on the GPU machine)."""
    code = ("import gemini_jax as gj\n"
            "eng = gj.Engine(gj.load_tiny(), gj.EngineConfig(max_seq_len=64, max_batch=1, prefill_chunk=32))\n"
            "out = eng.generate([[1, 2, 3]], gj.SamplingParams(max_new_tokens=2, temperature=0.0))\n"
            "assert len(out.tokens[0]) == 2, out.tokens\n"
            "print('ok')\n")
    out = _run_blocked(code)
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_engine_runs_on_a_bare_jax_flax_stack():
    """With tqdm and safetensors unimportable too (only jax's and flax's stack, as on the GPU
    machine), the package, dispatch and an Engine over in-memory weights run."""
    code = ("import gemini_jax as gj\n"
            "from gemini_jax.attention import dispatch\n"
            "from gemini_jax.testing import random_model, tiny_config\n"
            "eng = gj.Engine(random_model(tiny_config('llama'), 0), gj.EngineConfig(max_seq_len=64, max_batch=1,\n"
            "                                                                        prefill_chunk=32))\n"
            "out = eng.generate([[1, 2, 3]], gj.SamplingParams(max_new_tokens=2, temperature=0.0))\n"
            "assert len(out.tokens[0]) == 2, out.tokens\n"
            "print('ok')\n")
    out = _run_blocked(code, names=(*OPTIONAL, "tqdm", "safetensors", "tokenizers"))
    assert out.returncode == 0 and out.stdout.strip().endswith("ok"), out.stderr[-3000:]


def test_blocking_optional_modules_takes_effect():
    """Control for the test above: with the same block, code that does need Hydra fails."""
    out = _run_blocked("from gemini_jax import hydra_schema\nhydra_schema.register()\n")
    assert out.returncode != 0 and "No module named 'hydra" in out.stderr, out.stderr[-3000:]


# ---- the decode core's boundaries (AST, so strings and comments never count) ---------------------
OUTSIDE_RUNTIME = ("gemini_jax/serve", "gemini_jax/session", "gemini_jax/eval", "experiments")
ENGINE_NAMES = {"engine", "eng", "e", "_engine"}
INTERNALS = {"pages", "store", "ctx", "prefixes"}
STORES = {"TieredStore", "PooledStore"}
SAMPLERS = {"sample", "sample_with", "token_keys", "keys_from"}


def _py_files(root, dirs):
    for d in dirs:
        for dirpath, _, files in os.walk(os.path.join(root, d)):
            for f in sorted(files):
                if f.endswith(".py"):
                    yield os.path.relpath(os.path.join(dirpath, f), root)


def _last_name(node):
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    return None


def boundary_violations(root) -> dict:
    """What the decode core's boundaries forbid, as "path:line: what" per rule:
    - `engine_internals`: `<engine>.pages / .store / .ctx / .prefixes` in serve/, session/, eval/ and
      experiments/ (they use `engine.sequences`, `engine.runner`, `engine.tier_stats`);
    - `store_isinstance`: `isinstance(x, TieredStore | PooledStore)` outside cache/ and tiers/
      (callers read the store's capabilities);
    - `sampling`: gemini_jax.sampling's functions called or imported outside runtime/ and
      sampling.py (the decode driver, runtime/driver.py, is the one place that samples)."""
    out = {"engine_internals": [], "store_isinstance": [], "sampling": []}
    for rel in _py_files(root, ("gemini_jax", "experiments")):
        tree = ast.parse(open(os.path.join(root, rel)).read(), rel)
        outside = rel.startswith(OUTSIDE_RUNTIME)
        in_store_pkg = rel.startswith(("gemini_jax/cache/", "gemini_jax/tiers/"))
        may_sample = rel.startswith("gemini_jax/runtime/") or rel == "gemini_jax/sampling.py"
        for node in ast.walk(tree):
            if outside and isinstance(node, ast.Attribute) and node.attr in INTERNALS \
                    and _last_name(node.value) in ENGINE_NAMES:
                out["engine_internals"].append(f"{rel}:{node.lineno}: .{node.attr}")
            if not in_store_pkg and isinstance(node, ast.Call) and _last_name(node.func) == "isinstance" \
                    and len(node.args) == 2:
                kinds = node.args[1].elts if isinstance(node.args[1], ast.Tuple) else [node.args[1]]
                if any(_last_name(k) in STORES for k in kinds):
                    out["store_isinstance"].append(f"{rel}:{node.lineno}: isinstance")
            if not may_sample and isinstance(node, ast.ImportFrom) and node.module == "gemini_jax.sampling":
                out["sampling"].append(f"{rel}:{node.lineno}: import")
            if not may_sample and isinstance(node, ast.Attribute) and node.attr in SAMPLERS \
                    and _last_name(node.value) == "sampling":
                out["sampling"].append(f"{rel}:{node.lineno}: sampling.{node.attr}")
    return out


def test_decode_core_boundaries_hold():
    found = boundary_violations(ROOT)
    assert found == {"engine_internals": [], "store_isinstance": [], "sampling": []}, found


PLANTS = {
    "engine_internals": ("gemini_jax/serve/scheduler.py", "\n\ndef _planted(engine):\n    return engine.pages.pool\n"),
    "store_isinstance": ("gemini_jax/runtime/paged.py",
                         "\n\ndef _planted(s):\n    from gemini_jax.tiers import TieredStore\n"
                         "    return isinstance(s, (int, TieredStore))\n"),
    "sampling": ("gemini_jax/session/session.py", "\n\nfrom gemini_jax.sampling import sample_with  # noqa\n"),
}


def test_boundary_check_finds_each_planted_violation(tmp_path):
    """Each rule of `boundary_violations` fails on one planted line, and on that rule only."""
    for rule, (rel, code) in PLANTS.items():
        root = tmp_path / rule
        for d in ("gemini_jax", "experiments"):
            shutil.copytree(os.path.join(ROOT, d), root / d,
                            ignore=shutil.ignore_patterns("assets", "results", "__pycache__"))
        with open(root / rel, "a") as f:
            f.write(code)
        found = boundary_violations(str(root))
        assert len(found[rule]) == 1 and found[rule][0].startswith(rel), (rule, found)
        assert all(not v for k, v in found.items() if k != rule), (rule, found)


def test_readme_decode_path_names_at_most_six_modules_that_exist():
    """The README's decode path (from `Engine.generate` to the kernel) is a short list of hops, each
    with its file: at most six modules of gemini_jax on the way, every one of them in the tree."""
    with open(os.path.join(ROOT, "README.md")) as fh:
        text = fh.read()
    start = text.index("The decode path of `eng.generate`")
    para = text[start:text.index("call to the kernel", start)]
    chain = para[para.index("`Engine.generate`"):]
    # The main chain's files; a parenthesis that names the tiered alternative is not a hop.
    files = []
    for name in re.findall(r"`([a-z_/]+\.py)", re.sub(r"; `runtime/tiered\.py` over tiers", "", chain)):
        path = name if name.startswith("gemini_jax/") else f"gemini_jax/{name}"
        assert os.path.isfile(os.path.join(ROOT, path)), f"README's decode path names {name}, not a file"
        if path not in files:
            files.append(path)
    assert files[0] == "gemini_jax/engine.py" and "gemini_jax/attention/dispatch.py" in files, files
    assert len(files) <= 6, f"{len(files)} modules on the decode path: {files}"
    assert "pallas_kernels/" in chain


def test_both_stores_implement_the_kv_store_protocol():
    """`PooledStore` and `TieredStore` offer every member of `KVStore` with its parameters, so
    callers can hold either through the protocol (and read capabilities, never the class)."""
    import inspect

    from gemini_jax.cache.store import KVStore, PooledStore
    from gemini_jax.tiers import TieredStore

    members = [n for n in dir(KVStore) if not n.startswith("_")]
    assert {"update", "gather", "scatter", "device", "layerwise", "supports_padding"} <= set(members) | set(
        KVStore.__annotations__)
    for cls in (PooledStore, TieredStore):
        for name in members:
            want, got = getattr(KVStore, name), getattr(cls, name, None)
            assert got is not None, f"{cls.__name__} lacks {name}"
            if callable(want) and not isinstance(want, property):
                assert list(inspect.signature(got).parameters) == list(inspect.signature(want).parameters), \
                    f"{cls.__name__}.{name}{inspect.signature(got)} differs from KVStore.{name}{inspect.signature(want)}"
            assert isinstance(want, property) == isinstance(got, property), f"{cls.__name__}.{name}"
        for cap in KVStore.__annotations__:
            assert isinstance(getattr(cls, cap), bool), f"{cls.__name__}.{cap} is a class-level capability"
