"""The shipped node encoder (gemini_jax.code.encoder): it loads, embeds every normalized node as a
unit vector, deterministically, and on programs it did not train on (new seeds, and templates held
out of training) puts one kind's nodes of different languages closer together than different kinds'
nodes of one language. Also the synthetic programs it trains on: every template parses and can be
traced to the node it wrote, and training draws never use a held-out template."""

from __future__ import annotations

import collections
import json
import os
import shutil

import numpy as np
import pytest

from gemini_jax.code import normalized_nodes, synthetic
from gemini_jax.code.dataset import claim_nodes, kind_distances, node_dataset
from gemini_jax.code.encoder import ASSET_DIR, CONFIG_NAME, WEIGHTS_NAME, EncoderConfig, NodeEncoder
from gemini_jax.code.nodes import parse_source, walk_normalized
from gemini_jax.errors import CheckpointError, ConfigError
from gemini_jax.testing import float_tolerance

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
RECORD = os.path.join(ROOT, "experiments", "results", "code", "node_distances.json")
with open(os.path.join(ASSET_DIR, CONFIG_NAME)) as _fh:
    TRAINING = json.load(_fh)["training"]  # the seeds and held-out rule the shipped weights were trained with
TRAIN_SEEDS, HELDOUT_SEEDS = range(*TRAINING["train_seeds"]), range(*TRAINING["heldout_seeds"])
HELDOUT = synthetic.heldout_templates(TRAINING["heldout_template_seed"])
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
    # Normalized, then measured again: two float32 sums of `dim` squares.
    tol = float_tolerance(depth=2, terms=encoder.config.dim, magnitude=1.0)
    np.testing.assert_allclose(np.linalg.norm(vectors, axis=1), 1.0, rtol=0, atol=tol, err_msg=f"{language}, seed={SEED}")


def test_embedding_is_deterministic(encoder):
    source = synthetic.program("go", SEED)
    _, first = encoder.embed(source, "go")
    _, again = NodeEncoder.load().embed(source.encode("utf-8"), "go")
    np.testing.assert_array_equal(first, again, err_msg=f"go, seed={SEED}")


def test_every_template_parses_and_claims_its_node():
    """Over a few seeds of both draws every template is used; every program parses; every instance
    claims a node of its construct's kind."""
    used, unclaimed = set(), collections.Counter()
    for language in synthetic.TEMPLATES:
        for draw in ("seen", "heldout"):
            for seed in range(SEED, SEED + 20):
                labelled = synthetic.labelled_program(language, seed, heldout=HELDOUT, draw=draw)
                nodes = [node for node, _ in walk_normalized(parse_source(labelled.source, language))]
                claimed = collections.Counter(claim_nodes(nodes, labelled.instances))
                for template, count in collections.Counter(i.template for i in labelled.instances).items():
                    used.add(template)
                    unclaimed[str(template)] += max(0, count - claimed[template])
    everything = {t for language in synthetic.TEMPLATES for t in synthetic.all_templates(language)}
    assert not everything - used, sorted(map(str, everything - used))
    assert not +unclaimed, dict(+unclaimed)


def test_heldout_rule_keeps_one_template_of_each_construct_out():
    per_construct = collections.Counter((t.language, t.construct) for t in HELDOUT)
    assert set(per_construct.values()) == {1}
    for language in synthetic.TEMPLATES:
        for construct in synthetic.CONSTRUCT_KINDS:
            count = len(getattr(synthetic.TEMPLATES[language], construct))
            assert per_construct[language, construct] == (count >= 2), (language, construct, count)
    assert synthetic.heldout_templates(TRAINING["heldout_template_seed"]) == HELDOUT  # a rule, not a draw
    assert synthetic.heldout_templates(TRAINING["heldout_template_seed"] + 1) != HELDOUT


