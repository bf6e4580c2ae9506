"""Prompts that mix text with images (gj.Prompt, gj.Image): the soft tokens go through prefill, the
paged and contiguous caches, sparse selection, tiers, prefix sharing and snapshot / resume, and every
path reproduces the dense reference on embeddings (gemini_jax.encoders.forward_embeds). Bad input
raises typed errors. The shipped tiny decoder and image encoders, real digits, real text."""

from __future__ import annotations

import os

import numpy as np
import pytest
from flax import nnx

import gemini_jax as gj
from gemini_jax.config import CacheConfig, EngineConfig, SamplingParams, SparseConfig, TierConfig
from gemini_jax.encoders import digits, forward_embeds
from gemini_jax.errors import ContextLengthError, EncoderError, SnapshotError, TokenError
from gemini_jax.testing import contract_tolerance, logits_tolerance

SEED = 20261202
NEW = 6
GREEDY = SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_at_eos=False)
BASE = dict(max_seq_len=128, max_batch=2, prefill_chunk=16, cache=CacheConfig(block_size=8))
ENGINES = {
    "paged": EngineConfig(**BASE),
    "contiguous": EngineConfig(**{**BASE, "cache": CacheConfig(kind="contiguous")}),
    "sparse": EngineConfig(**BASE, sparse=SparseConfig(enabled=True, budget=128, sink_pages=1, local_pages=1,
                                                       sparse_prefill=True)),
    # 8 device slots for a prompt of 8-13 pages: pages go to host RAM and come back while decoding.
    "tiers": EngineConfig(**BASE, tier=TierConfig(enabled=True, device_fraction=0.25, prefetch_depth=2,
                                                  hot_threshold=0)),
}


@pytest.fixture(scope="module")
def model():
    return gj.load_tiny()


@pytest.fixture(scope="module")
def cnn():
    return gj.load_encoder("cnn")


@pytest.fixture(scope="module")
def case(model):
    """Two held-out digits and a window of real text (seeded)."""
    rng = np.random.default_rng(SEED)
    data = digits.load()
    held = digits.split(data.labels)[1]  # held-out digits: the projectors never trained on them
    pick = rng.choice(held, 2, replace=False)
    images = data.images
    with open(os.__file__, "rb") as fh:
        src = fh.read()
    start = int(rng.integers(0, len(src) - 200))
    text = src[start:start + int(rng.integers(30, 60))].decode("utf-8", "replace")
    return images[pick[0]], images[pick[1]], text


def reference(model, paired, image, text, generated):
    """Dense logits f32[NEW, V] of the tokens after [BOS] + image + text, teacher-forced on `generated`."""
    ids = [model.cfg.bos_id]
    soft = np.asarray(paired.soft_tokens(image))
    after = list(text.encode()) + list(generated)
    emb = np.concatenate([np.asarray(model.embed_tokens(np.asarray(ids))), soft,
                          np.asarray(model.embed_tokens(np.asarray(after, np.int32)))])
    logits = np.asarray(forward_embeds(model, emb))
    start = 1 + len(soft) + len(text.encode()) - 1
    return logits[start:start + NEW]


@pytest.mark.parametrize("path", list(ENGINES))
def test_image_prompt_reproduces_the_dense_reference(path, model, cnn, case):
    image, _, text = case
    with gj.Engine(model, ENGINES[path]) as eng:
        out = eng.generate(gj.Prompt([gj.Image(image, encoder=cnn), text]), GREEDY, return_logits=True)
    if path == "tiers":
        assert out.stats["pages_fetched_host"] > 0, "no page came back from host RAM: the tiers were not exercised"
    ref = reference(model, cnn, image, text, out.tokens)
    # The contract (README, exactness table: soft): 1e-5 × max(1, max|ref|); the float bound where that is tighter.
    tol = contract_tolerance(logits_tolerance(model.cfg, context=BASE["max_seq_len"], reference=ref), ref, contract=1e-5)
    np.testing.assert_allclose(out.logits, ref, rtol=0, atol=tol, err_msg=f"{path}: logits vs reference (seed {SEED})")
    assert out.tokens == [int(t) for t in ref.argmax(-1)], f"{path}: tokens are not the reference's greedy ones"


