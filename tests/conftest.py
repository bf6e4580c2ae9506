"""Shared test setup. Tests run on CPU unless JAX_PLATFORMS says otherwise (set before jax loads)."""

import functools
import os
import shutil
import tempfile

os.environ.setdefault("JAX_PLATFORMS", "cpu")

# Tests run tiny shapes, so the suite's time is mostly XLA compiling thousands of distinct
# programs; LLVM at -O0 compiles them about 1.6x faster (a 62-case sample: 266 s against 430 s)
# and runs them slower, which tiny shapes do not feel. The HLO, its fusions and the float32
# semantics are the same; only the machine code is less optimised. Benchmarks and `make run` do
# not load this file and keep XLA's default. Put the flag in XLA_FLAGS yourself to choose.
if "xla_backend_optimization_level" not in os.environ.get("XLA_FLAGS", ""):
    os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") + " --xla_backend_optimization_level=0").strip()

# One XLA compile per distinct program in a run. Every Engine jits its own step functions, so two
# engines of one configuration (tests build many) lower the same program twice; JAX's persistent
# compilation cache, keyed by the lowered program, serves the second from disk. The directory is
# this run's own and removed at its end (subprocesses inherit it: Hydra jobs, the mesh check).
# Set JAX_COMPILATION_CACHE_DIR yourself to keep a cache across runs.
_XLA_CACHE = None
if "JAX_COMPILATION_CACHE_DIR" not in os.environ:
    _XLA_CACHE = tempfile.mkdtemp(prefix="gemini_jax-xla-cache-")
    os.environ["JAX_COMPILATION_CACHE_DIR"] = _XLA_CACHE
    os.environ.setdefault("JAX_PERSISTENT_CACHE_MIN_COMPILE_TIME_SECS", "0")  # tiny programs add up too

import pytest  # noqa: E402

# Each test module's kind (`pytest -m unit`, `-m integration`, `-m e2e`):
#   unit        one piece on its own (a config, the allocator, a store, a kernel vs its reference)
#   integration pieces together through the Engine (exactness invariants, tiers, sessions, meshes)
#   e2e         the entry points a user runs (experiments/*.py, Hydra sweeps, notebooks)
# A new test module must be listed here: collection fails otherwise, so no test goes unclassified.
KINDS = {
    "unit": ("test_architecture", "test_code_encoder", "test_code_nodes", "test_config", "test_corpus", "test_data", "test_encoders", "test_gguf", "test_journal", "test_decode_kernels_gpu", "test_kernel_lowering", "test_paged_cache", "test_paged_decode_kernel", "test_quantized_kernels", "test_ruler",
             "test_sampling", "test_serve_policy", "test_sparse_decode_kernel", "test_tiers_config", "test_tiers_cost",
             "test_tiers_emulate", "test_tiers_link", "test_tiers_prefix", "test_tiers_prefetch", "test_tiers_residency", "test_tiers_stores"),
    "integration": ("test_aligned_pages", "test_engine", "test_prompt_images", "test_eval", "test_kv_quant", "test_mesh", "test_multistep", "test_serve_scheduler", "test_session", "test_sparse", "test_tiers_engine", "test_tiers_recompute",
                    "test_tiers_sharded", "test_tiny", "test_weights"),
    "e2e": ("test_ablate", "test_ruler_grid", "test_bench", "test_serve_http", "test_needle_diagnose", "test_notebooks", "test_report", "test_results_files", "test_run",
            "test_studies"),
}
_KIND_OF = {module: kind for kind, modules in KINDS.items() for module in modules}


def pytest_collection_modifyitems(config, items):
    for item in items:
        module = item.module.__name__.rsplit(".", 1)[-1]
        if module not in _KIND_OF:
            raise pytest.UsageError(f"tests/{module}.py has no kind: add it to KINDS in tests/conftest.py "
                                    f"(unit, integration or e2e).")
        item.add_marker(getattr(pytest.mark, _KIND_OF[module]))


_PEAK_AREAS = {"count": 0, "where": ""}


def _memory_areas() -> int:
    try:
        with open("/proc/self/maps") as f:
            return sum(1 for _ in f)
    except OSError:  # not Linux
        return 0


def _drop_compiled_programs() -> None:
    import gc

    import jax

    gc.collect()
    jax.clear_caches()
    gc.collect()


def _note_areas(where: str) -> int:
    areas = _memory_areas()
    if areas > _PEAK_AREAS["count"]:
        _PEAK_AREAS.update(count=areas, where=where)
    return areas


@pytest.fixture(scope="module", autouse=True)
def _free_compiled_programs(request):
    """Drop the compiled programs at a module's end once the process holds many memory areas. XLA's
    CPU backend maps every executable it loads into areas of its own; over the whole suite one
    process would hold more of them than the kernel allows a process (`vm.max_map_count`, 65530 by
    default), and the next `mmap` inside the compiler then fails as a segmentation fault (a full
    run crashed so near test 535). Past a third of the limit, a module's end clears them; programs
    that later modules reuse stay compiled until then."""
    yield
    if _note_areas(request.module.__name__) > _area_limit() // 3:
        _drop_compiled_programs()


@pytest.fixture(autouse=True)
def _memory_area_guard(request):
    """The same check after every test, at half the limit: one module can add tens of thousands of
    areas (test_tiers_engine ended a fresh-clone run at 37,765), so a module's end can come too late.
    Clearing mid-module costs the module's fixtures one recompile."""
    yield
    if _note_areas(request.node.nodeid) > _area_limit() // 2:
        _drop_compiled_programs()


@functools.cache
def _area_limit() -> int:
    try:
        with open("/proc/sys/vm/max_map_count") as f:
            return int(f.read())
    except (OSError, ValueError):
        return 65530  # the kernel's default


def _order_line(config) -> str | None:
    """The random test order's seed (pytest-randomly), as the option that replays it."""
    seed = getattr(config.option, "randomly_seed", None)
    if seed is None or not config.pluginmanager.hasplugin("randomly"):
        return None
    return f"test order: random, --randomly-seed={seed} replays it (-p no:randomly: file order)"


def pytest_sessionstart(session):
    line = _order_line(session.config)
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if line and reporter is not None:
        reporter.write_line(line)


def pytest_terminal_summary(terminalreporter):
    """Say how close the suite came to the per-process memory-area limit (see above), and the order's seed."""
    line = _order_line(terminalreporter.config)
    if line:
        terminalreporter.write_line(line)
    if _PEAK_AREAS["count"]:
        limit = _area_limit()
        terminalreporter.write_line(f"memory areas after a test: at most {_PEAK_AREAS['count']} "
                                    f"({_PEAK_AREAS['where']}), the per-process limit is {limit}")
    if _XLA_CACHE is not None:
        files = [os.path.join(d, f) for d, _, fs in os.walk(_XLA_CACHE) for f in fs]
        mb = sum(os.path.getsize(f) for f in files) / 1e6
        terminalreporter.write_line(f"compilation cache: {len(files)} programs, {mb:.0f} MB (removed at exit)")


def pytest_unconfigure(config):
    if _XLA_CACHE is not None:
        shutil.rmtree(_XLA_CACHE, ignore_errors=True)
