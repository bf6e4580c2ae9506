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


def test_decode_profile_splits_the_attention_loop_by_op_name():
    """`decode_profile.loop_body_times` on trace events made here: ops nested in a loop's event are
    its body, and so are their runs on another thread (XLA's CPU ops run asynchronously); an op's
    self time excludes the ops nested in it; ops outside, `end:` markers and host events are left out."""
    from gemini_jax.bench.rows.decode_profile import loop_body_times

    rng = np.random.default_rng(5)
    a, b, c = (float(x) for x in rng.integers(5, 50, 3))
    ev = lambda name, ts, dur, tid=7: {"ph": "X", "pid": 1, "tid": tid, "name": name, "ts": ts, "dur": dur}  # noqa: E731
    events = [ev("while.12", 100.0, a + b + 3.0), ev("copy_bitcast_fusion.3", 101.0, a),
              ev("dot_general.4", 101.0 + a + 1.0, b), ev("dot.9", 101.0 + a + 1.0, 1.0),  # nested in dot_general.4
              ev("copy_bitcast_fusion.3", 300.0, c, tid=9), ev("end: while.12", 310.0 + c, 0.1, tid=9),
              ev("dot.231", 400.0, 50.0), ev("ThunkExecutor::Execute", 90.0, 500.0)]
    kinds = loop_body_times(events, {"while.12"})
    where = f"seed=5, durations {a, b, c}"
    assert kinds == pytest.approx({"copy_bitcast_fusion": a + c, "dot_general": b - 1.0, "dot": 1.0}), (kinds, where)


def test_same_outputs_compare_finds_a_changed_token_or_counter():
    """bench_ab.py --outputs: equal runs compare equal; a changed token, a changed counter and a
    counter only one side counts are each named; timing-dependent counters are not compared."""
    from gemini_jax.bench.same_outputs import compare

    rng = np.random.default_rng(5)
    toks = rng.integers(0, 256, size=(3, 8)).tolist()
    case = {"tokens": toks, "counters": {"decode_steps": 24, "kv_bytes_read": int(rng.integers(1, 10**9))},
            "timing_dependent": ["prefetch_hits"]}
    old = {"cases": {"paged": case, "fused": case}}
    rows, lines = compare(old, json.loads(json.dumps(old)))
    assert all(r["same"] for r in rows) and len(lines) == 4, (rows, lines)
    changed = json.loads(json.dumps(old))
    changed["cases"]["paged"]["tokens"][1][3] ^= 1
    changed["cases"]["fused"]["counters"].update(kv_bytes_read=case["counters"]["kv_bytes_read"] + 1, pages_selected=7)
    rows, lines = compare(old, changed)
    by = {r["case"]: r for r in rows}
    assert not by["paged"]["tokens_equal"] and not by["paged"]["same"], rows
    assert by["fused"]["tokens_equal"] and list(by["fused"]["counters_differing"]) == ["kv_bytes_read"], rows
    assert by["fused"]["only_new"] == ["pages_selected"] and by["fused"]["timing_dependent"] == ["prefetch_hits"], rows
    assert "✗ kv_bytes_read" in "\n".join(lines), lines


def test_host_work_ratios_pair_the_sides_and_cancel_what_all_resident_shares():
    """gemini_jax.bench.host_work: per pair new / old, and new / old of each side's step over its own
    all-resident step; a pair where the machine was 30% slower for the new side moves the first and
    not the second."""
    from gemini_jax.bench.host_work import VARIANTS, _markdown, pair_ratios

    rng = np.random.default_rng(5)
    sides = {"old": [], "new": []}
    slow = [1.0, 1.3, 0.8]  # the machine's speed while the new side ran, per pair
    extra = {n: 1.0 + 0.1 * (n == "tiered 10% depth 0") for n in VARIANTS}  # only one variant got slower
    for load in slow:
        base = {n: float(rng.uniform(2e-3, 8e-3)) for n in VARIANTS}
        for side, f in (("old", lambda n: 1.0), ("new", lambda n, load=load: load * extra[n])):
            sides[side].append({"step_seconds": {n: [base[n] * f(n)] * 3 for n in VARIANTS},
                                "calls_per_step": {n: 1000.0 for n in VARIANTS},
                                "tokens_equal_all_resident": {n: True for n in VARIANTS}})
    r = pair_ratios(sides)
    for name in VARIANTS:
        assert r[name]["step"]["per_pair"] == pytest.approx([x * extra[name] for x in slow]), f"seed 5: {name}"
        if name != "all-resident":
            assert r[name]["vs_all_resident"]["median"] == pytest.approx(extra[name]), f"seed 5: {name}"
    rec = {"sides": sides, "ratios": r, "head": "b" * 40, "base": "a" * 40, "command": "x", "seeds": [0, 1, 2],
           "config": {"pairs": 3, "repeats": 3}}
    row = next(line for line in _markdown(rec).splitlines() if line.startswith("| tiered 10% depth 0 |"))
    assert "| 1.100 [1.100, 1.100] |" in row, f"seed 5: {row}"
