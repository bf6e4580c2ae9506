"""experiments/bench.py: the row list, and the disk-layout row (tier_layout) at quick sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from test_ablate import ROOT, sandbox_env

BENCH = os.path.join(ROOT, "experiments", "bench.py")


def test_list_rows_names_every_row_from_any_directory(tmp_path):
    # the rows come from the installed package (gemini_jax.bench), whatever the cwd.
    proc = subprocess.run([sys.executable, BENCH, "--list-rows"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = proc.stdout.split()
    assert "tier_layout" in rows and "tiers" in rows and len(rows) == len(set(rows))


def test_tier_layout_row_quick(tmp_path):
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--rows", "tier_layout", "--bw-mib", "16",
                           "--out", str(tmp_path / "bench")], cwd=ROOT, env=sandbox_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    rec = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]["tier_layout"]
    by_metric = {r["metric"]: r for r in rec["records"]}
    assert set(by_metric) == {"write_s", "append_s", "read_serial_cold_s", "read_parallel_cold_s",
                              "read_serial_warm_s", "read_parallel_warm_s", "summary"}
    for key, r in by_metric.items():
        if key != "summary":
            assert r["chunked_pages_s"] > 0 and r["sharded_pages_s"] > 0
            assert r["ratio_min"] <= r["ratio_median"] <= r["ratio_max"]
    summary = by_metric["summary"]
    assert summary["default"] in ("chunked", "sharded") and summary["repeats"] == 2
    # The chunked layout keeps one file per layer-page, the sharded one a file per shard_pages pages.
    assert summary["runs"]["chunked"][0]["files"] > summary["runs"]["sharded"][0]["files"]
    md = (tmp_path / "bench" / "BENCH.md").read_text()
    assert "## tier_layout" in md and "**Default: `" in md


@pytest.mark.slow
def test_smollm2_decode_row_quick(tmp_path):
    """The pretrained model against transformers on the same GGUF: both sides timed, bytes counted."""
    proc = subprocess.run([sys.executable, BENCH, "--quick", "--rows", "smollm2_decode", "--bw-mib", "16",
                           "--out", str(tmp_path / "bench")], cwd=ROOT, env=sandbox_env(tmp_path),
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    recs = json.loads((tmp_path / "bench" / "bench.json").read_text())["rows"]["smollm2_decode"]["records"]
    assert {r["variant"] for r in recs} == {"ours k=1", "ours k=4", "transformers"}
    for r in recs:  # 30 layers x 2 x 3 kv heads x 64 x 4 B per token of context, weights ~0.5 GB
        assert r["kv_bytes_per_step"] >= 128 * 30 * 2 * 3 * 64 * 4 and r["weight_bytes_per_step"] > 4e8, r
        assert 0 < r["fraction_of_bound"] and r["vs_hf_ratio_min"] <= r["vs_hf_ratio"] <= r["vs_hf_ratio_max"]


def test_decode_profile_reads_op_self_times_and_loops(tmp_path):
    """`decode_profile.trace_ops` on a perfetto trace written here: an op's self time excludes the
    ops nested in it, ops inside a `while` are marked as in the loop, and host events are dropped."""
    import gzip

    from gemini_jax.bench.rows.decode_profile import trace_ops

    rng = np.random.default_rng(5)
    a, b, c = (float(x) for x in rng.integers(5, 50, 3))  # two ops inside a loop, one after it
    events = [{"ph": "X", "pid": 1, "tid": 7, "name": "while.12", "ts": 100.0, "dur": a + b + 3.0},
              {"ph": "X", "pid": 1, "tid": 7, "name": "copy_bitcast_fusion.3", "ts": 101.0, "dur": a},
              {"ph": "X", "pid": 1, "tid": 7, "name": "dot_general.4", "ts": 101.0 + a + 1.0, "dur": b},
              {"ph": "X", "pid": 1, "tid": 7, "name": "dot.231", "ts": 200.0 + a + b, "dur": c},
              {"ph": "X", "pid": 1, "tid": 7, "name": "ThunkExecutor::Execute", "ts": 90.0, "dur": 500.0},
              {"ph": "X", "pid": 1, "tid": 7, "name": "$decode.py:102 step", "ts": 80.0, "dur": 600.0}]
    (tmp_path / "plugins").mkdir()
    with gzip.open(tmp_path / "plugins" / "x.trace.json.gz", "wt") as fh:
        json.dump({"traceEvents": events}, fh)
    ops = {o["name"]: o for o in trace_ops(str(tmp_path))}
    where = f"seed=5, durations {a, b, c}"
    assert set(ops) == {"while.12", "copy_bitcast_fusion.3", "dot_general.4", "dot.231"}, where
    assert ops["while.12"]["self"] == pytest.approx(3.0) and not ops["while.12"]["in_loop"], where
    assert ops["copy_bitcast_fusion.3"]["in_loop"] and ops["dot_general.4"]["in_loop"], where
    assert ops["copy_bitcast_fusion.3"]["kind"] == "copy_bitcast_fusion", where
    assert not ops["dot.231"]["in_loop"] and ops["dot.231"]["self"] == c, where
