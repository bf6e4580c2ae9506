"""Corpus split and task generators on the real standard-library text."""

import numpy as np
import pytest

from gemini_jax.data import corpus, tasks


def test_split_is_deterministic_and_disjoint():
    files = corpus.list_files()
    assert len(files) > 500
    train, _ = corpus.load_split("train")
    held, _ = corpus.load_split("heldout")
    assert set(train.files).isdisjoint(held.files)
    assert set(train.files) | set(held.files) == set(files)
    assert 0.05 < len(held.files) / len(files) < 0.15
    # The split depends only on the path: recomputing it file by file agrees.
    assert all(corpus.split_of(f) == "heldout" for f in held.files)
    m1, m2 = corpus.manifest(), corpus.manifest()
    assert m1 == m2 and len(m1["train"]["content_sha256"]) == 64


def test_needle_example_shape_and_content():
    _, text = corpus.load_split("heldout")
    rng = np.random.default_rng(1)
    for length in (200, 1000, 4096):
        depth = float(rng.random())
        ex = tasks.needle_example(text, length, depth, rng)
        assert len(ex.prompt) == length and ex.prompt[0] == tasks.BOS
        body = bytes(ex.prompt[1:].astype(np.uint8))
        needle = tasks.NEEDLE.format(of="", key=ex.answer).encode()
        assert body.count(needle) == 1
        assert body.endswith(tasks.QUESTION.format(of="").encode())
        assert bytes(ex.prompt[ex.needle_at:ex.needle_at + len(needle)].astype(np.uint8)) == needle
        # The needle sits at the requested depth of the haystack, or up to 200 bytes later (it
        # moves forward to a line start).
        hay_len = length - 1 - len(needle) - len(tasks.QUESTION.format(of="").encode())
        at = 1 + int(depth * hay_len)
        assert at <= ex.needle_at <= min(at + 200, 1 + hay_len)


def test_key_value_recall_has_distinct_names():
    _, text = corpus.load_split("train")
    rng = np.random.default_rng(2)
    ex = tasks.needle_example(text, 2000, 0.3, rng, distractors=3)
    body = bytes(ex.prompt.astype(np.uint8)[1:]).decode("utf-8", "replace")
    assert body.count("# The pass key of ") == 4
    asked = body.rsplit("What is the pass key of ", 1)[1].split("?")[0]
    assert f"The pass key of {asked} is {tasks.MARK}{ex.answer}." in body


def test_training_examples_weights():
    _, text = corpus.load_split("train")
    rng = np.random.default_rng(3)
    toks, w = tasks.needle_training_example(text, 512, rng, answer_weight=7.0)
    assert toks.shape == (513,) and w.shape == (512,)
    assert np.all(w[-tasks.KEY_DIGITS:] == 7.0) and np.all(w[:-tasks.KEY_DIGITS] == 1.0)
    toks, _ = tasks.repeat_example(text, 256, rng)
    assert toks.shape == (257,) and toks.max() < 259


def test_too_short_for_needle():
    with pytest.raises(ValueError, match="too short"):
        tasks.needle_example(np.frombuffer(b"abc\n" * 10, np.uint8), 40, 0.5, np.random.default_rng(4))


@pytest.mark.parametrize("size", [0, 1, tasks.MIN_HAYSTACK_BYTES - 1])
def test_an_empty_or_too_short_haystack_is_refused_by_name(size):
    """needle, RULER-style tasks and text windows refuse such a haystack with a ConfigError that says
    how long it is, not a ZeroDivisionError from deep inside."""
    from gemini_jax.errors import ConfigError
    from gemini_jax.eval.needle import needle
    from gemini_jax.eval.ruler import ruler

    seed = 7
    hay = np.random.default_rng(seed).integers(32, 127, size).astype(np.uint8)
    match = "haystack is empty" if size == 0 else f"haystack has {size} bytes"
    with pytest.raises(ConfigError, match=match):
        tasks.text_window(hay, 64, np.random.default_rng(seed))
    with pytest.raises(ConfigError, match=match):
        tasks.needle_example(hay, 512, 0.5, np.random.default_rng(seed))
    # The harnesses refuse before touching the engine (None here: it is never called).
    with pytest.raises(ConfigError, match=match):
        needle(None, [512], [0.5], trials=1, haystack=hay)
    with pytest.raises(ConfigError, match=match):
        ruler(None, "niah_single", [512], trials=1, haystack=hay)
