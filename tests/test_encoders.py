"""Image encoders plugged into the frozen tiny decoder (gemini_jax.encoders): the decoder on embeddings
equals the token forward; the shipped encoders load with stable fingerprints and answer held-out
digits as well as their record says; a projector refuses another encoder; bad inputs raise typed
errors; and training a projector leaves the decoder's weights untouched."""

from __future__ import annotations

import importlib.util
import json
import os

import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from omegaconf import OmegaConf

import gemini_jax as gj
from gemini_jax import encoders
from gemini_jax.encoders import digits, task
from gemini_jax.encoders.registry import ASSET_DIR
from gemini_jax.errors import ContextLengthError, EncoderError
from gemini_jax.testing import float_tolerance
from gemini_jax.weights.native import params_sha256

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "experiments", "results", "encoders", "digits.json")
SHIPPED = ("cnn", "mixer")
SEED = 20260514  # every draw below; named in the failure messages


@pytest.fixture(scope="module")
def decoder():
    return gj.load_tiny()


@pytest.fixture(scope="module")
def paired():
    return {name: encoders.load_encoder(name) for name in SHIPPED}


@pytest.fixture(scope="module")
def data():
    return digits.load()


@pytest.fixture(scope="module")
def record():
    with open(RECORD) as fh:
        return json.load(fh)


def decoder_sha256(decoder) -> str:
    return params_sha256(nnx.state(decoder, nnx.Param))


def test_forward_embeds_equals_forward(decoder):
    tokens = np.random.default_rng(SEED).integers(0, decoder.cfg.vocab_size, 37)
    want = np.asarray(gj.forward(decoder, tokens))
    got = np.asarray(encoders.forward_embeds(decoder, decoder.embed_tokens(jnp.asarray(tokens))))
    assert got.shape == want.shape == (37, decoder.cfg.vocab_size)
    cfg = decoder.cfg  # two jitted programs of one decoder: its layers, its widest matmul
    tol = float_tolerance(depth=cfg.num_layers, terms=max(cfg.hidden_size, cfg.intermediate_size),
                          magnitude=np.abs(want).max())
    np.testing.assert_allclose(got, want, rtol=0, atol=tol, err_msg=f"seed={SEED}")


def test_shipped_encoders_are_listed_and_small():
    assert set(SHIPPED) <= set(encoders.list_encoders())
    total = sum(os.path.getsize(os.path.join(ASSET_DIR, name, file)) for name in SHIPPED
                for file in os.listdir(os.path.join(ASSET_DIR, name)))
    assert total < 5 << 20


def test_fingerprints_are_stable_and_recorded(paired, record):
    designs = {row["encoder"]: row for row in record["records"]}
    for name, bundle in paired.items():
        again = encoders.load_encoder(name)
        assert again.encoder.fingerprint == bundle.encoder.fingerprint
        assert bundle.encoder.fingerprint == bundle.card["encoder_fingerprint"] == bundle.projector.encoder_fingerprint
        assert designs[name]["encoder_fingerprint"] == bundle.encoder.fingerprint
        assert bundle.encoder.modality == "image" and isinstance(bundle.encoder, encoders.Encoder)
    assert paired["cnn"].encoder.fingerprint != paired["mixer"].encoder.fingerprint
    assert paired["cnn"].encoder.d_enc != paired["mixer"].encoder.d_enc  # two designs of two widths


def test_split_is_stratified_disjoint_and_as_recorded(data, paired):
    split = paired["cnn"].card["split"]
    train, heldout = digits.split(data.labels, seed=split["seed"], heldout_fraction=split["heldout_fraction"])
    assert (len(train), len(heldout)) == (split["train"], split["heldout"])
    assert not set(train) & set(heldout) and len(train) + len(heldout) == len(data)
    assert np.bincount(data.labels[heldout]).min() >= 0.15 * np.bincount(data.labels).min()
    again = digits.split(data.labels, seed=split["seed"], heldout_fraction=split["heldout_fraction"])
    assert np.array_equal(again[1], heldout)


@pytest.mark.parametrize("name", SHIPPED)
def test_heldout_accuracy_matches_the_record(name, decoder, paired, data, record):
    """Recomputed on the held-out images, within two images of the record (float order may flip one
    borderline answer on another machine), and at least the record's goal."""
    bundle = paired[name]
    split = bundle.card["split"]
    _, heldout = digits.split(data.labels, seed=split["seed"], heldout_fraction=split["heldout_fraction"])
    images, labels = data.images[heldout], data.labels[heldout]
    logits = nnx.jit(task.answer_logits)(decoder, bundle.projector, bundle.encoder.encode(images))
    hits = int((np.asarray(logits).argmax(-1) == task.answer_token(labels)).sum())
    recorded = {row["encoder"]: row for row in record["records"]}[name]
    assert recorded["heldout_answer"] == bundle.card["heldout_answer"]
    assert abs(hits - recorded["heldout_answer"]["hits"]) <= 2
    assert hits / len(labels) >= record["goal"]
    classified = int((bundle.encoder.classify(images) == labels).sum())
    assert abs(classified - recorded["heldout_classifier"]["hits"]) <= 2
    assert record["decoder_sha256_before"] == record["decoder_sha256_after"] == decoder_sha256(decoder)