def test_same_image_shares_pages_and_another_does_not(model, cnn, case):
    a, b, text = case
    with gj.Engine(model, ENGINES["paged"]) as eng:
        first = eng.generate(gj.Prompt([text, gj.Image(a, encoder=cnn), text]), GREEDY, return_logits=True)
        again = eng.generate(gj.Prompt([text, gj.Image(a, encoder=cnn), text]), GREEDY, return_logits=True)
        other = eng.generate(gj.Prompt([text, gj.Image(b, encoder=cnn), text]), GREEDY, return_logits=True)
        rows = len(eng.soft)
    n_text = 1 + len(text.encode())  # BOS + text before the image
    full = (n_text + 4 + len(text.encode()) - 1) // 8 * 8  # full pages a repeat can share (last token computed)
    assert first.stats["prefill_tokens_reused"] == 0
    assert again.stats["prefill_tokens_reused"] == full and np.array_equal(again.logits, first.logits)
    # Another image: only the pages before it are shared.
    assert other.stats["prefill_tokens_reused"] == n_text // 8 * 8
    assert rows == 8, f"two images of 4 soft tokens each, registered once each; the table holds {rows}"


def test_snapshot_carries_soft_tokens_to_another_engine(model, cnn, case, tmp_path):
    """Resume in an engine that numbers its soft tokens differently: the same continuation."""
    a, b, text = case
    prompt = gj.Prompt([gj.Image(a, encoder=cnn), text])
    params = SamplingParams(max_new_tokens=2 * NEW, temperature=0.0, stop_at_eos=False)
    with gj.Engine(model, ENGINES["paged"]) as eng:
        whole = eng.generate(prompt, params).tokens
        sess = eng.start(prompt, SamplingParams(max_new_tokens=NEW, temperature=0.0, stop_at_eos=False))
        first = sess.run()
        sess.snapshot(str(tmp_path / "snap"))
        sess.close()
    with gj.Engine(model, ENGINES["paged"]) as eng2:
        eng2.generate(gj.Prompt([gj.Image(b, encoder=cnn), "x"]), SamplingParams(max_new_tokens=1))  # other rows first
        r = eng2.resume(str(tmp_path / "snap"), params=SamplingParams(max_new_tokens=NEW, temperature=0.0,
                                                                       stop_at_eos=False))
        rest = r.run()
        assert max(r.tokens) >= model.cfg.vocab_size + 4, "the resumed image should sit in rows 4.. of this table"
        r.close()
    assert first + rest == whole, f"seed {SEED}"


def test_resume_refuses_another_version_of_an_encoder(model, cnn, case, tmp_path):
    a, b, text = case
    with gj.Engine(model, ENGINES["paged"]) as eng:
        sess = eng.start(gj.Prompt([gj.Image(a, encoder=cnn), text]), SamplingParams(max_new_tokens=2))
        sess.run()
        sess.snapshot(str(tmp_path / "snap"))
        sess.close()
        other = gj.load_encoder("cnn")  # the same name, a projector whose weights moved
        leaf = next(v for _, v in nnx.iter_graph(other.projector) if isinstance(v, nnx.Param))
        leaf.set_value(leaf[...] + 1e-3)
        instruction = gj.Prompt([gj.Image(b, encoder=other), " and this?"], add_bos=False)
        with pytest.raises(EncoderError, match="projector fingerprint"):
            eng.resume(str(tmp_path / "snap"), instruction)
        r = eng.resume(str(tmp_path / "snap"), gj.Prompt([gj.Image(b, encoder=cnn)], add_bos=False))
        r.close()  # the encoder the context was built with is accepted


