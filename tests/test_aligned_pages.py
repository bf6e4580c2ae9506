"""Syntax-aligned pages (`cache.align="syntax"`): the layout (a page starts at every top-level
definition, padding only at the end of a page, the tokens unchanged), the engine reproducing the
dense reference with aligned pages (dense, sparse with a covering budget, prefix reuse), and every
refused combination or bad input raising a typed error. Real standard-library source, the shipped
tiny model."""

from __future__ import annotations

import posixpath
import textwrap

import numpy as np
import pytest

import gemini_jax as gj
from gemini_jax.code.boundaries import definition_starts
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.errors import ConfigError, ContextLengthError
from gemini_jax.model import forward
from gemini_jax.runtime import aligned
from gemini_jax.testing import logits_tolerance

SEED = 20261202
NEW = 5
S = 8
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_at_eos=False)
ALIGNED = CacheConfig(block_size=S, align="syntax")
BASE = dict(max_seq_len=640, max_batch=2, prefill_chunk=64)
ENGINES = {
    "dense": EngineConfig(**BASE, cache=ALIGNED),
    # A budget over the whole context: every page is read, so sparse must equal dense.
    "sparse_covering": EngineConfig(**BASE, cache=ALIGNED, sparse=SparseConfig(
        enabled=True, budget=640, sink_pages=1, local_pages=1, sparse_prefill=True, rerank=2)),
}


@pytest.fixture(scope="module")
def model():
    return gj.load_tiny()


@pytest.fixture(scope="module")
def source() -> bytes:
    with open(posixpath.__file__, "rb") as fh:
        return fh.read()


@pytest.fixture(scope="module")
def prompt(model, source) -> np.ndarray:
    """A seeded window of real code holding several top-level definitions, after BOS."""
    rng = np.random.default_rng(SEED)
    defs = [i for i in range(len(source)) if source.startswith(b"\ndef ", i) or source.startswith(b"\nclass ", i)]
    start = int(rng.choice(defs[:-4])) - int(rng.integers(0, 40))
    window = source[max(start, 0):max(start, 0) + 700]
    # Ends before the next top-level line: a definition cut mid-body does not parse (see the last test).
    window = window[:max(window.rfind(b"\ndef "), window.rfind(b"\nclass ")) + 1]
    assert len(window) > 200, f"seed {SEED}: window too short"
    return np.array([model.cfg.bos_id] + list(window), np.int32)


# ---- the layout --------------------------------------------------------------------------------------
def test_definition_starts_on_real_code(source):
    starts = definition_starts(source, "python")
    assert starts == sorted(set(starts)) and len(starts) >= 5
    for s in starts:
        line = source[s:source.index(b"\n", s)]
        assert s == 0 or source[s - 1:s] == b"\n", f"boundary {s} is not at a line start"
        assert line.lstrip().startswith((b"def ", b"class ", b"@")), f"boundary {s} opens {line[:30]!r}"
    # Every top-level def / class line of the file is a boundary (none is inside another definition).
    want = {i + 1 for i in range(len(source)) if source.startswith((b"\ndef ", b"\nclass "), i)}
    assert want <= set(starts), sorted(want - set(starts))[:5]


def test_definition_starts_skip_nested_and_survive_broken_text():
    src = textwrap.dedent("""\
        import os
        @decorator(1)
        def outer(x):
            def inner(y):
                return y
            return inner(x)
        ))) not python at all (((
        class K:
            def method(self):
                pass
        """).encode()
    starts = definition_starts(src, "python")
    assert src[starts[0]:].startswith(b"@decorator"), "a decorated definition starts at its decorator"
    assert not any(src[s:].startswith((b"    def", b"def inner", b"def method")) for s in starts)
    assert any(src[s:].startswith(b"class K") for s in starts), "recovery after broken text lost a definition"
    assert definition_starts(b"", "python") == []
    # align_depth 1: methods and functions nested in a top-level definition start pages too, not deeper ones.
    deeper = [src[s:].split(b"\n", 1)[0].strip() for s in definition_starts(src, "python", 1)]
    assert deeper == [b"@decorator(1)", b"def inner(y):", b"class K:", b"def method(self):"], deeper
    # A definition cut inside its body (its docstring never closes) is not recognized: the grammar cannot
    # say what it is. The definitions before it still are.
    cut = b"def a():\n    return 1\n\nclass B:\n    \"\"\"never closed\n    def c(se"
    assert definition_starts(cut, "python") == [0]


def test_layout_pads_only_page_ends_and_keeps_tokens(prompt):
    cfg = ENGINES["dense"]
    slots = aligned.slot_tokens(cfg, prompt)
    pad = slots == aligned.PAD
    assert pad.any(), "this window has definitions off page boundaries: some padding is expected"
    np.testing.assert_array_equal(slots[~pad], prompt, err_msg=f"seed {SEED}")
    # Each definition lands on a page start; padding never starts a page or follows a token within it.
    real_index = np.cumsum(~pad) - 1  # slot -> index among real tokens
    data = bytes(int(t) if t < 256 else 10 for t in prompt)
    for s in definition_starts(data, "python"):
        slot = int(np.flatnonzero(real_index == s)[0] if s else 0)
        assert slot % S == 0 or s == 0, f"definition at byte {s} sits at slot {slot} (seed {SEED})"
    pages = np.pad(pad, (0, -len(pad) % S)).reshape(-1, S)
    for p in pages:
        if p.any():
            first = int(p.argmax())
            assert first > 0 and p[first:].all(), f"a page's padding must be its tail: {p.astype(int)}"
    fill = aligned.page_fill(slots, S, len(pages) + 2)
    np.testing.assert_array_equal(fill[:len(pages)], [int(p.argmax()) if p.any() else S for p in pages])
    assert (fill[len(pages):] == S).all()
    rope = aligned.rope_positions(slots, 0)
    np.testing.assert_array_equal(rope[~pad], np.arange(len(prompt)))


