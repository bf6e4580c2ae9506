"""experiments/bench.py: the row list, and the disk-layout row (tier_layout) at quick sizes."""

from __future__ import annotations

import json
import os
import subprocess
import sys

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
