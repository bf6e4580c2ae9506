"""The shipped small model's packaging: `gj.load_tiny()` checks the card's sha256 and the weights'
shapes, so a corrupt or mismatched checkpoint is a `CheckpointError`, never a silently wrong model."""

from __future__ import annotations

import json
import os
import shutil

from types import SimpleNamespace

import jax
import numpy as np
import pytest
from flax import nnx

import gemini_jax as gj
from gemini_jax import tiny
from gemini_jax.data import corpus
from gemini_jax.eval import perplexity, unigram_bits_per_byte
from gemini_jax.eval.trials import Draw
from gemini_jax.errors import CheckpointError
from gemini_jax.weights import save_safetensors
from gemini_jax.testing import float_tolerance, random_model, tiny_config


@pytest.fixture
def asset(tmp_path):
    """An asset directory laid out as experiments/export_tiny.py writes it (random weights)."""
    d = tmp_path / "tiny"
    model = random_model(tiny_config("tiny", vocab_size=259), 3)
    save_safetensors(model, d)
    card = {"name": "test", "step": 0, "weights_sha256": tiny.sha256_file(str(d / "model.safetensors"))}
    (d / "card.json").write_text(json.dumps(card))
    return d, model


def test_round_trip(asset):
    d, model = asset
    loaded = tiny.load_tiny(str(d))
    toks = list(np.random.default_rng(1).integers(0, 256, 20))
    np.testing.assert_array_equal(np.asarray(gj.forward(loaded, toks)), np.asarray(gj.forward(model, toks)))


def test_corrupt_weights_file(asset):
    d, _ = asset
    f = d / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[-5] ^= 0x01  # one bit of one weight
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError, match="sha256"):
        tiny.load_tiny(str(d))


def test_missing_or_broken_card(asset):
    d, _ = asset
    (d / "card.json").write_text("{not json")
    with pytest.raises(CheckpointError, match="not valid JSON"):
        tiny.load_tiny(str(d))
    os.remove(d / "card.json")
    with pytest.raises(CheckpointError, match="card.json missing"):
        tiny.load_tiny(str(d))


def test_mismatched_config(asset):
    d, _ = asset
    cfg = json.loads((d / "config.json").read_text())
    cfg["hidden_size"] = cfg["hidden_size"] * 2  # weights of one shape, a config of another
    (d / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(CheckpointError, match="shape"):
        tiny.load_tiny(str(d))


@pytest.mark.skipif(not tiny.available(), reason="no shipped tiny model in this checkout")
def test_shipped_model_loads_and_fits_the_size_limit(tmp_path):
    size = sum(os.path.getsize(os.path.join(tiny.ASSET_DIR, f)) for f in os.listdir(tiny.ASSET_DIR))
    assert size <= 20 * 2**20, size
    card = tiny.card()
    model = gj.load_tiny()
    assert model.cfg.vocab_size == 259
    # The card's parameter count is the loaded weights' count.
    _, params = nnx.split(model, nnx.Param)
    assert sum(x.size for x in jax.tree.leaves(params)) == card["num_params"]
    # A copy with one flipped byte is refused.
    bad = tmp_path / "tiny"
    shutil.copytree(tiny.ASSET_DIR, bad)
    f = bad / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[len(data) // 2] ^= 0xFF
    f.write_bytes(bytes(data))
    with pytest.raises(CheckpointError):
        tiny.load_tiny(str(bad))


class _ForwardScorer:
    """`engine.score` from a plain full-sequence forward, independent of the engine's cache."""

    def __init__(self, model):
        self.model = model

    def score(self, prompts, continuations):  # lists of requests, as perplexity() passes them
        out = []
        for prompt, continuation in zip(prompts, continuations):
            logits = jax.nn.log_softmax(gj.forward(self.model, prompt + continuation), axis=-1)
            logp = np.asarray(logits)[len(prompt) - 1:-1]
            out.append(logp[np.arange(len(continuation)), continuation])
        return SimpleNamespace(tokens=out)


@pytest.mark.skipif(not tiny.available(), reason="no shipped tiny model in this checkout")
def test_shipped_model_scores_what_its_card_says():
    """The card's held-out bits per byte, recomputed from the weights on the same windows, and
    its unigram baseline recomputed from the corpus; the model must beat the baseline."""
    card = tiny.card()
    want = card["eval"]["heldout_bits_per_byte"]
    got = perplexity(_ForwardScorer(gj.load_tiny()), want["context"], windows=want["windows"],
                     scored=want["scored_per_window"], draw=Draw("dev", 1234))  # export_tiny.py's
    uni = unigram_bits_per_byte()
    assert got["bits_per_byte"] < uni, (got, uni)
    here = corpus.manifest()
    if all(here[s]["content_sha256"] == card["corpus"][s]["content_sha256"] for s in ("train", "heldout")):
        from gemini_jax.eval.reproduce import BPB_TOL

        # The contract for rerunning a recorded bits-per-byte figure (gemini_jax.eval.reproduce): BPB_TOL.
        assert got["bits_per_byte"] == pytest.approx(want["bits_per_byte"], abs=BPB_TOL)
        # A float64 mean of positive terms, one per held-out byte: the mean is their magnitude.
        tol = float_tolerance(dtype="float64", depth=2, terms=len(corpus.load_split("heldout")[1]), magnitude=uni)
        assert uni == pytest.approx(card["eval"]["unigram_bits_per_byte"], abs=tol)
    else:  # another standard library: the card's figures are for other text
        assert want["bits_per_byte"] < card["eval"]["unigram_bits_per_byte"]
        print(f"corpus of python {here['python']} is not the card's ({card['corpus']['python']}): "
              f"recomputed {got['bits_per_byte']:.4f} bits/byte, card {want['bits_per_byte']:.4f}")
