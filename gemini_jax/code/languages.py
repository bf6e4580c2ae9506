"""Which tree-sitter node types become which normalized node kinds, one table per language.

A `LanguageSpec` is pure data: the grammar package to load and two tables.

- `kinds` maps a tree-sitter node type to a kind of `NODE_KINDS`. Node types not in the table are
  structure the vocabulary does not name (parameter lists, expression statements, identifiers) and
  produce no node.
- `by_child` refines a type by one of its direct children, named or anonymous: `(type, child, kind)`
  says "a `type` node with a `child` child is a `kind`". Rules are tried in order, before `kinds`.
  They say what the type alone cannot: Go's single `for_statement` is a while loop unless it has a
  `for_clause` or `range_clause`; a C `struct_specifier` declares a type only when it has a body.

Every type named here was read from the grammar's own parse trees, and tests/test_code_nodes.py
checks that each one exists in the installed grammar. Kinds follow syntax, not semantics: a Rust
`loop` is a WhileStmt, a Ruby `require "x"` is a CallExpr (the grammar has no import node).
"""

from __future__ import annotations

import dataclasses
import types
from collections.abc import Mapping

from gemini_jax.errors import ConfigError

# The shared vocabulary. ClassDecl covers every type-declaring construct (class, struct, enum,
# interface, trait, impl, module, namespace); Lambda is an anonymous function or closure.
NODE_KINDS = (
    "FunctionDecl", "ClassDecl", "Lambda",
    "IfStmt", "ForStmt", "WhileStmt", "SwitchStmt", "TryStmt", "ReturnStmt",
    "CallExpr", "Assignment", "VarDecl", "ImportDecl",
    "Block", "Comment", "BinaryExpr", "Literal",
)


# eq=False: specs are module-level singletons, hashed by identity (their tables are mappings).
@dataclasses.dataclass(frozen=True, kw_only=True, eq=False)
class LanguageSpec:
    """One language: its grammar package (`module.entry()` returns the tree-sitter language
    pointer), the PyPI distribution that ships it, and its two mapping tables."""

    name: str
    module: str
    entry: str
    distribution: str
    kinds: Mapping[str, str]
    by_child: tuple[tuple[str, str, str], ...] = ()
    aliases: tuple[str, ...] = ()

    def __post_init__(self):
        object.__setattr__(self, "kinds", types.MappingProxyType(dict(self.kinds)))
        used = list(self.kinds.values()) + [kind for _, _, kind in self.by_child]
        unknown = sorted({kind for kind in used if kind not in NODE_KINDS})
        if unknown:
            raise ConfigError(f"LanguageSpec {self.name!r} maps to kinds {unknown} outside NODE_KINDS "
                              f"{list(NODE_KINDS)}: add them to the vocabulary or fix the table.")


def _table(**groups: tuple[str, ...]) -> dict[str, str]:
    """{kind: node types} written the readable way round -> {node type: kind}."""
    return {node_type: kind for kind, node_types in groups.items() for node_type in node_types}


_C_FAMILY_LOOPS = dict(ForStmt=("for_statement",), WhileStmt=("while_statement", "do_statement"))

PYTHON = LanguageSpec(
    name="python", module="tree_sitter_python", entry="language", distribution="tree-sitter-python",
    aliases=("py",),
    kinds=_table(
        FunctionDecl=("function_definition",), ClassDecl=("class_definition",), Lambda=("lambda",),
        IfStmt=("if_statement", "elif_clause"), ForStmt=("for_statement",), WhileStmt=("while_statement",),
        SwitchStmt=("match_statement",), TryStmt=("try_statement",), ReturnStmt=("return_statement",),
        CallExpr=("call",), Assignment=("assignment", "augmented_assignment"),
        ImportDecl=("import_statement", "import_from_statement"),
        Block=("block",), Comment=("comment",),
        BinaryExpr=("binary_operator", "comparison_operator", "boolean_operator"),
        Literal=("integer", "float", "string", "true", "false", "none"),
    ),
)

