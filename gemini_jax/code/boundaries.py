"""Where top-level definitions begin: the page boundaries of syntax-aligned KV pages (`cache.align`).

Unlike `normalized_nodes`, this reads any text, not only source that parses: a long-context prompt is
files laid end to end with prose and a question around them. tree-sitter recovers from what it cannot
parse; the definitions it still recognizes at the top level are the boundaries, the rest is skipped.
The answer is a function of the bytes alone, so equal prompts get equal layouts (and share pages).
"""

from __future__ import annotations

import tree_sitter

from gemini_jax.code.languages import language_spec
from gemini_jax.code.nodes import ParsedSource, grammar, walk_normalized

DEFINITIONS = ("FunctionDecl", "ClassDecl")


def definition_starts(data: bytes, language: str) -> list[int]:
    """Sorted byte offsets of `data` at which a top-level function or class definition begins (its
    decorators included, from the start of its line). ConfigError for an unknown language."""
    spec = language_spec(language)
    tree = tree_sitter.Parser(grammar(spec)).parse(bytes(data))
    starts = set()
    for node, ts_node in walk_normalized(ParsedSource(spec=spec, data=bytes(data), tree=tree)):
        if node.depth != 0 or node.kind not in DEFINITIONS:
            continue
        if ts_node.parent is not None and ts_node.parent.type == "decorated_definition":
            ts_node = ts_node.parent  # Python: the decorators belong to the definition
        start = ts_node.start_byte
        line = data.rfind(b"\n", 0, start) + 1
        if not data[line:start].strip():  # only indentation before it: the page starts with the line
            start = line
        starts.add(start)
    return sorted(starts)
