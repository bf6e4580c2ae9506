"""Normalized syntax nodes (gemini_jax.code): one program written in every supported language maps
to the same kinds, spans slice back to the construct, every table names types its grammar really
has, and bad input raises the typed errors."""

from __future__ import annotations

import random

import pytest

from gemini_jax.code import LANGUAGES, NODE_KINDS, Node, language_spec, normalized_nodes
from gemini_jax.code.nodes import grammar, parse_source, walk_normalized
from gemini_jax.errors import ConfigError, SourceError

SEED = 20250
CORE_KINDS = ("FunctionDecl", "ClassDecl", "IfStmt", "ForStmt", "WhileStmt", "ReturnStmt", "CallExpr", "Assignment")
# Constructs a language does not have at all (Lua has tables and metatables, no type declarations).
LANGUAGE_LACKS = {"lua": {"ClassDecl"}}

# The same program in each language: a type holding a function whose for loop holds an if, then a
# while loop, a call and a return. @FN@, @ACC@, @LOG@, @TYPE@ and @LIM@ are replaced by random
# identifiers and a random number; @TEXT@ by a non-ASCII string, so byte and character offsets differ.
PROGRAMS = {
    "python": '''
note = "@TEXT@"
class @TYPE@:
    def @FN@(self, items):
        @ACC@ = 0
        for item in items:
            if item > @LIM@:
                @ACC@ = @ACC@ + item
        while @ACC@ > 99:
            @ACC@ = @ACC@ - @LIM@
        @LOG@(@ACC@)
        return @ACC@
''',
    "javascript": '''
const note = "@TEXT@";
class @TYPE@ {
  @FN@(items) {
    let @ACC@ = 0;
    for (const item of items) {
      if (item > @LIM@) { @ACC@ = @ACC@ + item; }
    }
    while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
    @LOG@(@ACC@);
    return @ACC@;
  }
}
''',
    "typescript": '''
const note: string = "@TEXT@";
class @TYPE@ {
  @FN@(items: number[]): number {
    let @ACC@: number = 0;
    for (const item of items) {
      if (item > @LIM@) { @ACC@ = @ACC@ + item; }
    }
    while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
    @LOG@(@ACC@);
    return @ACC@;
  }
}
''',
    "go": '''
package main

var note = "@TEXT@"

type @TYPE@ struct{ n int }

func @FN@(items []int) int {
	@ACC@ := 0
	for _, item := range items {
		if item > @LIM@ {
			@ACC@ = @ACC@ + item
		}
	}
	for @ACC@ > 99 {
		@ACC@ = @ACC@ - @LIM@
	}
	@LOG@(@ACC@)
	return @ACC@
}
''',
    "rust": '''
const NOTE: &str = "@TEXT@";
struct @TYPE@ { n: i32 }
impl @TYPE@ {
    fn @FN@(&self, items: &[i32]) -> i32 {
        let mut @ACC@ = 0;
        for item in items {
            if *item > @LIM@ { @ACC@ = @ACC@ + item; }
        }
        while @ACC@ > 99 { @ACC@ = @ACC@ - @LIM@; }
        @LOG@(@ACC@);
        return @ACC@;
    }
}
''',
    "c": '''
const char *note = "@TEXT@";
struct @TYPE@ { int n; };
int @FN@(const int *items, int count) {
    int @ACC@ = 0;
    for (int i = 0; i < count; i++) {
        if (items[i] > @LIM@) { @ACC@ = @ACC@ + items[i]; }
    }
    while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
    @LOG@(@ACC@);
    return @ACC@;
}
''',
    "cpp": '''
const char *note = "@TEXT@";
class @TYPE@ {
 public:
  int @FN@(const std::vector<int>& items) {
    int @ACC@ = 0;
    for (int item : items) {
      if (item > @LIM@) { @ACC@ = @ACC@ + item; }
    }
    while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
    @LOG@(@ACC@);
    return @ACC@;
  }
};
''',
    "java": '''
class @TYPE@ {
    String note = "@TEXT@";
    int @FN@(int[] items) {
        int @ACC@ = 0;
        for (int item : items) {
            if (item > @LIM@) { @ACC@ = @ACC@ + item; }
        }
        while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
        @LOG@(@ACC@);
        return @ACC@;
    }
}
''',
    "csharp": '''
class @TYPE@ {
    string note = "@TEXT@";
    int @FN@(int[] items) {
        int @ACC@ = 0;
        foreach (var item in items) {
            if (item > @LIM@) { @ACC@ = @ACC@ + item; }
        }
        while (@ACC@ > 99) { @ACC@ = @ACC@ - @LIM@; }
        @LOG@(@ACC@);
        return @ACC@;
    }
}
''',
    "ruby": '''
NOTE = "@TEXT@"
class @TYPE@
  def @FN@(items)
    @ACC@ = 0
    for item in items
      if item > @LIM@
        @ACC@ = @ACC@ + item
      end
    end
    while @ACC@ > 99
      @ACC@ = @ACC@ - @LIM@
    end
    @LOG@(@ACC@)
    return @ACC@
  end
end
''',
    "lua": '''
local note = "@TEXT@"
function @FN@(items)
  local @ACC@ = 0
  for i = 1, #items do
    if items[i] > @LIM@ then @ACC@ = @ACC@ + items[i] end
  end
  while @ACC@ > 99 do @ACC@ = @ACC@ - @LIM@ end
  @LOG@(@ACC@)
  return @ACC@
end
''',
    "php": '''<?php
$note = "@TEXT@";
class @TYPE@ {
    function @FN@($items) {
        $@ACC@ = 0;
        foreach ($items as $item) {
            if ($item > @LIM@) { $@ACC@ = $@ACC@ + $item; }
        }
        while ($@ACC@ > 99) { $@ACC@ = $@ACC@ - @LIM@; }
        @LOG@($@ACC@);
        return $@ACC@;
    }
}
''',
    # Verilog has no statement-level call of a user function the grammar accepts; the call sits in
    # an assignment instead.
    "verilog": '''
module @TYPE@;
  string note = "@TEXT@";
  function automatic integer @FN@(input integer limit);
    integer @ACC@;
    integer i;
    begin
      @ACC@ = 0;
      for (i = 0; i < 8; i = i + 1)
        if (i > @LIM@) @ACC@ = @ACC@ + i;
      while (@ACC@ > 99) @ACC@ = @ACC@ - @LIM@;
      @ACC@ = @LOG@(@ACC@);
      return @ACC@;
    end
  endfunction
endmodule
''',
}

