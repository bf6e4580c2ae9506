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
_CONTINUES = b" \t)]}"  # a line starting with one of these continues the block above it


def definition_starts(data: bytes, language: str, max_depth: int = 0) -> list[int]:
    """Sorted byte offsets of `data` at which a function or class definition begins (its decorators
    included, from the start of its line): those inside no other definition (top-level, or under a
    module-level `if` / `try`), and with `max_depth` >= 1 those inside up to that many (1: the
    methods of a top-level class, functions nested in a top-level function). ConfigError for an
    unknown language.

    Two readings, united: the whole text parsed at once (definitions anywhere tree-sitter's recovery
    keeps them), and each top-level block parsed on its own, a block being a line at column 0 with
    the indented, blank or closing-bracket lines after it (decorator lines join the block below).
    The second keeps one broken stretch (a file cut mid-string, a question in prose) from hiding
    every definition after it."""
    spec = language_spec(language)
    data = bytes(data)
    parser = tree_sitter.Parser(grammar(spec))
    starts = set(_starts_in(parser, spec, data, 0, max_depth))
    for begin, end in _blocks(data):
        starts.update(_starts_in(parser, spec, data[begin:end], begin, max_depth))
    return sorted(starts)


def _starts_in(parser, spec, data: bytes, offset: int, max_depth: int):
    tree = parser.parse(data)
    enclosing: list[int] = []  # end bytes of the definitions around the current node (pre-order walk)
    for node, ts_node in walk_normalized(ParsedSource(spec=spec, data=data, tree=tree)):
        while enclosing and enclosing[-1] <= node.start_byte:
            enclosing.pop()
        if node.kind not in DEFINITIONS:
            continue
        nested = len(enclosing)  # definitions around this one (an `if` or `try` around it does not count)
        enclosing.append(node.end_byte)
        if nested > max_depth:
            continue
        if ts_node.parent is not None and ts_node.parent.type == "decorated_definition":
            ts_node = ts_node.parent  # Python: the decorators belong to the definition
        start = ts_node.start_byte
        line = data.rfind(b"\n", 0, start) + 1
        if not data[line:start].strip():  # only indentation before it: the page starts with the line
            start = line
        yield offset + start


def _blocks(data: bytes):
    """(begin, end) byte spans of the top-level blocks of `data` (see `definition_starts`)."""
    begin, pos, decorated = 0, 0, False
    while pos < len(data):
        nl = data.find(b"\n", pos)
        end = len(data) if nl < 0 else nl + 1
        line = data[pos:end]
        top = line.strip() != b"" and line[:1] not in _CONTINUES and not line.startswith(b"\n")
        if top and pos > begin and not decorated:
            yield begin, pos
            begin = pos
        if top:
            decorated = line.startswith(b"@")
        pos = end
    if begin < len(data):
        yield begin, len(data)
