"""The main job (`make run` = experiments/run.py, experiment=fullstack) end to end at a small size."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gemini_jax.eval.needle import is_correct
from test_ablate import ROOT, sandbox_env


def _git_status() -> str:
    """Tracked files changed and untracked files not ignored, as `git status` shows them."""
    proc = subprocess.run(["git", "status", "--porcelain"], cwd=ROOT, capture_output=True, text=True)
    return proc.stdout if proc.returncode == 0 else "(not a git checkout)"


# The table's rows: each names the engine it measured (A generate, B session, C resumed).
FULLSTACK_ROWS = ("A: answer (generate)", "A: prefill s", "A: KV + digest bytes read / token", "A: device-tier share of KV",
                  "A: prefetch hit rate", "B: prefill s (session)", "B: interrupted after", "C: resume instruction",
                  "C: answer after resume", "C: resume s vs B's prefill s", "B+C: decode tokens/s")


def test_fullstack_job_prints_the_table(tmp_path):
    """The main job with its defaults (no results_dir): its record lands in its own output
    directory, and the checkout's `git status` is what it was before the job."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=fullstack", "experiment.length=2048",
           "hardware=a100_80g", f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    before = _git_status()
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert _git_status() == before, "the main job changed files that git tracks or sees"
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    for row in FULLSTACK_ROWS + ("PROJECTED attention step on a100_80g",):
        assert row in out, row
    # The job's story, not library logs: no absl / Orbax INFO lines, no wandb banner.
    noise = [line for line in out.splitlines() + proc.stderr.splitlines()
             if "[absl][INFO]" in line or line.startswith("wandb:")]
    assert not noise, noise[:5]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["length"] == 2048 and res["stats"]["decode_steps"] > 0
    # `correct` is the exact-match verdict on the answer printed (not a constant).
    assert res["correct"] == is_correct(res["answer"], res["key"]) and f"engine A answered {res['answer']!r}" in out
    assert res["after_resume_correct"] == is_correct(res["after_resume"], res["key"])
    rec = json.loads((tmp_path / "run" / "fullstack" / "make_run.json").read_text())
    assert rec["records"][0]["answer"] == res["answer"] and rec["seeds"] == [0] and rec["split"] == "dev"
    assert rec["command"].startswith("python experiments/run.py") and rec["commit"]
    assert res["tier"]["device_slots_per_layer"] < 2048 // 16  # pages really live below the device
    assert res["projection"]["label"] == "projection"
    # a100_80g is not this machine: the tiers copy its split of the reference workload's KV.
    assert "EMULATED hardware a100_80g" in out and res["emulated"]["hardware"] == "a100_80g"
    assert res["emulated"]["tier_device_fraction"] == pytest.approx(0.225, abs=0.01)
    assert os.listdir(tmp_path / "wandb")


def test_the_main_job_asks_smollm2_through_its_chat_template(tmp_path):
    """`make run`'s default: SmolLM2 (pretrained GGUF) at a short length, chat prompt and chat
    instruction; the verdicts follow from the texts printed, and the text, not token ids, is shown."""
    from gemini_jax.data.chat import chat_answer_correct

    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment.length=320",
           "experiment.answer_tokens=4", "experiment.interrupt_after=2", "engine.prefill_chunk=64", "engine.sparse.budget=64",
           "engine.tier.device_fraction=0.5",
           f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=900)
    out = proc.stdout
    assert proc.returncode == 0, out[-3000:] + proc.stderr[-3000:]
    assert "model: smollm2-135m-instruct" in out
    for row in FULLSTACK_ROWS:
        assert row in out, row
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["correct"] == chat_answer_correct(res["answer"], res["key"])
    assert res["after_resume_correct"] == chat_answer_correct(res["after_resume"], res["key"])
    assert f"C: resume instruction{' ' * 15}{res['instruction']!r}" in out
    assert 300 <= res["length"] <= 320 and res["stats"]["decode_steps"] > 0
    assert res["tier"]["device_slots_per_layer"] < 300 // 16  # pages really live below the device


def test_distributed_entry_with_mesh_over_tiers(tmp_path):
    """`distributed=true` on one process (no coordinator in the environment) runs single-process;
    the job then decodes on a 2-device mesh over a disk tier with one zarr array per shard."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=generate", "distributed=true",
           "tier=disk", f"engine.tier.disk_path={tmp_path / 'kv'}", "engine.mesh={data: 1, model: 2}",
           f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    env = {**sandbox_env(tmp_path), "XLA_FLAGS": os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=2"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "jax.distributed: single process (no coordinator in env); 1 process(es), 2 device(s)" in proc.stdout
    assert sorted(os.listdir(tmp_path / "kv")) == ["shard0of2", "shard1of2"]
    res = json.loads((tmp_path / "run" / "result.json").read_text())
    assert res["stats"]["decode_steps"] > 0


def test_ruler_job_writes_a_record_whose_verdicts_follow_from_its_answers(tmp_path):
    """experiment=ruler on the shipped model, two tasks at 512 tokens: the record carries its
    provenance, one row per task x length, and every trial's verdict is the scoring of its text."""
    import numpy as np

    from gemini_jax.data import ruler

    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=ruler",
           "experiment.tasks=[niah_single,fwe]", "experiment.lengths=[512]", "experiment.trials=2",
           "experiment.batch=2", "experiment.split=test", "seed=5", f"hydra.run.dir={tmp_path / 'run'}",
           f"wandb.dir={tmp_path / 'wandb'}", f"results_dir={tmp_path / 'results'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "results" / "ruler" / "ruler.json").read_text())
    assert rec["split"] == "test" and rec["seeds"] == [5] and rec["command"].startswith("python experiments/run.py")
    assert [(r["task"], r["length"], r["trials"]) for r in rec["by_task_length"]] == [("niah_single", 512, 2),
                                                                                      ("fwe", 512, 2)]
    for r in rec["records"]:
        ex = ruler.RulerExample(r["task"], np.zeros(1, np.int32), tuple(r["answers"]), r["task"] != "fwe")
        assert (r["exact"], r["recall"]) == ruler.score(r["generated"], ex), r
    assert "| niah_single | 512 |" in proc.stdout
    # Dense: every step reads the whole ~512-token sequence's K and V, and no digests.
    from gemini_jax.tiny import load_tiny
    cfg = load_tiny().cfg
    whole = 2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 4 * 512
    for task in ("niah_single", "fwe"):
        b = rec["bytes_per_token"][task]
        assert 0.9 * whole <= b["kv_bytes_read"] <= 1.2 * whole and b["digest_bytes_read"] == 0, (task, b, whole)


def test_a_config_error_on_the_command_line_is_one_line_without_a_traceback(tmp_path):
    """A typed error prints `ConfigError: <message>` and exits 2; HYDRA_FULL_ERROR=1 gives the trace."""
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "engine.cache.block_size=0",
           f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    env = {k: v for k, v in sandbox_env(tmp_path).items() if k != "HYDRA_FULL_ERROR"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2, proc.stdout[-2000:] + proc.stderr[-2000:]
    assert "ConfigError: cache.block_size=0 must be a power of two" in proc.stderr
    assert "Traceback" not in proc.stderr + proc.stdout
    full = subprocess.run(cmd, cwd=ROOT, env={**env, "HYDRA_FULL_ERROR": "1"},
                          capture_output=True, text=True, timeout=300)
    assert full.returncode != 0 and "Traceback" in full.stderr
