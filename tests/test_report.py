"""`experiments/results.py --report`: an ablation sweep's table and plots, and what it refuses."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from test_ablate import ROOT


def test_report_wants_a_sweep():
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "results.py"), "--report"], cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 2 and "--report" in proc.stderr, proc.stderr
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "results.py"), "--report", "no_such_sweep"],
                          cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 1 and "no_such_sweep" in proc.stderr and "Traceback" not in proc.stderr, proc.stderr


def test_a_damaged_sweep_record_stops_the_report(tmp_path):
    sweep = tmp_path / "sweep"
    sweep.mkdir()
    (sweep / "block_size=16.json").write_text(json.dumps({"sweep": {"knob": "block_size", "value": 16}, "metrics": {}}))
    (sweep / "block_size=32.json").write_text('{"sweep": {"knob": "block_size", "value": 32}, "metr')  # cut short
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "experiments", "results.py"), "--report", str(sweep)],
                          cwd=ROOT,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0 and "block_size=32.json is not valid JSON" in proc.stderr, proc.stderr[-2000:]