_JS_KINDS = dict(
    FunctionDecl=("function_declaration", "generator_function_declaration", "method_definition"),
    ClassDecl=("class_declaration",),
    Lambda=("arrow_function", "function_expression"),
    IfStmt=("if_statement",), ForStmt=("for_statement", "for_in_statement"),
    WhileStmt=("while_statement", "do_statement"), SwitchStmt=("switch_statement",),
    TryStmt=("try_statement",), ReturnStmt=("return_statement",),
    CallExpr=("call_expression", "new_expression"),
    Assignment=("assignment_expression", "augmented_assignment_expression"),
    VarDecl=("lexical_declaration", "variable_declaration"), ImportDecl=("import_statement",),
    Block=("statement_block",), Comment=("comment",), BinaryExpr=("binary_expression",),
    Literal=("number", "string", "template_string", "true", "false", "null", "regex"),
)

JAVASCRIPT = LanguageSpec(
    name="javascript", module="tree_sitter_javascript", entry="language",
    distribution="tree-sitter-javascript", aliases=("js",), kinds=_table(**_JS_KINDS),
)

TYPESCRIPT = LanguageSpec(
    name="typescript", module="tree_sitter_typescript", entry="language_typescript",
    distribution="tree-sitter-typescript", aliases=("ts",),
    kinds=_table(**{
        **_JS_KINDS,
        "FunctionDecl": _JS_KINDS["FunctionDecl"] + ("function_signature", "method_signature"),
        "ClassDecl": ("class_declaration", "abstract_class_declaration", "interface_declaration",
                      "enum_declaration", "internal_module"),
    }),
)

GO = LanguageSpec(
    name="go", module="tree_sitter_go", entry="language", distribution="tree-sitter-go", aliases=("golang",),
    kinds=_table(
        FunctionDecl=("function_declaration", "method_declaration"), ClassDecl=("type_declaration",),
        Lambda=("func_literal",),
        IfStmt=("if_statement",), WhileStmt=("for_statement",),  # ForStmt when it has a clause (below)
        SwitchStmt=("expression_switch_statement", "type_switch_statement", "select_statement"),
        ReturnStmt=("return_statement",), CallExpr=("call_expression",),
        Assignment=("assignment_statement",),
        VarDecl=("short_var_declaration", "var_declaration", "const_declaration"),
        ImportDecl=("import_declaration",), Block=("block",), Comment=("comment",),
        BinaryExpr=("binary_expression",),
        Literal=("int_literal", "float_literal", "imaginary_literal", "rune_literal",
                 "interpreted_string_literal", "raw_string_literal", "true", "false", "nil"),
    ),
    # Go spells every loop `for`; only the ones with a clause count over something.
    by_child=(("for_statement", "for_clause", "ForStmt"), ("for_statement", "range_clause", "ForStmt")),
)

RUST = LanguageSpec(
    name="rust", module="tree_sitter_rust", entry="language", distribution="tree-sitter-rust", aliases=("rs",),
    kinds=_table(
        FunctionDecl=("function_item", "function_signature_item"),
        ClassDecl=("struct_item", "enum_item", "union_item", "trait_item", "impl_item", "mod_item"),
        Lambda=("closure_expression",),
        IfStmt=("if_expression",), ForStmt=("for_expression",),
        WhileStmt=("while_expression", "loop_expression"), SwitchStmt=("match_expression",),
        ReturnStmt=("return_expression",), CallExpr=("call_expression", "macro_invocation"),
        Assignment=("assignment_expression", "compound_assignment_expr"),
        VarDecl=("let_declaration", "const_item", "static_item"), ImportDecl=("use_declaration",),
        Block=("block",), Comment=("line_comment", "block_comment"), BinaryExpr=("binary_expression",),
        Literal=("integer_literal", "float_literal", "string_literal", "raw_string_literal", "char_literal",
                 "boolean_literal"),
    ),
)

_C_KINDS = dict(
    FunctionDecl=("function_definition",),
    IfStmt=("if_statement",), **_C_FAMILY_LOOPS, SwitchStmt=("switch_statement",),
    ReturnStmt=("return_statement",), CallExpr=("call_expression",), Assignment=("assignment_expression",),
    VarDecl=("declaration",), ImportDecl=("preproc_include",),
    Block=("compound_statement",), Comment=("comment",), BinaryExpr=("binary_expression",),
    Literal=("number_literal", "string_literal", "char_literal", "true", "false", "null"),
)
# A struct/union/enum specifier declares a type only with its body; `struct s *p` merely names one.
# A `declaration` with a function declarator is a prototype, not a variable.
_C_BY_CHILD = (
    ("struct_specifier", "field_declaration_list", "ClassDecl"),
    ("union_specifier", "field_declaration_list", "ClassDecl"),
    ("enum_specifier", "enumerator_list", "ClassDecl"),
    ("declaration", "function_declarator", "FunctionDecl"),
)

