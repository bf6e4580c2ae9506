"""The corpus manifest shipped with the model: content hashes, no machine paths, and another
Python's standard library detected and labelled rather than silently used."""

import copy
import json
import os

import pytest

from gemini_jax import tiny
from gemini_jax.data import corpus
from gemini_jax.eval import heldout
from gemini_jax.eval.record import provenance


def _shipped() -> dict:
    with open(os.path.join(tiny.ASSET_DIR, "corpus_manifest.json")) as fh:
        return json.load(fh)


def _strings(obj):
    if isinstance(obj, dict):
        for k, v in obj.items():
            yield k
            yield from _strings(v)
    elif isinstance(obj, list):
        for v in obj:
            yield from _strings(v)
    elif isinstance(obj, str):
        yield obj


def test_manifests_hold_no_machine_path():
    for m in (corpus.manifest(per_file=True), _shipped(), tiny.card()["corpus"]):
        assert not [s for s in _strings(m) if s.startswith(os.sep) or corpus.stdlib_root() in s]


def test_shipped_manifest_agrees_with_the_card_and_this_machine_is_checked():
    shipped, card = _shipped(), tiny.card()["corpus"]
    for split in ("train", "heldout"):
        assert shipped[split]["content_sha256"] == card[split]["content_sha256"]
        assert len(shipped[split]["file_sha256"]) == card[split]["files"]
    check = tiny.corpus_check()
    here = corpus.manifest()
    same = all(here[s]["content_sha256"] == card[s]["content_sha256"] for s in ("train", "heldout"))
    assert check.matches == same and check.python == here["python"]


def test_another_standard_library_is_reported_file_by_file():
    planted = copy.deepcopy(_shipped())
    files = planted["heldout"]["file_sha256"]
    changed, gone = sorted(files)[:2]
    files[changed] = "0" * 64  # a file whose content differs here
    files["gone/module.py"] = "1" * 64  # a file this machine lacks
    del files[gone]  # a file only this machine has
    planted["heldout"]["content_sha256"] = "f" * 64
    check = corpus.check(planted)
    assert not check.matches
    assert check.differences == ("heldout: 1 files changed, 1 missing, 1 new",)
    assert "NOT the expected corpus" in check.label and check.python in check.label


def test_a_mismatch_warns_and_records_say_which_corpus(monkeypatch):
    assert provenance(command="c", config={}, split="test", seeds=[0])["corpus"] == tiny.corpus_check().as_dict()
    assert "corpus" not in provenance(command="c", config={}, split=None, seeds=None)
    planted = copy.deepcopy(_shipped())
    planted["train"]["content_sha256"] = "f" * 64
    other = corpus.check(planted)
    monkeypatch.setattr(tiny, "corpus_check", lambda: other)
    with pytest.warns(heldout.CorpusMismatch, match="NOT the expected corpus"):
        text = heldout.heldout_text()
    assert len(text) > 0
    assert provenance(command="c", config={}, split="test", seeds=[0])["corpus"]["matches"] is False