def test_a_snapshot_missing_its_soft_vectors_is_refused(model, cnn, case, tmp_path):
    from gemini_jax.session import snapshot

    a, _, text = case
    with gj.Engine(model, ENGINES["paged"]) as eng:
        sess = eng.start(gj.Prompt([gj.Image(a, encoder=cnn), text]), SamplingParams(max_new_tokens=1))
        sess.run()
        sess.snapshot(str(tmp_path / "snap"))
        sess.close()
        meta, arrays, _ = snapshot.load_snapshot(str(tmp_path / "snap"))
        arrays.pop("soft_vectors")
        with pytest.raises(SnapshotError, match="soft tokens' vectors"):
            snapshot.restore_soft(eng, "snap", meta, arrays)


def test_bad_inputs_raise_typed_errors(model, cnn, case):
    a, _, text = case
    with gj.Engine(model, EngineConfig(**{**BASE, "max_seq_len": 32, "max_soft_tokens": 6})) as eng:
        with pytest.raises(EncoderError, match="shape"):
            eng.generate(gj.Prompt([gj.Image(a[:4], encoder=cnn)]), GREEDY)
        with pytest.raises(EncoderError, match="one image"):
            eng.generate(gj.Prompt([gj.Image(np.stack([a, a]), encoder=cnn)]), GREEDY)
        with pytest.raises(EncoderError, match="projector"):
            eng.generate(gj.Prompt([gj.Image(a, encoder=model)]), GREEDY)
        with pytest.raises(ContextLengthError, match="max_seq_len"):  # soft tokens count against the context
            eng.generate(gj.Prompt([gj.Image(a, encoder=cnn), "x" * 24]), GREEDY)
        eng.generate(gj.Prompt([gj.Image(a, encoder=cnn)]), SamplingParams(max_new_tokens=1))
        with pytest.raises(ContextLengthError, match="max_soft_tokens"):  # 4 rows held, 4 more do not fit in 6
            eng.generate(gj.Prompt([gj.Image(np.flipud(a), encoder=cnn)]), SamplingParams(max_new_tokens=1))
        with pytest.raises(TokenError, match="outside the vocabulary"):  # ids past the table's rows
            eng.generate([model.cfg.bos_id, model.cfg.vocab_size + 4], SamplingParams(max_new_tokens=1))
        with pytest.raises(TokenError, match="part 1"):
            eng.generate(gj.Prompt(["a", 3.5]), GREEDY)


def test_persistent_prefixes_stop_at_the_first_soft_token(model, cnn, case, tmp_path):
    """Another process numbers its soft tokens from row 0 too: image b there has the ids image a had
    here. Pages from the first soft token on are never stored, so b can never be served a's pages."""
    a, b, text = case
    text = (text * 3)[:40]  # 41 tokens with BOS: 5 full pages of text before the image
    cfg = EngineConfig(**{**BASE, "prefill_chunk": 8},
                       tier=TierConfig(enabled=False, disk_path=str(tmp_path / "kv"), persistent=True))
    with gj.Engine(model, cfg) as eng:
        eng.generate(gj.Prompt([text, gj.Image(a, encoder=cnn), text]), GREEDY)
    with gj.Engine(model, cfg) as eng:
        out = eng.generate(gj.Prompt([text, gj.Image(b, encoder=cnn), text]), GREEDY, return_logits=True)
    with gj.Engine(model, ENGINES["paged"]) as eng:
        fresh = eng.generate(gj.Prompt([text, gj.Image(b, encoder=cnn), text]), GREEDY, return_logits=True)
    assert out.stats["prefill_tokens_reused"] == 40, "the text pages before the image come from the store"
    assert out.tokens == fresh.tokens, f"seed {SEED}"
    tol = logits_tolerance(model.cfg, context=BASE["max_seq_len"], reference=fresh.logits)  # other chunks
    np.testing.assert_allclose(out.logits, fresh.logits, rtol=0, atol=tol, err_msg=f"logits vs a fresh engine's (seed {SEED})")
