"""experiments/ablate.py + `experiments/results.py --report`: a real (tiny) Hydra multirun, then its report.

The sweeps run as subprocesses exactly as a user launches them, with overrides that shrink the
workload to a few seconds per job; wandb runs offline into the test's temporary directory.
"""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import gemini_jax as gj
from gemini_jax import tiny

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABLATE = os.path.join(ROOT, "experiments", "ablate.py")
RESULTS_PY = os.path.join(ROOT, "experiments", "results.py")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"
sys.path.insert(0, os.path.dirname(RESULTS_PY))
import results  # noqa: E402  (experiments/results.py)

TINY_WORKLOAD = list(results.SMALL_WORKLOAD)  # every phase of a job shrunk to a few seconds


def sandbox_env(tmp) -> dict:
    """Environment for a job: CPU, wandb offline with every wandb directory under `tmp`."""
    env = dict(os.environ)
    env.update(JAX_PLATFORMS="cpu", WANDB_MODE="offline", WANDB_SILENT="true", HYDRA_FULL_ERROR="1",
               WANDB_DIR=str(tmp / "wandb"), WANDB_CACHE_DIR=str(tmp / "wandb_cache"),
               WANDB_CONFIG_DIR=str(tmp / "wandb_config"), WANDB_DATA_DIR=str(tmp / "wandb_data"))
    return env