C = LanguageSpec(
    name="c", module="tree_sitter_c", entry="language", distribution="tree-sitter-c", aliases=("h",),
    kinds=_table(**_C_KINDS), by_child=_C_BY_CHILD,
)

CPP = LanguageSpec(
    name="cpp", module="tree_sitter_cpp", entry="language", distribution="tree-sitter-cpp",
    aliases=("c++", "cxx", "hpp"),
    kinds=_table(**{
        **_C_KINDS,
        "ClassDecl": ("namespace_definition",), "Lambda": ("lambda_expression",),
        "ForStmt": ("for_statement", "for_range_loop"), "TryStmt": ("try_statement",),
        "ImportDecl": ("preproc_include", "using_declaration"),
        "Literal": _C_KINDS["Literal"] + ("raw_string_literal",),
    }),
    by_child=_C_BY_CHILD + (("class_specifier", "field_declaration_list", "ClassDecl"),),
)

JAVA = LanguageSpec(
    name="java", module="tree_sitter_java", entry="language", distribution="tree-sitter-java",
    kinds=_table(
        FunctionDecl=("method_declaration", "constructor_declaration"),
        ClassDecl=("class_declaration", "interface_declaration", "enum_declaration", "record_declaration"),
        Lambda=("lambda_expression",),
        IfStmt=("if_statement",), ForStmt=("for_statement", "enhanced_for_statement"),
        WhileStmt=("while_statement", "do_statement"), SwitchStmt=("switch_expression",),
        TryStmt=("try_statement", "try_with_resources_statement"), ReturnStmt=("return_statement",),
        CallExpr=("method_invocation", "object_creation_expression"), Assignment=("assignment_expression",),
        VarDecl=("local_variable_declaration", "field_declaration"), ImportDecl=("import_declaration",),
        Block=("block",), Comment=("line_comment", "block_comment"), BinaryExpr=("binary_expression",),
        Literal=("decimal_integer_literal", "hex_integer_literal", "decimal_floating_point_literal",
                 "string_literal", "character_literal", "true", "false", "null_literal"),
    ),
)

CSHARP = LanguageSpec(
    name="csharp", module="tree_sitter_c_sharp", entry="language", distribution="tree-sitter-c-sharp",
    aliases=("c#", "cs"),
    kinds=_table(
        FunctionDecl=("method_declaration", "constructor_declaration", "local_function_statement"),
        ClassDecl=("class_declaration", "struct_declaration", "interface_declaration", "enum_declaration",
                   "record_declaration", "namespace_declaration"),
        Lambda=("lambda_expression", "anonymous_method_expression"),
        IfStmt=("if_statement",), ForStmt=("for_statement", "foreach_statement"),
        WhileStmt=("while_statement", "do_statement"), SwitchStmt=("switch_statement", "switch_expression"),
        TryStmt=("try_statement",), ReturnStmt=("return_statement",),
        CallExpr=("invocation_expression", "object_creation_expression"), Assignment=("assignment_expression",),
        # `variable_declaration` sits inside local and field declarations and alone in a `for` header.
        VarDecl=("variable_declaration",), ImportDecl=("using_directive",),
        Block=("block",), Comment=("comment",), BinaryExpr=("binary_expression",),
        Literal=("integer_literal", "real_literal", "string_literal", "character_literal", "boolean_literal",
                 "null_literal"),
    ),
)

RUBY = LanguageSpec(
    name="ruby", module="tree_sitter_ruby", entry="language", distribution="tree-sitter-ruby", aliases=("rb",),
    kinds=_table(
        FunctionDecl=("method", "singleton_method"), ClassDecl=("class", "module", "singleton_class"),
        Lambda=("lambda",),
        IfStmt=("if", "elsif", "unless", "if_modifier", "unless_modifier"), ForStmt=("for",),
        WhileStmt=("while", "until", "while_modifier", "until_modifier"), SwitchStmt=("case", "case_match"),
        ReturnStmt=("return",), CallExpr=("call",), Assignment=("assignment", "operator_assignment"),
        Comment=("comment",), BinaryExpr=("binary",),
        Literal=("integer", "float", "string", "simple_symbol", "true", "false", "nil"),
    ),
    # `begin ... end` is a plain group unless it rescues.
    by_child=(("begin", "rescue", "TryStmt"),),
)

