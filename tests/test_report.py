"""experiments/report.py --sparse-vs-dense (gemini_jax.eval.compare): the tables from the committed
needle and bits-per-byte results, read from their per-study folders."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys

from test_ablate import ROOT

RESULTS = os.path.join(ROOT, "experiments", "results", "legacy")  # measured before records carried commits


def _tables(md: str) -> list[str]:
    """The report's table rows (what the figures are), without the prose that names the command."""
    return [line for line in md.splitlines() if line.startswith("|")]


def test_sparse_vs_dense_rebuilds_the_committed_tables(tmp_path):
    for study in ("needle", "perplexity"):
        shutil.copytree(os.path.join(RESULTS, study), tmp_path / study)
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "report.py"), "--sparse-vs-dense",
                           "--results-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    got = (tmp_path / "reports" / "sparse_vs_dense.md").read_text()
    with open(os.path.join(RESULTS, "reports", "sparse_vs_dense.md")) as fh:
        want = fh.read()
    assert len(_tables(want)) > 10 and _tables(got) == _tables(want)
    assert "`needle/needle_paired_4k_dense`" in got


def test_sparse_vs_dense_refuses_unpaired_trials(tmp_path):
    shutil.copytree(os.path.join(RESULTS, "needle"), tmp_path / "needle")
    path = tmp_path / "needle" / "needle_paired_4k_sparse_1k.json"
    data = json.loads(path.read_text())
    data["records"][0]["key"] = "00000" if data["records"][0]["key"] != "00000" else "11111"
    path.write_text(json.dumps(data))
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "report.py"), "--sparse-vs-dense",
                           "--results-dir", str(tmp_path)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "is not paired with" in proc.stderr


def test_report_wants_a_sweep_or_the_comparison():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "report.py")], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--sparse-vs-dense" in proc.stderr


def test_a_damaged_sweep_record_stops_the_report(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "block_size=16.json").write_text(json.dumps({"sweep": {"knob": "block_size", "value": 16}, "metrics": {}}))
    (sweep / "block_size=32.json").write_text('{"sweep": {"knob": "block_size", "value": 32}, "metr')  # cut short
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "report.py"), str(sweep)], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "block_size=32.json is not valid JSON" in proc.stderr, proc.stderr[-2000:]