# What the first node of a kind starts with, per language (default: the keyword in COMMON_PREFIX).
COMMON_PREFIX = {"IfStmt": "if", "WhileStmt": "while", "ReturnStmt": "return", "CallExpr": "@LOG@(",
                 "Assignment": "@ACC@ ="}
PREFIX = {
    "python": {"FunctionDecl": "def @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "for item"},
    "javascript": {"FunctionDecl": "@FN@(items)", "ClassDecl": "class @TYPE@", "ForStmt": "for (const"},
    "typescript": {"FunctionDecl": "@FN@(items", "ClassDecl": "class @TYPE@", "ForStmt": "for (const"},
    "go": {"FunctionDecl": "func @FN@(", "ClassDecl": "type @TYPE@", "ForStmt": "for _, item",
           "WhileStmt": "for @ACC@ >"},
    "rust": {"FunctionDecl": "fn @FN@(", "ClassDecl": "struct @TYPE@", "ForStmt": "for item"},
    "c": {"FunctionDecl": "int @FN@(", "ClassDecl": "struct @TYPE@ {", "ForStmt": "for (int i"},
    "cpp": {"FunctionDecl": "int @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "for (int item"},
    "java": {"FunctionDecl": "int @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "for (int item"},
    "csharp": {"FunctionDecl": "int @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "foreach (var"},
    "ruby": {"FunctionDecl": "def @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "for item"},
    "lua": {"FunctionDecl": "function @FN@(", "ForStmt": "for i = 1"},
    "php": {"FunctionDecl": "function @FN@(", "ClassDecl": "class @TYPE@", "ForStmt": "foreach (",
            "Assignment": "$@ACC@ =", "CallExpr": "@LOG@($"},
    "verilog": {"FunctionDecl": "function automatic integer @FN@(", "ClassDecl": "module @TYPE@",
                "ForStmt": "for (i = 0"},
}


def _identifier(rng: random.Random, first: str) -> str:
    return first + "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 9)))


def _program(language: str, seed: int) -> tuple[str, dict[str, str]]:
    rng = random.Random(seed)
    names = {"@FN@": _identifier(rng, "f"), "@ACC@": _identifier(rng, "acc"), "@LOG@": _identifier(rng, "log"),
             "@TYPE@": _identifier(rng, "T"), "@LIM@": str(rng.randint(1, 50)),
             "@TEXT@": "".join(rng.choice("héllo wörld ✓ 数据") for _ in range(rng.randint(4, 12)))}
    text = PROGRAMS[language]
    for placeholder, value in names.items():
        text = text.replace(placeholder, value)
    return text, names


def _expand(template: str, names: dict[str, str]) -> str:
    for placeholder, value in names.items():
        template = template.replace(placeholder, value)
    return template


def _text(data: bytes, node: Node) -> str:
    return data[node.start_byte:node.end_byte].decode("utf-8")


def _encloses(outer: Node, inner: Node) -> bool:
    return outer.start_byte <= inner.start_byte and inner.end_byte <= outer.end_byte and outer.depth < inner.depth


def test_every_language_has_a_program():
    assert set(PROGRAMS) == set(LANGUAGES) == set(PREFIX)
    assert len(LANGUAGES) >= 10


@pytest.mark.parametrize("language", sorted(LANGUAGES))
@pytest.mark.parametrize("offset", [0, 1])
def test_the_same_program_maps_to_the_same_kinds(language, offset):
    seed = SEED + offset
    source, names = _program(language, seed)
    data = source.encode("utf-8")
    nodes = normalized_nodes(source, language)
    where = f"{language}, seed={seed}"
    kinds = {node.kind for node in nodes}
    missing = set(CORE_KINDS) - LANGUAGE_LACKS.get(language, set()) - kinds
    assert not missing, f"{where}: no {sorted(missing)} among {sorted(kinds)}"
    assert not kinds - set(NODE_KINDS), where

    # The first node of each kind; inside the function for all but the declarations themselves.
    function = next(node for node in nodes if node.kind == "FunctionDecl")
    first = {}
    for node in nodes:
        if node.kind in ("FunctionDecl", "ClassDecl") or _encloses(function, node):
            first.setdefault(node.kind, node)
    for kind, prefix in {**COMMON_PREFIX, **PREFIX[language]}.items():
        if kind in LANGUAGE_LACKS.get(language, set()):
            continue
        expected = _expand(prefix, names)
        assert _text(data, first[kind]).startswith(expected), (
            f"{where}: first {kind} is {_text(data, first[kind])[:60]!r}, expected it to start with {expected!r}")

    # The nesting is the program's: the if lies in the for, which lies in the function; the return too.
    loop, branch, ret = (first[kind] for kind in ("ForStmt", "IfStmt", "ReturnStmt"))
    assert _encloses(function, loop) and _encloses(loop, branch) and _encloses(function, ret), (
        f"{where}: {function} / {loop} / {branch} / {ret}")
    if language not in ("go", "c", "lua"):  # there the function sits beside the type, not in it
        assert any(node.kind == "ClassDecl" and _encloses(node, function) for node in nodes), f"{where}: {nodes}"
    # The non-ASCII text precedes the function, so a character offset would slice the wrong text.
    assert len(data) != len(source), where


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_depth_counts_enclosing_nodes_and_order_is_document_order(language):
    source, _ = _program(language, SEED + 7)
    nodes = normalized_nodes(source.encode("utf-8"), language)
    open_nodes: list[Node] = []
    for previous, node in zip([None, *nodes], nodes):
        if previous is not None:
            assert (previous.start_byte, -previous.end_byte) <= (node.start_byte, -node.end_byte), (language, node)
        while open_nodes and open_nodes[-1].end_byte <= node.start_byte and open_nodes[-1].end_byte < node.end_byte:
            open_nodes.pop()
        assert node.depth == len(open_nodes), f"{language}: {node} inside {open_nodes}"
        assert all(outer.start_byte <= node.start_byte and node.end_byte <= outer.end_byte for outer in open_nodes)
        open_nodes.append(node)


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_tables_name_only_types_the_grammar_has(language):
    spec = LANGUAGES[language]
    lang = grammar(spec)
    missing = [node_type for node_type in spec.kinds if lang.id_for_node_kind(node_type, True) is None]
    for node_type, child_type, _ in spec.by_child:
        if lang.id_for_node_kind(node_type, True) is None:
            missing.append(node_type)
        if lang.id_for_node_kind(child_type, True) is None and lang.id_for_node_kind(child_type, False) is None:
            missing.append(child_type)
    assert not missing, f"{language}: the grammar has no node types {missing}"
    lacks = set(CORE_KINDS) - set(spec.kinds.values()) - {kind for _, _, kind in spec.by_child}
    assert lacks == LANGUAGE_LACKS.get(language, set()), f"{language}: the table maps none of {sorted(lacks)}"


def test_every_kind_is_produced_somewhere():
    produced = {kind for spec in LANGUAGES.values() for kind in (*spec.kinds.values(), *(k for *_, k in spec.by_child))}
    assert produced == set(NODE_KINDS)


def test_refinement_by_child():
    go = "package p\nfunc f() {\n\tfor i := 0; i < 3; i++ {\n\t}\n\tfor x > 1 {\n\t}\n\tfor {\n\t}\n}\n"
    assert [n.kind for n in normalized_nodes(go, "go") if n.kind.endswith("Stmt")] == ["ForStmt", "WhileStmt",
                                                                                         "WhileStmt"]
    c = "struct s { int n; };\nvoid g(struct s *p);\nint x = 1;\n"
    assert [n.kind for n in normalized_nodes(c, "c") if n.depth == 0] == ["ClassDecl", "FunctionDecl", "VarDecl"]


def test_aliases_and_case():
    assert language_spec("C++") is LANGUAGES["cpp"]
    assert language_spec(" TS ") is LANGUAGES["typescript"]
    assert language_spec("c#") is LANGUAGES["csharp"]


def test_walk_normalized_pairs_each_node_with_its_syntax_node():
    source, _ = _program("python", SEED + 3)
    parsed = parse_source(source, "python")
    for node, syntax in walk_normalized(parsed):
        assert (node.start_byte, node.end_byte) == (syntax.start_byte, syntax.end_byte)
        assert parsed.spec.kinds.get(syntax.type) == node.kind or syntax.type in {t for t, *_ in parsed.spec.by_child}


def test_unknown_language():
    with pytest.raises(ConfigError, match=r"language='cobol' is not supported; choose one of \[.*'python'.*\]"):
        normalized_nodes("MOVE 1 TO X.", "cobol")


@pytest.mark.parametrize("language", ["python", "rust", "verilog"])
def test_binary_input(language):
    rng = random.Random(SEED)
    payload = bytes(rng.randrange(256) for _ in range(64))
    with pytest.raises(SourceError, match=rf"{language} source holds a NUL byte at offset 3.*skip the file"):
        normalized_nodes(b"abc\x00" + payload, language)
    with pytest.raises(SourceError, match=rf"{language} source is not valid UTF-8 \(byte 2\).*looks binary"):
        normalized_nodes(b"ab\xff\xfe" + payload.replace(b"\x00", b"\x01"), language)
    with pytest.raises(SourceError, match=rf"{language} source holds a NUL byte"):
        normalized_nodes("x = 1\x00", language)
    with pytest.raises(SourceError, match=rf"{language} source holds a character UTF-8 cannot encode at index 5"):
        normalized_nodes("x = '\ud800'", language)


def test_too_large():
    source, _ = _program("java", SEED)
    size = len(source.encode("utf-8"))
    assert normalized_nodes(source, "java", max_bytes=size)  # the limit itself is allowed
    with pytest.raises(SourceError, match=rf"java source is {size} bytes, over max_bytes={size - 1}: split the file"):
        normalized_nodes(source, "java", max_bytes=size - 1)
    with pytest.raises(ConfigError, match="max_bytes=0 must be positive"):
        normalized_nodes(source, "java", max_bytes=0)


@pytest.mark.parametrize("language", sorted(LANGUAGES))
def test_unparsable(language):
    source, _ = _program(language, SEED)
    lines = source.split("\n")
    cut = len(lines) // 2
    # A stray closing bracket run in the middle of the function body parses in no grammar here.
    broken = "\n".join([*lines[:cut], ") ] } ) ] }", *lines[cut:]])
    with pytest.raises(SourceError, match=rf"{language} source does not parse: .* at line \d+, column \d+\. "
                                          rf"Check that language='{language}' is right"):
        normalized_nodes(broken, language)
