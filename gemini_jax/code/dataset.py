"""Labelled nodes, from synthetic programs (gemini_jax.code.synthetic) or from real source files, and
the distance table the node encoder is judged by.

A synthetic node carries the template instance that wrote it (`template`, "" for nodes no instance
claims: blocks, operators, literals, and constructs nested inside another template's text), so an
evaluation can keep the nodes of templates the encoder never trained on apart from the rest.
"""

from __future__ import annotations

import dataclasses
import itertools
import os
import random
from collections.abc import Sequence

import numpy as np

from gemini_jax.code import features, synthetic
from gemini_jax.code.languages import LANGUAGES
from gemini_jax.code.nodes import Node, ParsedSource, parse_source, walk_normalized
from gemini_jax.errors import SourceError


@dataclasses.dataclass(frozen=True)
class NodeDataset:
    """Nodes of many programs: features f32[n, size], and per row its kind, language, the template
    instance that wrote it and whether that template is held out of training."""

    x: np.ndarray
    kinds: np.ndarray      # str[n]
    languages: np.ndarray  # str[n]
    templates: np.ndarray  # str[n]: str(TemplateId), "" when no template instance claims the node
    heldout: np.ndarray    # bool[n]: the node's template is a held-out one

    def __len__(self) -> int:
        return len(self.kinds)

    def subset(self, rows: np.ndarray) -> NodeDataset:
        """The rows selected by `rows` (a bool mask or indices)."""
        return NodeDataset(self.x[rows], self.kinds[rows], self.languages[rows], self.templates[rows],
                           self.heldout[rows])

    @staticmethod
    def concatenate(parts: Sequence[NodeDataset]) -> NodeDataset:
        return NodeDataset(*(np.concatenate([getattr(p, f.name) for p in parts])
                             for f in dataclasses.fields(NodeDataset)))


def claim_nodes(nodes: Sequence[Node], instances: Sequence[synthetic.Instance]) -> list[synthetic.TemplateId | None]:
    """Which template instance wrote each node: an instance claims the first node (in document order,
    so the outermost) of its construct's kind that starts inside its span and no earlier instance
    claimed. (Starts, not whole spans: a node may take the line break after its text, as C's
    `#include` does.) Instances come outermost first (`LabelledProgram.instances`); a node no
    instance claims gets None."""
    owner: list[synthetic.TemplateId | None] = [None] * len(nodes)
    for instance in instances:
        kind = synthetic.CONSTRUCT_KINDS[instance.template.construct]
        for row, node in enumerate(nodes):
            if (owner[row] is None and node.kind == kind
                    and instance.start_byte <= node.start_byte < instance.end_byte):
                owner[row] = instance.template
                break
    return owner


def _rows(parsed: ParsedSource, size: int) -> tuple[list[Node], np.ndarray]:
    pairs = list(walk_normalized(parsed))
    return [node for node, _ in pairs], features.hashed_features([syntax for _, syntax in pairs], parsed.data, size)


def node_dataset(seeds, size: int, *, heldout: frozenset[synthetic.TemplateId] = frozenset(),
                 draw: synthetic.Draw = "all", languages=tuple(LANGUAGES)) -> NodeDataset:
    """The hashed features (`size` buckets) of every normalized node of `synthetic.labelled_program(
    language, seed, heldout=heldout, draw=draw)` for each language and seed, with the template each
    node came from."""
    parts = []
    for language, seed in itertools.product(languages, seeds):
        labelled = synthetic.labelled_program(language, seed, heldout=heldout, draw=draw)
        nodes, x = _rows(parse_source(labelled.source, language), size)
        owner = claim_nodes(nodes, labelled.instances)
        parts.append(NodeDataset(x, np.array([node.kind for node in nodes], str),
                                 np.array([language] * len(nodes), str),
                                 np.array([str(t) if t else "" for t in owner], str),
                                 np.array([t is not None and t in heldout for t in owner], bool)))
    return NodeDataset.concatenate(parts)


_INSTALLED = ("site-packages", "dist-packages")  # third-party code installed under a standard library


def source_files(roots: Sequence[str], suffix: str, language: str, count: int, seed: int, *,
                 max_bytes: int = 1 << 18) -> tuple[list[str], int]:
    """Up to `count` files under `roots` (not in installed packages below them) whose names end in
    `suffix` and that parse as `language` without error; and how many were tried and skipped on the
    way (parse errors, binary, over `max_bytes`). Roots are taken in order, each one's files in a
    seeded shuffle of its sorted listing, so a later root only fills what an earlier one lacks.
    Missing roots are skipped."""
    ordered = []
    for number, root in enumerate(roots):
        paths = set()
        for top, dirs, names in os.walk(root):
            dirs[:] = [name for name in dirs if name not in _INSTALLED]
            paths.update(os.path.join(top, name) for name in names if name.endswith(suffix))
        listing = sorted(paths - set(ordered))
        random.Random(f"{language}:{seed}:{number}").shuffle(listing)
        ordered += listing
    kept, skipped = [], 0
    for path in ordered:
        if len(kept) == count:
            break
        try:
            with open(path, "rb") as fh:
                parse_source(fh.read(), language, max_bytes=max_bytes)
            kept.append(path)
        except (OSError, SourceError):
            skipped += 1
    return kept, skipped


def file_dataset(paths: Sequence[str], language: str, size: int, *, max_nodes_per_kind: int | None = None,
                 seed: int = 0) -> NodeDataset:
    """The nodes of source files in `language` (none claimed by a template), at most
    `max_nodes_per_kind` of each kind (a seeded sample) so that a huge file does not dominate the time."""
    parts = []
    for path in paths:
        with open(path, "rb") as fh:
            nodes, x = _rows(parse_source(fh.read(), language), size)
        parts.append(NodeDataset(x, np.array([node.kind for node in nodes], str),
                                 np.array([language] * len(nodes), str), np.array([""] * len(nodes), str),
                                 np.zeros(len(nodes), bool)))
    data = NodeDataset.concatenate(parts)
    if max_nodes_per_kind is None:
        return data
    rng = np.random.default_rng(seed)
    keep = np.concatenate([rng.permutation(np.flatnonzero(data.kinds == kind))[:max_nodes_per_kind]
                           for kind in np.unique(data.kinds)])
    return data.subset(np.sort(keep))


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
