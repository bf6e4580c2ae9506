"""Source code as syntax: tree-sitter parse trees normalized to one vocabulary of node kinds shared by
every supported language.

Exports `normalized_nodes(source, language) -> list[Node]`, `Node`, the vocabulary `NODE_KINDS`,
the per-language tables `LANGUAGES` (name -> `LanguageSpec`) and `language_spec` (name or alias ->
spec). Parsing needs the `code` extra: pip install 'gemini_jax[code]'.

Not imported here (they load jax): `gemini_jax.code.encoder.NodeEncoder`, a small trained encoder with
one vector per node; its features (`features`), training programs (`synthetic`) and evaluation
(`dataset`).
"""

from gemini_jax.code.languages import LANGUAGES, NODE_KINDS, LanguageSpec, language_spec
from gemini_jax.code.nodes import Node, normalized_nodes

__all__ = ["LANGUAGES", "NODE_KINDS", "LanguageSpec", "Node", "language_spec", "normalized_nodes"]
