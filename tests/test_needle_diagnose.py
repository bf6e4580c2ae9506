"""experiments/needle_diagnose.py: the oracle's selection edit and a small end-to-end run."""

import importlib.util
import json
import os

import numpy as np

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _tool():
    spec = importlib.util.spec_from_file_location("needle_diagnose", os.path.join(ROOT, "experiments", "needle_diagnose.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def test_force_pages_keeps_the_count_and_order():
    nd = _tool()
    rng = np.random.default_rng()
    B, K, k, W = 2, 3, 9, 60
    sel = np.full((B, K, k), -1, np.int32)
    for b in range(B):
        for h in range(K):
            n = int(rng.integers(4, k + 1))
            sel[b, h, :n] = np.sort(np.concatenate([[0], rng.choice(np.arange(1, W), n - 1, replace=False)]))
    pages = {int(p) for p in rng.choice(np.arange(1, W), 2, replace=False)}
    positions = np.array([[W * 8 - 1]])
    out = nd.force_pages(pages, 2, True, positions, sel, when="all", layers=None, sink_pages=1, block_size=8)
    for b in range(B):
        for h in range(K):
            row, before = out[b, h], sel[b, h]
            got = row[row >= 0]
            assert pages <= set(got.tolist())
            # Padding is used first, then retrieved pages give way: never more than k pages.
            assert len(got) == min(k, len(set(before[before >= 0].tolist()) | pages))
            assert np.all(np.diff(got) > 0) and np.all(row[len(got):] == -1)
            assert got[0] == 0  # the sink stays
    # Not its call, not its layer, or pages not written yet: unchanged.
    assert np.array_equal(nd.force_pages(pages, 2, False, positions, sel, when="decode", layers=None,
                                         sink_pages=1, block_size=8), sel)
    assert np.array_equal(nd.force_pages(pages, 2, True, positions, sel, when="all", layers=[0, 1],
                                         sink_pages=1, block_size=8), sel)
    assert np.array_equal(nd.force_pages({W + 5}, 2, True, positions, sel, when="all", layers=None,
                                         sink_pages=1, block_size=8), sel)


def test_oracle_run_selects_the_needle_everywhere(tmp_path):
    nd = _tool()
    assert nd.main(["--lengths", "1024", "--depths", "0.3", "--trials", "1", "--budget", "256", "--oracle", "all",
                    "--out", str(tmp_path), "--name", "t"]) == 0
    r = json.loads((tmp_path / "needle_diagnosis_t.json").read_text())
    hit = np.asarray(r["trials"][0]["hit"])  # [answer steps, layers, kv heads]
    assert hit.shape[0] >= 2 and hit.all()
    assert "Oracle" in (tmp_path / "needle_diagnosis_t.md").read_text()