def test_swapped_projector_is_refused(paired):
    cnn, mixer = paired["cnn"], paired["mixer"]
    with pytest.raises(EncoderError) as info:
        encoders.PairedEncoder("mixer", mixer.encoder, cnn.projector)
    message = str(info.value)
    assert "'cnn'" in message and "'mixer'" in message
    assert cnn.encoder.fingerprint[:16] in message and mixer.encoder.fingerprint[:16] in message


def test_unknown_encoder_lists_the_known_ones():
    with pytest.raises(EncoderError, match=r"no encoder named 'siglip'; known: \['cnn', 'mixer'"):
        encoders.load_encoder("siglip")


@pytest.mark.parametrize("images, match", [
    (np.zeros((8, 9)), r"shaped \[8, 8\] or \[N, 8, 8\].*got shape \[8, 9\]"),
    (np.zeros((2, 8, 8, 1)), r"got shape \[2, 8, 8, 1\]"),
    (np.zeros((0, 8, 8)), r"N >= 1; got shape \[0, 8, 8\]"),
    (np.full((8, 8), "a"), r"integer or float pixels.*dtype <U1"),
    (np.ones((8, 8), bool), r"dtype bool"),
    (np.full((3, 8, 8), 17.0), r"pixel \[0, 0, 0\] is 17.0 \(192 bad pixel"),
    (-np.ones((8, 8), np.int64), r"pixel \[0, 0, 0\] is -1.0"),
    (np.where(np.eye(8) > 0, np.nan, 1.0), r"pixel \[0, 0, 0\] is nan \(8 bad"),
])
def test_bad_images_raise(images, match, paired):
    with pytest.raises(EncoderError, match=match):
        paired["cnn"].encoder.encode(images)


def test_one_image_and_a_batch(paired, data):
    bundle = paired["mixer"]
    one, many = bundle.soft_tokens(data.images[0].astype(np.int64)), bundle.soft_tokens(data.images[:3])
    assert one.shape == (4, 256) and many.shape == (3, 4, 256)
    # Batch of one vs three: the mixer's blocks then the projector's two layers, widest matmul its hidden.
    tol = float_tolerance(depth=2 * bundle.encoder.config.blocks + 2, terms=bundle.projector.config.hidden,
                          magnitude=np.abs(np.asarray(many[0])).max())
    np.testing.assert_allclose(np.asarray(one), np.asarray(many[0]), rtol=0, atol=tol)


def test_too_many_soft_tokens_for_the_context(decoder, paired, data):
    bundle = paired["cnn"]
    vectors = bundle.encoder.encode(data.images[:2])
    fits = len(task.BEFORE) + 4 + len(task.AFTER)
    embeds = encoders.soft_prompt(decoder, bundle.projector(vectors), task.BEFORE, task.AFTER, max_context=fits)
    assert embeds.shape == (2, fits, decoder.cfg.hidden_size)
    with pytest.raises(ContextLengthError, match=rf"4 soft tokens \+ 15 text tokens = 19 exceed max_context="
                                                  rf"{fits - 1}; at most 3 soft tokens fit"):
        task.answer_logits(decoder, bundle.projector, vectors, max_context=fits - 1)
    soft = jnp.asarray(np.random.default_rng(SEED).normal(size=(1, decoder.cfg.max_position, decoder.cfg.hidden_size)))
    with pytest.raises(ContextLengthError, match=f"exceed max_context={decoder.cfg.max_position}"):
        encoders.soft_prompt(decoder, soft, task.BEFORE, task.AFTER)


def test_projector_steps_leave_the_decoder_unchanged(decoder, data):
    spec = importlib.util.spec_from_file_location("train_encoders", os.path.join(ROOT, "experiments",
                                                                                  "train_encoders.py"))
    train_encoders = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(train_encoders)
    encoder = encoders.build_encoder("cnn", {"channels": 4, "d_enc": 8}, seed=1)
    vectors = np.asarray(encoder.encode(data.images[:64]))
    projector = encoders.Projector(encoders.ProjectorConfig(d_enc=8, d_model=decoder.cfg.hidden_size, hidden=16),
                                   encoder_fingerprint=encoder.fingerprint, encoder_name="small",
                                   rngs=nnx.Rngs(2))
    before_decoder, before_projector = decoder_sha256(decoder), params_sha256(nnx.state(projector, nnx.Param))
    cfg = OmegaConf.create({"steps": 3, "batch": 16, "lr": 1e-2, "weight_decay": 0.0})
    loss = train_encoders.train_projector(decoder, projector, vectors, data.labels[:64], np.arange(64), cfg,
                                          np.random.default_rng(3), "test")
    assert np.isfinite(loss)
    assert params_sha256(nnx.state(projector, nnx.Param)) != before_projector  # the steps did train
    assert decoder_sha256(decoder) == before_decoder
