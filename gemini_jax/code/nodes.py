"""Source code -> normalized syntax nodes: parse with tree-sitter, keep the node types a language's table
maps (gemini_jax.code.languages), and name them in the one vocabulary every language shares.

`depth` counts normalized ancestors, not tree-sitter ones: grammars wrap the same construct in
different numbers of helper nodes (Python's `expression_statement`, Verilog's `statement_or_null ->
statement -> statement_item`), so tree depth would differ across languages for the same program while
the normalized depth does not. A top-level node has depth 0.
"""

from __future__ import annotations

import dataclasses
import functools
import importlib
from collections.abc import Iterator

import tree_sitter

from gemini_jax.code.languages import LanguageSpec, language_spec
from gemini_jax.errors import ConfigError, SourceError

DEFAULT_MAX_BYTES = 1 << 20  # 1 MiB: past this a file is almost surely generated or data, not code


@dataclasses.dataclass(frozen=True)
class Node:
    """One normalized node: its kind (from NODE_KINDS), its UTF-8 byte span `[start_byte, end_byte)`
    in the source, and the number of normalized nodes that enclose it."""

    kind: str
    start_byte: int
    end_byte: int
    depth: int


@dataclasses.dataclass(frozen=True)
class ParsedSource:
    """A parsed file: its spec, its UTF-8 bytes and the tree-sitter tree (nodes index into `data`)."""

    spec: LanguageSpec
    data: bytes
    tree: tree_sitter.Tree


@functools.cache
def grammar(spec: LanguageSpec) -> tree_sitter.Language:
    """The tree-sitter grammar of `spec`, loaded once.

    Raises ConfigError when the grammar package is not installed.
    """
    try:
        module = importlib.import_module(spec.module)
    except ImportError as exc:
        raise ConfigError(f"language={spec.name!r} needs the {spec.distribution} package, which is not "
                          f"installed: pip install 'gemini_jax[code]'.") from exc
    return tree_sitter.Language(getattr(module, spec.entry)())


def _as_utf8(source: str | bytes, language: str) -> bytes:
    if isinstance(source, str):
        try:
            data = source.encode("utf-8")
        except UnicodeEncodeError as exc:
            raise SourceError(f"{language} source holds a character UTF-8 cannot encode at index {exc.start} "
                              f"(a lone surrogate?): pass text decoded from the file, or the file's bytes.") from exc
    elif isinstance(source, (bytes, bytearray, memoryview)):
        data = bytes(source)
    else:
        raise SourceError(f"{language} source must be str or bytes, got {type(source).__name__}.")
    # NUL first: it is the surer sign of a binary file, and text encodings other than UTF-8 lack it.
    nul = data.find(b"\x00")
    if nul >= 0:
        raise SourceError(f"{language} source holds a NUL byte at offset {nul}: it looks binary, not source "
                          f"code; skip the file.")
    try:
        data.decode("utf-8")
    except UnicodeDecodeError as exc:
        raise SourceError(f"{language} source is not valid UTF-8 (byte {exc.start}): it looks binary; "
                          f"pass source text, or decode it from its real encoding first.") from exc
    return data


def _first_error(root: tree_sitter.Node) -> tree_sitter.Node:
    """The first ERROR or MISSING node, in document order, under a root that has errors."""
    stack = [root]
    while stack:
        node = stack.pop()
        if node.is_error or node.is_missing:
            return node
        stack.extend(child for child in reversed(node.children) if child.has_error or child.is_missing)
    return root


def parse_source(source: str | bytes, language: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> ParsedSource:
    """Parse `source` as `language` (a name or alias of gemini_jax.code.languages.LANGUAGES).

    Raises ConfigError for an unknown language, a missing grammar package or max_bytes <= 0, and
    SourceError for binary input (NUL bytes, not UTF-8), input over `max_bytes` UTF-8 bytes, or
    source the grammar cannot parse (the message gives the line and column of the first error).
    """
    spec = language_spec(language)
    if max_bytes <= 0:
        raise ConfigError(f"max_bytes={max_bytes} must be positive.")
    data = _as_utf8(source, spec.name)
    if len(data) > max_bytes:
        raise SourceError(f"{spec.name} source is {len(data)} bytes, over max_bytes={max_bytes}: split the file, "
                          f"or pass a larger max_bytes if it really is hand-written code.")
    tree = tree_sitter.Parser(grammar(spec)).parse(data)
    if tree.root_node.has_error:
        bad = _first_error(tree.root_node)
        row, column = bad.start_point
        what = f"missing {bad.type!r}" if bad.is_missing else f"unexpected {data[bad.start_byte:bad.end_byte][:40]!r}"
        raise SourceError(f"{spec.name} source does not parse: {what} at line {row + 1}, column {column + 1}. "
                          f"Check that language={spec.name!r} is right for this file, or fix the source there.")
    return ParsedSource(spec=spec, data=data, tree=tree)


def _kind_of(node: tree_sitter.Node, spec: LanguageSpec) -> str | None:
    for node_type, child_type, kind in spec.by_child:
        if node.type == node_type and any(child.type == child_type for child in node.children):
            return kind
    return spec.kinds.get(node.type)


def walk_normalized(parsed: ParsedSource) -> Iterator[tuple[Node, tree_sitter.Node]]:
    """Each normalized node with the tree-sitter node it came from, in document order (pre-order: an
    enclosing node before the nodes inside it)."""
    # An explicit stack: generated code nests deeper than Python's recursion limit.
    stack: list[tuple[tree_sitter.Node, int]] = [(parsed.tree.root_node, 0)]
    while stack:
        node, depth = stack.pop()
        kind = _kind_of(node, parsed.spec)
        if kind is not None:
            yield Node(kind, node.start_byte, node.end_byte, depth), node
            depth += 1
        stack.extend((child, depth) for child in reversed(node.named_children))


def normalized_nodes(source: str | bytes, language: str, *, max_bytes: int = DEFAULT_MAX_BYTES) -> list[Node]:
    """The normalized syntax nodes of `source`, in document order.

    `source[start_byte:end_byte]` of each node (on the UTF-8 bytes) is the construct's text. Only node
    types that the language's table maps become nodes; see gemini_jax.code.languages.

    Raises ConfigError for an unknown language (the message lists the supported ones) and SourceError
    for binary, oversized or unparsable source (see `parse_source`).
    """
    return [node for node, _ in walk_normalized(parse_source(source, language, max_bytes=max_bytes))]
