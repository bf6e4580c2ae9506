"""Study needle_diagnose (gemini_jax.eval.studies.needle_diagnose): the oracle's selection edit and a
small end-to-end run through `experiments/run.py experiment=needle_diagnose`."""

import json
import os
import subprocess
import sys

import numpy as np

from gemini_jax.eval.studies import needle_diagnose
from test_ablate import ROOT, sandbox_env


def test_force_pages_keeps_the_count_and_order():
    nd = needle_diagnose
    rng = np.random.default_rng(1)
    B, K, k, W = 2, 3, 9, 60
    sel = np.full((B, K, k), -1, np.int32)
    for b in range(B):
        for h in range(K):
            n = int(rng.integers(4, k + 1))
            sel[b, h, :n] = np.sort(np.concatenate([[0], rng.choice(np.arange(1, W), n - 1, replace=False)]))
    pages = {int(p) for p in rng.choice(np.arange(1, W), 2, replace=False)}
    positions = np.array([[W * 8 - 1]])
    out = nd.ForcePages(pages, when="all", layers=None, sink_pages=1, block_size=8)(2, True, positions, sel)
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
    assert np.array_equal(nd.ForcePages(pages, when="decode", layers=None, sink_pages=1, block_size=8)(
        2, False, positions, sel), sel)
    assert np.array_equal(nd.ForcePages(pages, when="all", layers=[0, 1], sink_pages=1, block_size=8)(
        2, True, positions, sel), sel)
    assert np.array_equal(nd.ForcePages({W + 5}, when="all", layers=None, sink_pages=1, block_size=8)(
        2, True, positions, sel), sel)


def test_oracle_run_selects_the_needle_everywhere(tmp_path):
    cmd = [sys.executable, os.path.join(ROOT, "experiments", "run.py"), "experiment=needle_diagnose",
           "experiment.lengths=[1024]", "experiment.depths=[0.3]", "experiment.trials=1", "experiment.budget=256",
           "experiment.oracle=all", "experiment.out_name=needle_diagnosis_t", f"results_dir={tmp_path}",
           f"hydra.run.dir={tmp_path / 'run'}", f"wandb.dir={tmp_path / 'wandb'}"]
    proc = subprocess.run(cmd, cwd=ROOT, env=sandbox_env(tmp_path), capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    out = tmp_path / "needle_diagnose"
    r = json.loads((out / "needle_diagnosis_t.json").read_text())
    hit = np.asarray(r["records"][0]["hit"])  # [answer steps, layers, kv heads]
    assert hit.shape[0] >= 2 and hit.all()
    assert "Oracle" in (out / "needle_diagnosis_t.md").read_text()
    # The one record format: what reproduces the run, and where its trials came from.
    assert r["command"].startswith("python experiments/run.py experiment=needle_diagnose")
    assert r["config"]["oracle"] == "all" and r["split"] == "dev" and r["seeds"] == [0]
    assert r["commit"] is None or len(r["commit"].split("+")[0]) == 40


def test_chat_needle_pages_cover_the_needle_line_of_a_chat_prompt():
    """For a pretrained chat model the diagnosed pages are those holding the needle's line: every
    token of the line decodes inside them, and the pages before and after hold none of the key."""
    import gemini_jax as gj
    from gemini_jax.data import chat
    from gemini_jax.eval.heldout import heldout_text

    tok = gj.GGUFTokenizer(gj.pretrained_path("smollm2-135m-instruct"))  # the tokenizer only
    for seed in (3, 11):
        rng = np.random.default_rng(seed)
        depth, bs = float(rng.uniform(0.1, 0.9)), int(rng.choice([8, 16]))
        ex = chat.chat_needle_example(heldout_text(), tok, 600, depth, rng)
        pages = needle_diagnose.chat_needle_pages(ex, tok, bs)
        lo, hi = min(pages) * bs, (max(pages) + 1) * bs
        assert sorted(pages) == list(range(min(pages), max(pages) + 1)), f"seed={seed}: not one run of pages"
        inside = tok.decode([int(x) for x in ex.prompt[lo:hi]])
        assert inside.count(ex.answer) == 2, f"seed={seed}: {inside!r} should hold the key twice"
        outside = tok.decode([int(x) for x in ex.prompt[:lo]]) + tok.decode([int(x) for x in ex.prompt[hi:]])
        assert ex.answer not in outside, f"seed={seed}: the key outside the needle pages"


def test_config_refuses_an_unknown_model_and_split_by_name():
    import pytest

    from gemini_jax.errors import ConfigError

    with pytest.raises(ConfigError, match="model"):
        needle_diagnose.Config(model="gpt-17")
    with pytest.raises(ConfigError, match="split"):
        needle_diagnose.Config(split="train")
    with pytest.raises(ConfigError, match="chat model"):
        needle_diagnose.Config(resume_instruction="Say it again.")
