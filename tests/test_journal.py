"""gemini_jax.eval.journal: a grid's finished cells survive an interruption, and a journal of another
grid, or a damaged one, is refused by name."""

from __future__ import annotations

import json

import numpy as np
import pytest

from gemini_jax.errors import ConfigError
from gemini_jax.eval.journal import CellJournal

SEED = 11


def _payloads(n):
    rng = np.random.default_rng(SEED)
    return [{"hits": int(h), "kv": float(b)} for h, b in zip(rng.integers(0, 10, n), rng.uniform(1, 1e6, n))]


def test_cells_read_back_after_reopening(tmp_path):
    path = str(tmp_path / "ruler" / "g.partial.jsonl")
    fp = {"trials": 5, "tasks": ["niah_single", "vt"], "top_p": None}
    cells = _payloads(4)
    j = CellJournal(path, fp)
    assert j.resumed == 0
    for i, p in enumerate(cells):
        j.add(("m", "dense", "sparse=off", "vt", 1024 * (i + 1)), p)
    again = CellJournal(path, fp)
    assert again.resumed == 4, f"seed {SEED}"
    for i, p in enumerate(cells):
        assert again.get(("m", "dense", "sparse=off", "vt", 1024 * (i + 1))) == p, f"seed {SEED} cell {i}"
    assert again.get(("m", "fixed", "sparse=quest", "vt", 1024)) is None
    assert sum(again.commits().values()) == 4
    again.close()
    assert not (tmp_path / "ruler" / "g.partial.jsonl").exists()


def test_a_journal_of_other_settings_is_refused_by_name(tmp_path):
    path = str(tmp_path / "g.partial.jsonl")
    CellJournal(path, {"trials": 5, "seed": 0}).add(("a",), {"x": 1})
    with pytest.raises(ConfigError, match=r"\(trials differ\).*resume=false"):
        CellJournal(path, {"trials": 6, "seed": 0})
    fresh = CellJournal(path, {"trials": 6, "seed": 0}, resume=False)  # starts afresh
    assert fresh.resumed == 0 and fresh.get(("a",)) is None


def test_a_cell_cut_short_by_a_kill_is_measured_again_and_a_damaged_one_is_named(tmp_path):
    path = tmp_path / "g.partial.jsonl"
    j = CellJournal(str(path), {"seed": 1})
    j.add(("a",), {"x": 1})
    j.add(("b",), {"x": 2})
    whole = path.read_text()
    path.write_text(whole[:-7])  # the last line written up to a kill
    again = CellJournal(str(path), {"seed": 1})
    assert again.resumed == 1 and again.get(("a",)) == {"x": 1} and again.get(("b",)) is None
    assert path.read_text().count("\n") == 2  # header and cell a: the cut line is gone
    lines = whole.split("\n")
    path.write_text("\n".join([lines[0], "{not json", lines[2]]) + "\n")
    with pytest.raises(ConfigError, match="line 2 is damaged"):
        CellJournal(str(path), {"seed": 1})
    path.write_text(json.dumps({"x": 1}) + "\n")
    with pytest.raises(ConfigError, match="not a grid journal"):
        CellJournal(str(path), {"seed": 1})