def run_sweep(tmp, experiment: str, sweep: str, *extra: str) -> subprocess.CompletedProcess:
    """`ablate.py --multirun experiment=<experiment> <sweep>` at tiny size; sweep dir tmp/sweep,
    results under tmp/results, wandb under tmp/wandb."""
    cmd = [sys.executable, ABLATE, "--multirun", f"experiment={experiment}", sweep, *TINY_WORKLOAD, *extra,
           f"hydra.sweep.dir={tmp / 'sweep'}", f"results_dir={tmp / 'results'}", f"wandb.dir={tmp / 'wandb'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n--- stdout\n{proc.stdout[-4000:]}\n--- stderr\n{proc.stderr[-4000:]}"
    return proc


def shared_block_size_sweep(tmp_path_factory):
    """A two-point block-size sweep, run once per test session (test_notebooks plots it too)."""
    tmp = tmp_path_factory.getbasetemp() / "ablate_block_size_16_64"
    if not (tmp / "done").exists():
        tmp.mkdir(exist_ok=True)
        run_sweep(tmp, "ablate_block_size", "engine.cache.block_size=16,64")
        (tmp / "done").write_text("ok")
    return tmp


def load_jobs(directory) -> dict:
    out = {}
    for path in glob.glob(os.path.join(directory, "*.json")):
        with open(path) as fh:
            rec = json.load(fh)
        out[rec["sweep"]["value"]] = rec
    return out


def run_report(*args) -> str:
    proc = subprocess.run([sys.executable, RESULTS_PY, "--report", *map(str, args)], cwd=ROOT, capture_output=True, text=True,
                          timeout=300, env={**os.environ, "MPLBACKEND": "Agg"})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def test_sweeps_are_declared_in_the_experiment_configs():
    """`--multirun experiment=ablate_*` alone sweeps the knob: hydra.sweeper.params comes with the config."""
    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    from gemini_jax.hydra_schema import build, register

    register()
    with initialize_config_dir(config_dir=os.path.join(ROOT, "conf"), version_base=None):
        bs = compose("config", overrides=["experiment=ablate_block_size"], return_hydra_config=True)
        pf = compose("config", overrides=["experiment=ablate_prefetch_depth"], return_hydra_config=True)
    assert OmegaConf.to_container(bs.hydra.sweeper.params) == {"engine.cache.block_size": "8,16,32,64,128,256"}
    assert OmegaConf.to_container(pf.hydra.sweeper.params) == {"experiment.prefetch_depth": "range(0,9)"}
    assert bs.experiment.knob == "engine.cache.block_size" and pf.experiment.knob == "experiment.prefetch_depth"
    assert pf.experiment.prefetch_depth == 0 and bs.experiment.prefetch_depth is None
    engine = OmegaConf.to_container(bs.engine, resolve=True)
    for value in bs.hydra.sweeper.params["engine.cache.block_size"].split(","):  # every job's engine is valid
        ecfg = build(gj.EngineConfig, {**engine, "cache": {**engine["cache"], "block_size": int(value)}})
        assert ecfg.cache.block_size == int(value)


def test_block_size_multirun_and_report(tmp_path_factory):
    tmp = shared_block_size_sweep(tmp_path_factory)
    sweep_jobs = load_jobs(tmp / "sweep")
    assert sorted(sweep_jobs) == [16, 64], "the command-line sweep replaces the config's six values"
    copies = glob.glob(str(tmp / "results" / "ablations" / "ablate_block_size" / "*"))
    assert len(copies) == 1 and os.path.basename(copies[0]) == "sweep"  # keyed by the sweep dir's name
    assert sorted(load_jobs(copies[0])) == [16, 64]

    for bs, rec in sweep_jobs.items():
        assert rec["engine_effective"]["block_size"] == bs
        assert rec["sweep"]["knob"] == "engine.cache.block_size" and rec["sweep"]["key"] == f"block_size={bs}"
        assert set(rec["stats"]["decode"]) == set(gj.COUNTERS)
        assert rec["stats"]["decode"]["decode_steps"] == 2 * 7  # 2 repeats x (8 tokens - 1)
        assert rec["metrics"]["kv_bytes_read_per_token"] >= rec["metrics"]["kv_bytes_valid_per_token"] > 0
        assert rec["metrics"]["decode_tokens_per_s"] > 0
        assert 0.0 <= rec["metrics"]["needle_accuracy"] <= 1.0 and rec["metrics"]["bits_per_byte"] > 0
        assert rec["model"]["trained"] == tiny.available()
        if not tiny.available():
            assert "RANDOM" in rec["model"]["description"]
        assert rec["prefetch"] == {"depth": None, "applied": False, "note": ""}
        assert rec["wandb"]["mode"] == "offline"
    # One offline wandb run per job, under the test's directory.
    assert len(glob.glob(str(tmp / "wandb" / "wandb" / "offline-run-*"))) == 2
    # Pages of 64 tokens pad more of a 64..72-token context than pages of 16.
    assert (sweep_jobs[64]["metrics"]["kv_bytes_read_per_token"]
            >= sweep_jobs[16]["metrics"]["kv_bytes_read_per_token"])

    out = run_report(tmp / "sweep")
    md = (tmp / "sweep" / "REPORT.md").read_text()
    assert "report: wrote" in out and str(tmp / "sweep" / "REPORT.md") in out
    rows = [line for line in md.splitlines() if line.startswith("| 16 |") or line.startswith("| 64 |")]
    assert len(rows) == 2, md
    assert md.index("| 16 |") < md.index("| 64 |")
    for png in ("summary", "decode_tokens_per_s", "kv_bytes_read_per_token", "needle_accuracy", "bits_per_byte"):
        data = (tmp / "sweep" / f"{png}.png").read_bytes()
        assert data.startswith(PNG_MAGIC) and len(data) > 5000, png
        assert f"({png}.png)" in md

    # By name: the latest sweep of that name under --results-dir.
    run_report("ablate_block_size", "--results-dir", tmp / "results")
    assert os.path.exists(os.path.join(copies[0], "REPORT.md"))


def test_prefetch_depth_sweep_runs_over_tiers(tmp_path):
    # 10 device slots per layer for a 16-page decode context (and 2 needle sequences of 8): pages leave the device.
    run_sweep(tmp_path, "ablate_prefetch_depth", "experiment.prefetch_depth=0,2", "engine.tier.device_pages=10",
              "engine.prefill_chunk=32", "engine.sparse.budget=48", "experiment.workload.prompt_tokens=256")
    jobs = load_jobs(tmp_path / "sweep")
    assert sorted(jobs) == [0, 2]
    for depth, rec in jobs.items():
        assert rec["prefetch"]["depth"] == depth and rec["prefetch"]["applied"] is True
        assert rec["engine_effective"]["prefetch_depth"] == depth and rec["engine_effective"]["tier"]
    total = {d: rec["stats"]["total"] for d, rec in jobs.items()}
    assert total[0]["pages_fetched_host"] > 0 and total[0]["prefetch_hits"] == 0
    assert total[2]["prefetch_hits"] > 0
    run_report(tmp_path / "sweep")
    md = (tmp_path / "sweep" / "REPORT.md").read_text()
    assert "prefetch hit rate" in md and "NOT applied" not in md


def test_prefetch_depth_without_tiers_is_marked_not_applied(tmp_path):
    proc = run_sweep(tmp_path, "ablate_prefetch_depth", "experiment.prefetch_depth=2", "engine.tier.enabled=false")
    jobs = load_jobs(tmp_path / "sweep")
    assert sorted(jobs) == [2]
    for depth, rec in jobs.items():
        assert rec["prefetch"]["applied"] is False and "NOT APPLIED" in rec["prefetch"]["note"]
    assert "NOT APPLIED" in proc.stdout + proc.stderr


def test_ablate_refuses_a_non_ablation_experiment(tmp_path):
    cmd = [sys.executable, ABLATE, "experiment=generate", f"hydra.run.dir={tmp_path / 'run'}",
           f"wandb.dir={tmp_path / 'wandb'}", f"results_dir={tmp_path / 'results'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert "is not an ablation" in proc.stderr and "experiment=ablate_block_size" in proc.stderr
