"""Sharding over a device mesh (8 fake CPU devices in a subprocess): exactness (all-resident and
over tiers), memory share, no KV all-gather, snapshots across mesh shapes, bad meshes."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from gemini_jax.testing import float_tolerance


# `make test` runs the meshes and resumes that each cover a case; `make test-slow` adds the (8x1)
# mesh and the resumes that repeat a covered pair (mesh_check.py's docstring).
@pytest.fixture(scope="module", params=["ci", pytest.param("full", marks=pytest.mark.slow)])
def report(request):
    seed = 2024  # fixed: a failure replays; reported in the messages
    script = os.path.join(os.path.dirname(os.path.abspath(__file__)), "mesh_check.py")
    out = subprocess.run([sys.executable, script, str(seed), request.param], capture_output=True, text=True,
                         timeout=900)
    line = [l for l in out.stdout.splitlines() if l.startswith("REPORT ")]
    assert line, out.stdout[-2000:] + out.stderr[-4000:]
    return json.loads(line[0][len("REPORT "):])


def test_meshes_match_single_device(report):
    # A mesh (and a mesh over tiers) sums the heads' outputs across devices in another order than one
    # device does: the decoder's float bound, its layers each with their longest reduction.
    shape = report["shape"]
    tol = float_tolerance(depth=shape["num_layers"], magnitude=report["max_abs_ref"],
                          terms=max(shape["hidden_size"], shape["intermediate_size"], shape["context"]))
    for key, err in report["max_err"].items():
        assert err <= tol, f"{key}: max |logit diff| {err:.3g} > {tol:.3g} (seed {report['seed']})"
    assert all(report["tokens_equal"].values()), report["tokens_equal"]


def test_pool_is_sharded_by_kv_head(report):
    assert report["pool_share"] == pytest.approx(1 / 8)
    assert "model" in report["pool_spec"]


def _elems(shape: str) -> int:
    return int(np.prod([int(d) for d in shape.split(",") if d])) if shape else 1


def test_all_gather_scan_finds_a_planted_all_gather(report):
    """The scan below finds nothing in a good decode step; this shows it would find one: it
    reports the pool-sized all-gather of a function that replicates the sharded pool."""
    pool = report["pool_elems_per_device"]
    assert any(_elems(shape) >= pool / 4 for _, shape in report["control_all_gathers"]), \
        report["control_all_gathers"]


def test_no_kv_all_gather_in_decode_step(report):
    pool = report["pool_elems_per_device"]
    assert report["decode_hlo_instructions"] > 100, "the decode step's HLO was not scanned"
    for dtype, shape in report["all_gathers"]:
        assert _elems(shape) < pool / 4, f"all-gather of {dtype}[{shape}] is pool-sized"


def test_tiers_are_sharded_by_kv_head(report):
    """Over tiers each device holds 1/model of the slots, each shard of heads has its own zarr
    array on disk, and dense runs really fetch pages back from disk (through every shard)."""
    for key, t in report["tiered"].items():
        m = 8 if "1x8" in key else 4
        assert t["slot_share"] == pytest.approx(1 / m), key
        assert "model" in t["slot_spec"], key
        assert t["shards"] == m and t["shard_dirs"] == [f"shard{i}of{m}" for i in range(m)], key
        if "dense" in key:
            assert t["pages_fetched_disk"] > 0, key


def test_no_kv_all_gather_in_tiered_decode_step(report):
    scanned = {key: t["scanned_instructions"] for key, t in report["tiered"].items() if "all_gathers" in t}
    # Both jitted per-layer pieces of a decode step were recorded and their HLO scanned, on each 1x8 run.
    assert set(scanned) == {"tiered 1x8/dense", "tiered 1x8/sparse"}, scanned
    for key, per_fn in scanned.items():
        assert set(per_fn) == {"_front", "_back"} and min(per_fn.values()) > 10, (key, per_fn)
    for key, t in report["tiered"].items():
        for name, dtype, shape in t.get("all_gathers", []):
            assert _elems(shape) < t["slot_elems_per_device"] / 4, f"{key}: {name} all-gathers {dtype}[{shape}]"


def test_snapshot_restores_across_mesh_shapes(report):
    assert {"1x8->2x4", "1x8->2x4 tiered", "1x8 tiered->single"} <= set(report["resumed"])
    assert report["resume_equal"], report["resumed"]


def test_bad_meshes(report):
    assert "needs 16 devices" in report["errors"]["too_big"]
    assert "mesh.model=2 does not divide num_kv_heads=3" in report["errors"]["kv_heads"]