def test_no_alignment_is_the_identity(prompt):
    np.testing.assert_array_equal(aligned.slot_tokens(EngineConfig(**BASE), prompt), prompt)


# ---- the engine ----------------------------------------------------------------------------------------
def reference(model, prompt, generated):
    logits = np.asarray(forward(model, np.concatenate([prompt, np.asarray(generated[:-1], np.int32)])))
    return logits[len(prompt) - 1:len(prompt) - 1 + NEW]


@pytest.mark.parametrize("path", list(ENGINES))
def test_aligned_pages_reproduce_the_dense_reference(path, model, prompt):
    with gj.Engine(model, ENGINES[path]) as eng:
        out = eng.generate(prompt, GREEDY, return_logits=True)
        again = eng.generate(prompt, GREEDY, return_logits=True)  # its full pages now come from the cache
    ref = reference(model, prompt, out.tokens)
    # The contract (README, exactness table: aligned): 1e-4; the float bound where that is tighter.
    tol = min(1e-4, logits_tolerance(model.cfg, context=BASE["max_seq_len"], reference=ref))
    np.testing.assert_allclose(out.logits, ref, rtol=0, atol=tol, err_msg=f"{path}: logits vs reference (seed {SEED})")
    assert again.stats["prefill_tokens_reused"] > 0, "an equal aligned prompt must share its pages"
    tol = logits_tolerance(model.cfg, context=BASE["max_seq_len"], reference=out.logits)  # other chunks
    np.testing.assert_allclose(again.logits, out.logits, rtol=0, atol=tol, err_msg=f"{path}, prefix reuse (seed {SEED})")


def test_sparse_aligned_pages_read_fewer_bytes_and_batch(model, prompt):
    cfg = EngineConfig(**BASE, cache=ALIGNED, sparse=SparseConfig(enabled=True, budget=64, sink_pages=1,
                                                                  local_pages=1))
    other = prompt[:300].copy()
    with gj.Engine(model, cfg) as eng:
        out = eng.generate([prompt, other], GREEDY, return_logits=True)
    with gj.Engine(model, ENGINES["dense"]) as eng:
        dense = eng.generate([prompt, other], GREEDY, return_logits=True)
    assert 0 < out.stats["kv_bytes_read"] < dense.stats["kv_bytes_read"]
    # Two rows of different layouts in one batch: each still matches its own dense reference.
    for row, p in enumerate([prompt, other]):
        ref = reference(model, p, dense.tokens[row])
        tol = min(1e-4, logits_tolerance(model.cfg, context=BASE["max_seq_len"], reference=ref))  # the contract
        np.testing.assert_allclose(dense.logits[row], ref, rtol=0, atol=tol,
                                   err_msg=f"row {row}: logits vs reference (seed {SEED})")
    assert all(np.isfinite(lg).all() for lg in out.logits)


# ---- refused combinations and bad input ---------------------------------------------------------------
@pytest.mark.parametrize("make, words", [
    (lambda: EngineConfig(**BASE, cache=CacheConfig(kind="contiguous", align="syntax")), "cache.kind='paged'"),
    (lambda: EngineConfig(**BASE, cache=ALIGNED, attention_impl="pallas"), "attention_impl='pallas'"),
    (lambda: EngineConfig(**BASE, cache=ALIGNED, tier=TierConfig(enabled=True, device_fraction=0.5)), "tier.enabled"),
    (lambda: EngineConfig(**BASE, cache=ALIGNED, sparse=SparseConfig(enabled=True, budget=64, positions="compact")),
     "positions='compact'"),
    (lambda: CacheConfig(align="lines"), "cache.align='lines'"),
], ids=["contiguous", "pallas", "tiers", "compact", "unknown"])
def test_refused_configs(make, words):
    with pytest.raises(ConfigError, match=words.replace("(", r"\(").replace(")", r"\)")):
        make()


def test_engine_refusals(model, prompt):
    with pytest.raises(ConfigError, match="cobol"):
        gj.Engine(model, EngineConfig(**BASE, cache=CacheConfig(block_size=S, align="syntax", align_language="cobol")))
    with gj.Engine(model, ENGINES["dense"]) as eng:
        with pytest.raises(ConfigError, match="sessions"):
            eng.start(prompt, GREEDY)
        # The padding counts against max_seq_len: refused before any work, with the padding named.
        slots = aligned.slot_tokens(eng.config, prompt)
        room = BASE["max_seq_len"] - len(prompt)
        assert len(slots) - len(prompt) > 0
        with pytest.raises(ContextLengthError, match="padding"):
            eng.generate(prompt, SamplingParams(max_new_tokens=room - 1, temperature=0.0))
        assert not eng.pages.seqs, "a refused request must leave no sequence behind"


def test_non_byte_model_is_refused(model):
    from dataclasses import replace

    from gemini_jax.model import Decoder
    from flax import nnx

    small = Decoder(replace(model.cfg, vocab_size=300), rngs=nnx.Rngs(0))
    with pytest.raises(ConfigError, match="byte-level"):
        gj.Engine(small, ENGINES["dense"])
