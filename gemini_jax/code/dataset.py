"""Labelled nodes from synthetic programs (gemini_jax.code.synthetic), and the distance table the
node encoder is judged by.

Training draws programs from `TRAIN_SEEDS`, evaluation from `HELDOUT_SEEDS`; the two ranges are
disjoint, so every held-out program is one the encoder never saw.
"""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np

from gemini_jax.code import features, synthetic
from gemini_jax.code.languages import LANGUAGES
from gemini_jax.code.nodes import parse_source, walk_normalized

TRAIN_SEEDS = range(0, 48)
HELDOUT_SEEDS = range(100_000, 100_012)


@dataclasses.dataclass(frozen=True)
class NodeDataset:
    """Nodes of many programs: features f32[n, size], and per row its kind and language."""

    x: np.ndarray
    kinds: np.ndarray      # str[n]
    languages: np.ndarray  # str[n]


def node_dataset(seeds, size: int, languages=tuple(LANGUAGES)) -> NodeDataset:
    """The hashed features (`size` buckets) of every normalized node of `synthetic.program(language,
    seed)` for each language and seed."""
    xs, kinds, langs = [], [], []
    for language, seed in itertools.product(languages, seeds):
        parsed = parse_source(synthetic.program(language, seed), language)
        pairs = list(walk_normalized(parsed))
        xs.append(features.hashed_features([syntax for _, syntax in pairs], parsed.data, size))
        kinds += [node.kind for node, _ in pairs]
        langs += [language] * len(pairs)
    return NodeDataset(np.concatenate(xs), np.array(kinds), np.array(langs))


def kind_distances(vectors: np.ndarray, kinds: np.ndarray, languages: np.ndarray) -> dict:
    """Mean cosine distances (1 - cos) between groups of nodes, a group being one kind in one language.

    `same_kind_cross_language[k]`: mean over language pairs (l, l'), l != l', of the mean distance
    between kind-k nodes of l and of l'. `different_kind_same_language[k]`: mean over languages l and
    kinds k' != k of the mean distance between kind-k and kind-k' nodes of l. Each group pair counts
    once however many nodes it has, so frequent kinds (literals) do not drown rare ones (classes).
    Kinds found in one language only are left out. The overall figures average the kinds.
    """
    vectors = np.asarray(vectors, np.float64)  # numpy, not jax: hundreds of small masked means follow
    unit = vectors / np.maximum(np.linalg.norm(vectors, axis=1, keepdims=True), 1e-12)
    means = {}
    for kind, language in set(zip(kinds.tolist(), languages.tolist())):
        means[kind, language] = unit[(kinds == kind) & (languages == language)].mean(axis=0)
    # mean cos between two groups = dot of their mean vectors
    by_kind: dict[str, list[str]] = {}
    for kind, language in means:
        by_kind.setdefault(kind, []).append(language)
    per_kind = {}
    for kind in sorted(k for k, langs in by_kind.items() if len(langs) > 1):
        cross = [1 - means[kind, a] @ means[kind, b] for a, b in itertools.permutations(sorted(by_kind[kind]), 2)]
        within = [1 - means[kind, lang] @ means[other, lang] for lang in by_kind[kind]
                  for other in by_kind if other != kind and (other, lang) in means]
        per_kind[kind] = {"same_kind_cross_language": float(np.mean(cross)),
                          "different_kind_same_language": float(np.mean(within)),
                          "languages": len(by_kind[kind])}
    return {"same_kind_cross_language": float(np.mean([v["same_kind_cross_language"] for v in per_kind.values()])),
            "different_kind_same_language": float(np.mean([v["different_kind_same_language"]
                                                           for v in per_kind.values()])),
            "per_kind": per_kind}
