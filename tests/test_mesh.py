"""Sharding over a device mesh (8 fake CPU devices in a subprocess): exactness, memory share,
no KV all-gather, snapshots across mesh shapes, bad meshes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest


@pytest.fixture(scope="module")
def report():
    seed = int(np.random.default_rng().integers(1 << 20))
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_check.py")
    out = subprocess.run([sys.executable, script, str(seed)], capture_output=True, text=True, timeout=900)
    line = [l for l in out.stdout.splitlines() if l.startswith("REPORT ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[0][len("REPORT "):])


def test_meshes_match_single_device(report):
    for key, err in report["max_err"].items():
        assert err <= 1e-5, f"{key}: max |logit diff| {err} (seed {report['seed']})"
    assert all(report["tokens_equal"].values()), report["tokens_equal"]


def test_pool_is_sharded_by_kv_head(report):
    assert report["pool_share"] == pytest.approx(1 / 8)
    assert "model" in report["pool_spec"]


def test_no_kv_all_gather_in_decode_step(report):
    pool = report["pool_elems_per_device"]
    for dtype, shape in report["all_gathers"]:
        size = int(np.prod([int(d) for d in shape.split(",") if d])) if shape else 1
        assert size < pool / 4, f"all-gather of {dtype}[{shape}] is pool-sized"


def test_snapshot_restores_across_mesh_shapes(report):
    assert report["resume_equal"], report["resumed"]


def test_bad_meshes(report):
    assert "needs 16 devices" in report["errors"]["too_big"]
    assert "mesh.model=2 does not divide num_kv_heads=3" in report["errors"]["kv_heads"]
