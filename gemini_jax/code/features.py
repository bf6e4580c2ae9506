"""What the node encoder sees of a node: a hashed bag of its syntax and its first tokens, never its
normalized kind.

Features of one node (each a string, hashed with CRC-32 into `size` buckets, a stable hash so that
shipped weights keep their meaning across processes):

- its tree-sitter type and the words of that type (`if_statement` -> `if`, `statement`), which
  languages share more often than whole type names;
- the types of its direct children, named and anonymous (keywords and punctuation: `if`, `(`, `{`);
- the named types two levels down;
- the first three tokens of its text (the keyword or name a construct starts with) and a few more.

Groups are weighted so each contributes about equally however many items it has; the vector is
L2-normalized.
"""

from __future__ import annotations

import re
import zlib

import numpy as np
import tree_sitter

_TOKEN = re.compile(rb"[A-Za-z_]+|[0-9]+|\S")
_FIRST_TOKENS = 3
_MORE_TOKENS = 12


def _words(node_type: str) -> list[str]:
    return [word for word in node_type.split("_") if word]


def feature_strings(node: tree_sitter.Node, data: bytes) -> list[tuple[str, float]]:
    """(feature, weight) pairs of one syntax node; `data` is the source the node indexes into."""
    out = [(f"type:{node.type}", 1.0)] + [(f"word:{word}", 1.0) for word in _words(node.type)]
    children = [child.type for child in node.children]
    out += [(f"child:{t}", 1.0 / np.sqrt(len(children))) for t in children]
    grandchildren = [grand.type for child in node.named_children for grand in child.named_children]
    out += [(f"grand:{t}", 0.5 / np.sqrt(len(grandchildren))) for t in grandchildren]
    # Tokens from the first line only: a long construct's later lines are its contents, not it.
    head = data[node.start_byte:node.end_byte].split(b"\n", 1)[0]
    tokens = [token.decode("utf-8", "replace").lower() for token in _TOKEN.findall(head)]
    out += [(f"first{i}:{token}", 1.0) for i, token in enumerate(tokens[:_FIRST_TOKENS])]
    rest = tokens[_FIRST_TOKENS:_FIRST_TOKENS + _MORE_TOKENS]
    out += [(f"token:{token}", 0.5 / np.sqrt(len(rest))) for token in rest]
    return out


def hashed_features(nodes: list[tree_sitter.Node], data: bytes, size: int) -> np.ndarray:
    """The [len(nodes), size] float32 feature matrix, rows L2-normalized."""
    matrix = np.zeros((len(nodes), size), np.float32)
    for row, node in enumerate(nodes):
        for feature, weight in feature_strings(node, data):
            matrix[row, zlib.crc32(feature.encode("utf-8")) % size] += weight
    norms = np.linalg.norm(matrix, axis=1, keepdims=True)
    return matrix / np.maximum(norms, 1e-12)
