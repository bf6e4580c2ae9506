"""The shipped node encoder (gemini_jax.code.encoder): it loads, embeds every normalized node as a
unit vector, deterministically, and on held-out programs puts one kind's nodes of different languages
closer together than different kinds' nodes of one language."""

from __future__ import annotations

import os
import shutil

import numpy as np
import pytest

from gemini_jax.code import normalized_nodes, synthetic
from gemini_jax.code.dataset import HELDOUT_SEEDS, TRAIN_SEEDS, kind_distances, node_dataset
from gemini_jax.code.encoder import ASSET_DIR, CONFIG_NAME, WEIGHTS_NAME, EncoderConfig, NodeEncoder
from gemini_jax.errors import CheckpointError, ConfigError

SEED = HELDOUT_SEEDS.start + 5


@pytest.fixture(scope="module")
def encoder():
    return NodeEncoder.load()


def test_shipped_weights_are_small():
    assert os.path.getsize(os.path.join(ASSET_DIR, WEIGHTS_NAME)) < 1 << 20


@pytest.mark.parametrize("language", ["python", "rust", "verilog"])
def test_embed_shapes_and_unit_rows(encoder, language):
    source = synthetic.program(language, SEED)
    nodes, vectors = encoder.embed(source, language)
    assert nodes == normalized_nodes(source, language), f"{language}, seed={SEED}"
    assert vectors.shape == (len(nodes), encoder.config.dim) and vectors.dtype == np.float32
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=1e-5, err_msg=f"{language}, seed={SEED}")


def test_embedding_is_deterministic(encoder):
    source = synthetic.program("go", SEED)
    _, first = encoder.embed(source, "go")
    _, again = NodeEncoder.load().embed(source.encode("utf-8"), "go")
    np.testing.assert_array_equal(first, again, err_msg=f"go, seed={SEED}")


def test_heldout_programs_are_unseen():
    assert not set(TRAIN_SEEDS) & set(HELDOUT_SEEDS)


def test_same_kind_across_languages_is_closer_than_other_kinds_within_one(encoder):
    seeds = HELDOUT_SEEDS[:3]
    data = node_dataset(seeds, encoder.config.features)
    distances = kind_distances(encoder(data.x), data.kinds, data.languages)
    assert len(distances["per_kind"]) >= 8 and len(set(data.languages.tolist())) >= 10
    for kind, row in distances["per_kind"].items():
        assert row["same_kind_cross_language"] < row["different_kind_same_language"], (
            f"held-out seeds {list(seeds)}: {kind} {row}")
    # The trained encoder separates kinds better than its input features do.
    raw = kind_distances(data.x, data.kinds, data.languages)
    margin = distances["different_kind_same_language"] - distances["same_kind_cross_language"]
    assert margin > raw["different_kind_same_language"] - raw["same_kind_cross_language"], (distances, raw)


def test_kind_distances_on_planted_vectors():
    rng = np.random.default_rng(SEED)
    kinds = np.array(["A", "A", "B", "B", "A", "B"])
    languages = np.array(["x", "y", "x", "y", "x", "x"])
    direction = {"A": rng.normal(size=8), "B": rng.normal(size=8)}
    vectors = np.stack([direction[k] for k in kinds])
    result = kind_distances(vectors, kinds, languages)
    assert result["per_kind"]["A"]["same_kind_cross_language"] == pytest.approx(0.0, abs=1e-6)
    cos = direction["A"] @ direction["B"] / np.linalg.norm(direction["A"]) / np.linalg.norm(direction["B"])
    assert result["per_kind"]["B"]["different_kind_same_language"] == pytest.approx(1 - cos, abs=1e-6)


def test_load_refuses_missing_or_mismatched_files(tmp_path):
    with pytest.raises(CheckpointError, match="cannot be read.*experiments/train_code_encoder.py"):
        NodeEncoder.load(str(tmp_path))
    shutil.copy(os.path.join(ASSET_DIR, WEIGHTS_NAME), tmp_path / WEIGHTS_NAME)
    (tmp_path / CONFIG_NAME).write_text('{"features": 1024, "hidden": 64, "dim": 64}')
    with pytest.raises(CheckpointError, match=r"hidden.kernel is \(1024, 128\), expected \(1024, 64\)"):
        NodeEncoder.load(str(tmp_path))


def test_config_validation():
    with pytest.raises(ConfigError, match="EncoderConfig.dim=0 must be a positive int"):
        EncoderConfig(dim=0)
