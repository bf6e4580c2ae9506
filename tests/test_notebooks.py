"""The notebooks execute headless, top to bottom, with the venv's python3 kernel (nbclient).

01_tour runs as shipped (small sizes); 02_ablations plots a tiny real sweep (run by
test_ablate's helper, shared within a session), and runs its own when told to (a fresh clone has none). wandb is offline and every wandb directory
lives under the test's temporary directory. Runtimes are printed, not asserted (timed tests
would fail on a loaded machine); each notebook takes well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import os
import sys
import time

import pytest

nbformat = pytest.importorskip("nbformat")
nbclient = pytest.importorskip("nbclient")

from test_ablate import shared_block_size_sweep  # noqa: E402

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
NOTEBOOKS = os.path.join(ROOT, "notebooks")


@pytest.fixture
def kernel_env(tmp_path, monkeypatch):
    """The kernel inherits this process's environment: CPU, wandb offline under tmp."""
    for key, value in dict(JAX_PLATFORMS="cpu", WANDB_MODE="offline", WANDB_SILENT="true",
                           WANDB_DIR=str(tmp_path / "wandb"), WANDB_CACHE_DIR=str(tmp_path / "wandb_cache"),
                           WANDB_CONFIG_DIR=str(tmp_path / "wandb_config"),
                           WANDB_DATA_DIR=str(tmp_path / "wandb_data")).items():
        monkeypatch.setenv(key, value)
    # Kernel specs whose argv starts with "python" run as this interpreter (jupyter_client),
    # so the kernel sees the venv's packages.
    monkeypatch.setenv("PATH", os.path.dirname(sys.executable) + os.pathsep + os.environ.get("PATH", ""))


def execute(name: str):
    nb = nbformat.read(os.path.join(NOTEBOOKS, name), as_version=4)
    client = nbclient.NotebookClient(nb, timeout=300, kernel_name="python3",
                                     resources={"metadata": {"path": NOTEBOOKS}})
    t0 = time.perf_counter()
    client.execute()  # raises CellExecutionError naming the failing cell
    print(f"{name}: executed in {time.perf_counter() - t0:.1f} s")
    return nb


def outputs(nb) -> tuple[str, int]:
    """(all stream text, number of PNG images) of an executed notebook."""
    text, images = [], 0
    for cell in nb.cells:
        for out in cell.get("outputs", []):
            if out.get("output_type") == "stream":
                text.append(out["text"])
            images += "image/png" in out.get("data", {})
    return "".join(text), images


def test_tour_notebook(kernel_env):
    from gemini_jax import tiny

    nb = execute("01_tour.ipynb")
    text, images = outputs(nb)
    assert ("shipped tiny model" if tiny.available() else "RANDOMLY INITIALISED tiny model") in text
    assert "block table" in text and "prefill_tokens_reused=" in text
    assert "digests (4, 2," in text  # [layers, kv_heads, pages, 2, head_dim] of the tiny model
    assert text.count("attention mass kept by the selection") == 4  # one line per layer
    assert images >= 2  # digest ranges, selection heatmap


def test_ablations_notebook(kernel_env, monkeypatch, tmp_path_factory):
    sweep = shared_block_size_sweep(tmp_path_factory) / "sweep"
    monkeypatch.setenv("GJ_SWEEP", str(sweep))
    nb = execute("02_ablations.ipynb")
    text, images = outputs(nb)
    assert "over engine.cache.block_size = [16, 64]" in text
    assert str(sweep) in text
    assert images >= 2  # metrics, counters


def test_ablations_notebook_runs_a_sweep_when_none_is_on_disk(kernel_env, monkeypatch, tmp_path):
    monkeypatch.setenv("GJ_SWEEP", "run")  # what a fresh clone gets: nothing under experiments/results/ablations
    monkeypatch.setenv("GJ_SWEEP_OUT", str(tmp_path / "nb"))
    nb = execute("02_ablations.ipynb")
    text, images = outputs(nb)
    assert "ran a small sweep" in text and str(tmp_path / "nb" / "sweep") in text, text[-2000:]
    assert "over engine.cache.block_size = [16, 64]" in text
    assert images >= 2  # metrics, counters


def test_images_notebook(kernel_env):
    nb = execute("03_images.ipynb")
    text, images = outputs(nb)
    assert "encoders: ['cnn', 'mixer']" in text
    assert ": right" in text, text  # a held-out digit the shipped cnn answers (98% of them)
    assert "prefill_tokens_reused = 16" in text  # 19 prompt tokens: two full pages of 8, the last token computed
    assert "mixer answers" in text and images >= 1