LUA = LanguageSpec(
    name="lua", module="tree_sitter_lua", entry="language", distribution="tree-sitter-lua",
    kinds=_table(
        FunctionDecl=("function_declaration",), Lambda=("function_definition",),
        IfStmt=("if_statement", "elseif_statement"), ForStmt=("for_statement",),
        WhileStmt=("while_statement", "repeat_statement"), ReturnStmt=("return_statement",),
        CallExpr=("function_call",), Assignment=("assignment_statement",),
        # `local x = 1` is a declaration around an assignment_statement: both become nodes.
        VarDecl=("variable_declaration",),
        Block=("block",), Comment=("comment",), BinaryExpr=("binary_expression",),
        Literal=("number", "string", "true", "false", "nil"),
    ),
)

PHP = LanguageSpec(
    name="php", module="tree_sitter_php", entry="language_php", distribution="tree-sitter-php",
    kinds=_table(
        FunctionDecl=("function_definition", "method_declaration"),
        ClassDecl=("class_declaration", "interface_declaration", "trait_declaration", "enum_declaration"),
        Lambda=("anonymous_function", "arrow_function"),
        IfStmt=("if_statement", "else_if_clause"), ForStmt=("for_statement", "foreach_statement"),
        WhileStmt=("while_statement", "do_statement"), SwitchStmt=("switch_statement", "match_expression"),
        TryStmt=("try_statement",), ReturnStmt=("return_statement",),
        CallExpr=("function_call_expression", "member_call_expression", "scoped_call_expression",
                  "object_creation_expression"),
        Assignment=("assignment_expression", "augmented_assignment_expression"),
        ImportDecl=("namespace_use_declaration", "require_expression", "require_once_expression",
                    "include_expression", "include_once_expression"),
        Block=("compound_statement",), Comment=("comment",), BinaryExpr=("binary_expression",),
        Literal=("integer", "float", "string", "encapsed_string", "boolean", "null"),
    ),
)

VERILOG = LanguageSpec(
    name="verilog", module="tree_sitter_verilog", entry="language", distribution="tree-sitter-verilog",
    aliases=("v",),
    kinds=_table(
        FunctionDecl=("function_declaration", "task_declaration"), ClassDecl=("module_declaration",),
        IfStmt=("conditional_statement",), WhileStmt=("loop_statement",),  # ForStmt with a `for` (below)
        SwitchStmt=("case_statement",), ReturnStmt=("jump_statement",),
        CallExpr=("tf_call", "system_tf_call"),
        # A continuous assign wraps its net_assignment; only the outer one is a node.
        Assignment=("blocking_assignment", "nonblocking_assignment", "continuous_assign"),
        VarDecl=("data_declaration", "net_declaration"),
        ImportDecl=("include_compiler_directive", "package_import_declaration"),
        Block=("seq_block", "par_block"), Comment=("comment",),
        Literal=("primary_literal",),
    ),
    # `loop_statement` is every loop (for, while, repeat, forever); its keyword says which.
    by_child=(("loop_statement", "for", "ForStmt"),),
)

LANGUAGES: Mapping[str, LanguageSpec] = types.MappingProxyType({
    spec.name: spec for spec in (PYTHON, JAVASCRIPT, TYPESCRIPT, GO, RUST, C, CPP, JAVA, CSHARP, RUBY, LUA, PHP,
                                 VERILOG)
})
_BY_ALIAS = {alias: spec for spec in LANGUAGES.values() for alias in (spec.name, *spec.aliases)}


def language_spec(language: str) -> LanguageSpec:
    """The spec for `language`, by name or alias, case-insensitive.

    Raises ConfigError naming the language and listing the supported ones.
    """
    spec = _BY_ALIAS.get(language.strip().lower()) if isinstance(language, str) else None
    if spec is None:
        raise ConfigError(f"language={language!r} is not supported; choose one of {sorted(LANGUAGES)} "
                          f"(aliases: {sorted(set(_BY_ALIAS) - set(LANGUAGES))}).")
    return spec