def test_training_programs_hold_no_heldout_template():
    assert not set(TRAIN_SEEDS) & set(HELDOUT_SEEDS)
    for language in synthetic.TEMPLATES:
        for seed in TRAIN_SEEDS[:5]:
            labelled = synthetic.labelled_program(language, seed, heldout=HELDOUT, draw="seen")
            assert not {i.template for i in labelled.instances} & HELDOUT, f"{language}, seed={seed}"


def _margins(encoder, data):
    distances = kind_distances(encoder(data.x), data.kinds, data.languages)
    raw = kind_distances(data.x, data.kinds, data.languages)
    return distances, raw


@pytest.mark.parametrize("draw", ["seen", "heldout"])
def test_same_kind_across_languages_is_closer_than_other_kinds_within_one(encoder, draw):
    """On held-out seeds, for the training templates ("seen") and for the held-out ones: the nodes
    the templates wrote."""
    seeds = HELDOUT_SEEDS[:3]
    data = node_dataset(seeds, encoder.config.features, heldout=HELDOUT, draw=draw)
    data = data.subset(data.heldout if draw == "heldout" else data.templates != "")
    assert data.heldout.all() if draw == "heldout" else not data.heldout.any()
    distances, raw = _margins(encoder, data)
    assert len(distances["per_kind"]) >= 8 and len(set(data.languages.tolist())) >= 10
    assert distances["same_kind_cross_language"] < distances["different_kind_same_language"], distances
    for kind, row in distances["per_kind"].items():
        assert row["same_kind_cross_language"] < row["different_kind_same_language"], (
            f"{draw} templates, held-out seeds {list(seeds)}: {kind} {row}")
    # The trained encoder separates kinds better than its input features do.
    margin = distances["different_kind_same_language"] - distances["same_kind_cross_language"]
    assert margin > raw["different_kind_same_language"] - raw["same_kind_cross_language"], (distances, raw)


def test_record_reports_seen_and_heldout_templates_and_real_code():
    with open(RECORD) as fh:
        record = json.load(fh)
    # The table and the shipped weights come from one run.
    for key in ("train_seeds", "heldout_seeds", "heldout_template_seed", "steps"):
        assert record[key] == TRAINING[key], key
    assert record["heldout_templates"] == sorted(map(str, HELDOUT))
    for evaluation in ("seen_templates", "heldout_templates", "real_code"):
        row = record["summary"][evaluation]
        for source in ("encoder", "features"):
            assert 0 <= row[f"{source}_same_kind_cross_language"] <= 2 and row["nodes"] > 0, (evaluation, row)
        kinds = [r for r in record["records"] if r["evaluation"] == evaluation]
        assert len(kinds) == row["kinds"] > 0, evaluation
        np.testing.assert_allclose(np.mean([r["encoder_same_kind_cross_language"] for r in kinds]),
                                   row["encoder_same_kind_cross_language"], err_msg=evaluation)


def test_kind_distances_on_planted_vectors():
    rng = np.random.default_rng(SEED)
    kinds = np.array(["A", "A", "B", "B", "A", "B"])
    languages = np.array(["x", "y", "x", "y", "x", "x"])
    direction = {"A": rng.normal(size=8), "B": rng.normal(size=8)}
    vectors = np.stack([direction[k] for k in kinds])
    result = kind_distances(vectors, kinds, languages)
    # float64 throughout: normalize, average, dot, 1 - cos (at most 2), each over at most 8 terms.
    tol = float_tolerance(dtype="float64", depth=4, terms=8, magnitude=2.0)
    assert result["per_kind"]["A"]["same_kind_cross_language"] == pytest.approx(0.0, abs=tol), f"seed={SEED}"
    cos = direction["A"] @ direction["B"] / np.linalg.norm(direction["A"]) / np.linalg.norm(direction["B"])
    assert result["per_kind"]["B"]["different_kind_same_language"] == pytest.approx(1 - cos, abs=tol), f"seed={SEED}"


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
