"""Random small programs, one construct vocabulary written out in every supported language: the
training and evaluation snippets of the node encoder (gemini_jax.code.encoder).

Each language has templates for the same constructs (function, type, if, for, while, return, call,
assignment, variable declaration, import, comment). Where the grammar allows, a construct has two or
more structurally different templates (an if with and without else, a call with arguments, without,
and on a receiver), so that one of them can be held out of training entirely (`heldout_templates`)
and the encoder judged on spellings it never saw. `program(language, seed)` draws a program from
them with random identifiers, literals and nesting; a seed fixes it. `labelled_program` also says
where each template instance lies, so a node can be traced to the template that wrote it.

Templates are %-format strings; `%(body)s` stands alone on its line and receives the indented inner
statements.
"""

from __future__ import annotations

import dataclasses
import random
import re
from collections.abc import Mapping
from typing import Literal, NamedTuple

from gemini_jax.code.languages import LANGUAGES
from gemini_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Templates:
    """One language's spellings. Each construct is a tuple of alternative templates; () means the
    language has no such construct."""

    function: tuple[str, ...]
    method: tuple[str, ...] = ()        # a function inside `klass`, when spelled differently
    param: str = "%(p)s"
    self_param: str | None = None       # first parameter of a method (Python's self, Rust's &self)
    klass: tuple[str, ...] = ()         # a type holding methods: %(cls)s, %(members)s
    type_decl: tuple[str, ...] = ()     # a type declared beside top-level functions (Go, C)
    methods_only: bool = False          # functions must live in a type (Java, C#)
    if_: tuple[str, ...]
    for_: tuple[str, ...]
    while_: tuple[str, ...]
    return_: tuple[str, ...]
    call: tuple[str, ...]
    assign: tuple[str, ...]
    vardecl: tuple[str, ...] = ()
    comment: tuple[str, ...]
    imports: tuple[str, ...] = ()
    prelude: str = ""
    decls_first: bool = False           # declarations only at the top of a function (Verilog)
    var: str = "%s"                     # how a variable name is spelled (PHP: "$%s")
    string: str = '"%s"'


# The construct fields of Templates, and the node kind (gemini_jax.code.NODE_KINDS) each one writes.
CONSTRUCT_KINDS: Mapping[str, str] = {
    "function": "FunctionDecl", "method": "FunctionDecl", "klass": "ClassDecl", "type_decl": "ClassDecl",
    "if_": "IfStmt", "for_": "ForStmt", "while_": "WhileStmt", "return_": "ReturnStmt", "call": "CallExpr",
    "assign": "Assignment", "vardecl": "VarDecl", "comment": "Comment", "imports": "ImportDecl",
}

_C_IF = ("if (%(cond)s) {\n%(body)s\n}", "if (%(cond)s) {\n%(body)s\n} else {\n%(body2)s\n}")
_C_WHILE = ("while (%(cond)s) {\n%(body)s\n}", "do {\n%(body)s\n} while (%(cond)s);")
# A call with arguments, one on a receiver, one without arguments.
_C_CALL = ("%(fn)s(%(args)s);", "%(obj)s.%(fn)s(%(args)s);", "%(fn)s();")
# To a name, compound, to an element.
_C_ASSIGN = ("%(var)s = %(expr)s;", "%(var)s += %(expr)s;", "%(var)s[%(idx)s] = %(expr)s;")
_C_RETURN = ("return %(expr)s;", "return;")
_SLASH_COMMENT = ("// %(words)s", "/* %(words)s */")
_JS_IMPORTS = ('import %(fn)s from "%(mod)s";', 'import { %(fn)s } from "%(mod)s";',
               'import * as %(cls)s from "%(mod)s";')
_JS_FOR = ("for (let %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
           "for (const %(var)s of %(coll)s) {\n%(body)s\n}")

TEMPLATES = {
    "python": Templates(
        function=("def %(name)s(%(params)s):\n%(body)s", "def %(name)s(%(params)s) -> int:\n%(body)s"),
        self_param="self", klass=("class %(cls)s:\n%(members)s", "class %(cls)s(%(base)s):\n%(members)s"),
        if_=("if %(cond)s:\n%(body)s", "if %(cond)s:\n%(body)s\nelse:\n%(body2)s"),
        for_=("for %(var)s in range(%(n)s):\n%(body)s", "for %(var)s in %(coll)s:\n%(body)s"),
        while_=("while %(cond)s:\n%(body)s", "while %(cond)s:\n%(body)s\nelse:\n%(body2)s"),
        return_=("return %(expr)s", "return"),
        call=("%(fn)s(%(args)s)", "%(obj)s.%(fn)s(%(args)s)", "%(fn)s()"),
        assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s", "%(var)s[%(idx)s] = %(expr)s"),
        comment=("# %(words)s",), imports=("import %(mod)s", "from %(mod)s import %(fn)s"),
    ),
    "javascript": Templates(
        function=("function %(name)s(%(params)s) {\n%(body)s\n}", "async function %(name)s(%(params)s) {\n%(body)s\n}"),
        method=("%(name)s(%(params)s) {\n%(body)s\n}", "static %(name)s(%(params)s) {\n%(body)s\n}"),
        klass=("class %(cls)s {\n%(members)s\n}", "class %(cls)s extends %(base)s {\n%(members)s\n}"),
        if_=_C_IF, for_=_JS_FOR, while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("let %(var)s = %(expr)s;", "const %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=_JS_IMPORTS,
    ),
    "typescript": Templates(
        function=("function %(name)s(%(params)s): number {\n%(body)s\n}",
                  "async function %(name)s(%(params)s): Promise<number> {\n%(body)s\n}"),
        param="%(p)s: number",
        method=("%(name)s(%(params)s): number {\n%(body)s\n}", "static %(name)s(%(params)s): number {\n%(body)s\n}"),
        klass=("class %(cls)s {\n%(members)s\n}", "class %(cls)s extends %(base)s {\n%(members)s\n}"),
        if_=_C_IF, for_=_JS_FOR, while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("let %(var)s: number = %(expr)s;", "const %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=_JS_IMPORTS,
    ),
    "go": Templates(
        function=("func %(name)s(%(params)s) int {\n%(body)s\n}",
                  "func %(name)s(%(params)s) (result int) {\n%(body)s\n}"),
        param="%(p)s int",
        type_decl=("type %(cls)s struct {\n\tn int\n}", "type %(cls)s interface {\n\tSize() int\n}"),
        if_=("if %(cond)s {\n%(body)s\n}", "if %(cond)s {\n%(body)s\n} else {\n%(body2)s\n}"),
        for_=("for %(var)s := 0; %(var)s < %(n)s; %(var)s++ {\n%(body)s\n}",
              "for _, %(var)s := range %(coll)s {\n%(body)s\n}"),
        while_=("for %(cond)s {\n%(body)s\n}", "for {\n%(body)s\n    break\n}"),
        return_=("return %(expr)s", "return"),
        call=("%(fn)s(%(args)s)", "%(obj)s.%(fn)s(%(args)s)", "%(fn)s()"),
        assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s", "%(var)s[%(idx)s] = %(expr)s"),
        vardecl=("%(var)s := %(expr)s", "var %(var)s int = %(expr)s"), comment=_SLASH_COMMENT,
        imports=('import "%(mod)s"', 'import %(fn)s "%(mod)s"', 'import (\n\t"fmt"\n\t"%(mod)s"\n)'),
        prelude="package main\n",
    ),
    "rust": Templates(
        function=("fn %(name)s(%(params)s) -> i32 {\n%(body)s\n}", "pub fn %(name)s(%(params)s) -> i32 {\n%(body)s\n}"),
        param="%(p)s: i32", self_param="&self",
        klass=("struct %(cls)s {\n    n: i32,\n}\nimpl %(cls)s {\n%(members)s\n}",
               "enum %(cls)s {\n    First,\n    Second,\n}\nimpl %(cls)s {\n%(members)s\n}"),
        if_=("if %(cond)s {\n%(body)s\n}", "if %(cond)s {\n%(body)s\n} else {\n%(body2)s\n}"),
        for_=("for %(var)s in 0..%(n)s {\n%(body)s\n}", "for %(var)s in %(coll)s.iter() {\n%(body)s\n}"),
        while_=("while %(cond)s {\n%(body)s\n}", "loop {\n%(body)s\n    break;\n}"), return_=_C_RETURN,
        call=_C_CALL, assign=_C_ASSIGN, vardecl=("let mut %(var)s = %(expr)s;", "let %(var)s: i32 = %(expr)s;"),
        comment=_SLASH_COMMENT,
        imports=("use std::%(mod)s;", "use %(mod)s::%(fn)s;", "use %(mod)s::{%(fn)s, %(cls)s};"),
    ),
    "c": Templates(
        function=("int %(name)s(%(params)s) {\n%(body)s\n}", "static int %(name)s(%(params)s) {\n%(body)s\n}"),
        param="int %(p)s",
        type_decl=("struct %(cls)s {\n    int n;\n};", "enum %(cls)s {\n    %(cls)sFirst,\n    %(cls)sSecond\n};"),
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (%(var)s = %(n)s; %(var)s > 0; %(var)s--) {\n%(body)s\n}"),
        while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "long %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=("#include <%(mod)s.h>", '#include "%(mod)s.h"'),
    ),
    "cpp": Templates(
        function=("int %(name)s(%(params)s) {\n%(body)s\n}", "auto %(name)s(%(params)s) -> int {\n%(body)s\n}"),
        param="int %(p)s",
        klass=("class %(cls)s {\n public:\n%(members)s\n};", "struct %(cls)s : public %(base)s {\n%(members)s\n};"),
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (int %(var)s : %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "auto %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=("#include <%(mod)s>", '#include "%(mod)s.h"', "using std::%(fn)s;"),
    ),
    "java": Templates(
        function=("int %(name)s(%(params)s) {\n%(body)s\n}", "public static int %(name)s(%(params)s) {\n%(body)s\n}"),
        param="int %(p)s", methods_only=True,
        klass=("class %(cls)s {\n%(members)s\n}", "class %(cls)s extends %(base)s {\n    int n;\n%(members)s\n}"),
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (int %(var)s : %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "var %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=("import java.util.%(cls)s;", "import static java.lang.Math.%(fn)s;", "import java.%(mod)s.*;"),
    ),
    "csharp": Templates(
        function=("int %(name)s(%(params)s) {\n%(body)s\n}", "public static int %(name)s(%(params)s) {\n%(body)s\n}"),
        param="int %(p)s", methods_only=True,
        klass=("class %(cls)s {\n%(members)s\n}", "class %(cls)s : %(base)s {\n    int n;\n%(members)s\n}"),
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "foreach (var %(var)s in %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_=_C_RETURN, call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "var %(var)s = %(expr)s;"), comment=_SLASH_COMMENT,
        imports=("using %(cls)s;", "using static System.%(cls)s;", "using %(cls)s = System.%(base)s;"),
    ),
    "ruby": Templates(
        function=("def %(name)s(%(params)s)\n%(body)s\nend", "def self.%(name)s(%(params)s)\n%(body)s\nend"),
        klass=("class %(cls)s\n%(members)s\nend", "class %(cls)s < %(base)s\n%(members)s\nend"),
        if_=("if %(cond)s\n%(body)s\nend", "if %(cond)s\n%(body)s\nelse\n%(body2)s\nend"),
        for_=("for %(var)s in 0..%(n)s\n%(body)s\nend", "for %(var)s in %(coll)s\n%(body)s\nend"),
        while_=("while %(cond)s\n%(body)s\nend", "until %(cond)s\n%(body)s\nend"),
        return_=("return %(expr)s", "return"),
        call=("%(fn)s(%(args)s)", "%(obj)s.%(fn)s(%(args)s)", "%(fn)s()"),
        assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s", "%(var)s[%(idx)s] = %(expr)s"),
        comment=("# %(words)s",),
    ),
    "lua": Templates(
        function=("function %(name)s(%(params)s)\n%(body)s\nend", "local function %(name)s(%(params)s)\n%(body)s\nend"),
        if_=("if %(cond)s then\n%(body)s\nend", "if %(cond)s then\n%(body)s\nelse\n%(body2)s\nend"),
        for_=("for %(var)s = 1, %(n)s do\n%(body)s\nend", "for _, %(var)s in ipairs(%(coll)s) do\n%(body)s\nend"),
        while_=("while %(cond)s do\n%(body)s\nend", "repeat\n%(body)s\nuntil %(cond)s"),
        return_=("return %(expr)s", "return"),
        call=("%(fn)s(%(args)s)", "%(obj)s:%(fn)s(%(args)s)", "%(fn)s()"),
        assign=("%(var)s = %(expr)s", "%(var)s[%(idx)s] = %(expr)s"),
        vardecl=("local %(var)s = %(expr)s", "local %(var)s"), comment=("-- %(words)s", "--[[ %(words)s ]]"),
    ),
    "php": Templates(
        function=("function %(name)s(%(params)s) {\n%(body)s\n}", "function %(name)s(%(params)s): int {\n%(body)s\n}"),
        param="$%(p)s",
        klass=("class %(cls)s {\n%(members)s\n}",
               "class %(cls)s extends %(base)s {\n    public $n = 0;\n%(members)s\n}"),
        if_=_C_IF, for_=("for (%(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "foreach (%(coll)s as %(var)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_=_C_RETURN,
        call=("%(fn)s(%(args)s);", "%(obj)s->%(fn)s(%(args)s);", "%(fn)s();"), assign=_C_ASSIGN,
        comment=("// %(words)s", "# %(words)s", "/* %(words)s */"),
        imports=("use App\\%(cls)s;", 'require_once "%(mod)s.php";'), prelude="<?php\n", var="$%s",
    ),
    "verilog": Templates(
        function=("function automatic integer %(name)s(%(params)s);\n  begin\n%(body)s\n  end\nendfunction",
                  "function integer %(name)s(%(params)s);\n  begin\n%(body)s\n  end\nendfunction"),
        param="input integer %(p)s", methods_only=True,
        klass=("module %(cls)s;\n%(members)s\nendmodule", "module %(cls)s(input wire clk);\n%(members)s\nendmodule"),
        if_=("if (%(cond)s) begin\n%(body)s\nend", "if (%(cond)s) begin\n%(body)s\nend else begin\n%(body2)s\nend"),
        for_=("for (%(var)s = 0; %(var)s < %(n)s; %(var)s = %(var)s + 1) begin\n%(body)s\nend",
              "for (int %(var)s = %(n)s; %(var)s > 0; %(var)s--) begin\n%(body)s\nend"),
        while_=("while (%(cond)s) begin\n%(body)s\nend", "repeat (%(n)s) begin\n%(body)s\nend"),
        return_=("return %(expr)s;", "return;"),
        # A bare call to a user function is not a statement this grammar accepts.
        call=('$display("%%d", %(args)s);', "%(var)s = %(fn)s(%(args)s);", "$finish;"),
        # No element assignment: the grammar reads `x[1] = e;` as an error and `x[1] <= e;` as a
        # clocking drive.
        assign=("%(var)s = %(expr)s;", "%(var)s <= %(expr)s;"),
        vardecl=("integer %(var)s = %(expr)s;", "reg [31:0] %(var)s;"), decls_first=True,
        comment=_SLASH_COMMENT, imports=('`include "%(mod)s.vh"',),
    ),
}

_WORDS = ("total", "count", "limit", "value", "index", "items", "result", "offset", "size", "next", "step",
          "delta", "score", "left", "right", "acc", "buf", "key", "node", "tmp")
_COMMENT_WORDS = ("sum", "the", "values", "check", "bounds", "skip", "empty", "keep", "order", "fast", "path")
_INDENT = "    "
# Instance markers: opened before a template instance's text, closed after it, stripped from the
# final program (private-use code points: no template or identifier holds them).
_OPEN, _SHUT, _CLOSE = "\ue000", "\ue001", "\ue002"
_MARK = re.compile(f"{_OPEN}([0-9]+){_SHUT}|{_CLOSE}")


class TemplateId(NamedTuple):
    """One template: `TEMPLATES[language].<construct>[index]`."""

    language: str
    construct: str
    index: int

    def __str__(self) -> str:
        return f"{self.language}:{self.construct}[{self.index}]"


class Instance(NamedTuple):
    """Where one template instance lies in a program: UTF-8 byte span [start_byte, end_byte)."""

    template: TemplateId
    start_byte: int
    end_byte: int


@dataclasses.dataclass(frozen=True)
class LabelledProgram:
    """A program and every template instance in it, outermost first among those starting together."""

    source: str
    instances: tuple[Instance, ...]


Draw = Literal["all", "seen", "heldout"]


def all_templates(language: str) -> list[TemplateId]:
    """Every template of `language`."""
    templates = TEMPLATES[language]
    return [TemplateId(language, construct, index) for construct in CONSTRUCT_KINDS
            for index in range(len(getattr(templates, construct)))]


def heldout_templates(seed: int) -> frozenset[TemplateId]:
    """The templates kept out of training: for every language and construct that has two or more
    templates, the one at index `random.Random(f"heldout:{seed}:{language}:{construct}").randrange(n)`
    of its n. Constructs with a single template keep it in training (holding it out would leave the
    encoder nothing of that kind in that language to learn from)."""
    out = set()
    for language, templates in TEMPLATES.items():
        for construct in CONSTRUCT_KINDS:
            count = len(getattr(templates, construct))
            if count >= 2:
                out.add(TemplateId(language, construct, random.Random(f"heldout:{seed}:{language}:{construct}")
                                   .randrange(count)))
    return frozenset(out)


def _indent(text: str) -> str:
    return "\n".join(_INDENT + line if line else line for line in text.split("\n"))


class _Writer:
    """Draws one program; all randomness comes from `rng`. `allowed[construct]` are the template
    indices it may draw from."""

    def __init__(self, language: str, rng: random.Random, allowed: Mapping[str, tuple[int, ...]]):
        self.language, self.t, self.rng, self.allowed = language, TEMPLATES[language], rng, allowed
        self.instances: list[TemplateId] = []

    def emit(self, construct: str, fields: dict) -> str:
        """One instance of a template of `construct`, drawn from the allowed ones, filled, marked."""
        index = self.rng.choice(self.allowed[construct])
        self.instances.append(TemplateId(self.language, construct, index))
        text = getattr(self.t, construct)[index] % fields
        return f"{_OPEN}{len(self.instances) - 1}{_SHUT}{text}{_CLOSE}"

    def name(self, capital: bool = False) -> str:
        parts = self.rng.sample(_WORDS, self.rng.randint(1, 2))
        if capital:
            return "".join(p.capitalize() for p in parts)
        return parts[0] + "".join(p.capitalize() for p in parts[1:]) + str(self.rng.randint(0, 99))

    def atom(self, names: list[str]) -> str:
        roll = self.rng.random()
        if roll < 0.45:
            return self.rng.choice(names)
        if roll < 0.9:
            return str(self.rng.randint(0, 999))
        return self.t.string % self.rng.choice(_COMMENT_WORDS) if self.language != "verilog" else "8'd7"

    def expr(self, names: list[str], calls: list[str]) -> str:
        roll = self.rng.random()
        if roll < 0.3:
            return self.atom(names)
        if roll < 0.85:
            return f"{self.atom(names)} {self.rng.choice('+-*')} {self.atom(names)}"
        return f"{self.rng.choice(calls)}({self.atom(names)})"

    def cond(self, names: list[str]) -> str:
        return f"{self.rng.choice(names)} {self.rng.choice(('<', '>', '==', '<=', '>='))} {self.rng.randint(0, 99)}"

    def fill(self, construct: str, names: list[str], calls: list[str], depth: int) -> str:
        fields = {"var": self.rng.choice(names), "expr": self.expr(names, calls), "cond": self.cond(names),
                  "n": str(self.rng.randint(2, 64)), "coll": self.rng.choice(names), "fn": self.rng.choice(calls),
                  "obj": self.rng.choice(names), "idx": str(self.rng.randint(0, 9)),
                  "args": ", ".join(self.atom(names) for _ in range(self.rng.randint(1, 3))),
                  "words": " ".join(self.rng.sample(_COMMENT_WORDS, 3))}
        if construct in ("if_", "for_", "while_"):
            fields["body"] = _indent(self.block(names, calls, depth - 1))
            fields["body2"] = _indent(self.block(names, calls, depth - 1))
        return self.emit(construct, fields)

    def block(self, names: list[str], calls: list[str], depth: int) -> str:
        t = self.t
        simple = ["call", "assign"] + (["vardecl"] if t.vardecl and not t.decls_first else [])
        compound = ["if_", "for_", "while_"] if depth > 0 else []
        lines = []
        for _ in range(self.rng.randint(1, 3)):
            if self.rng.random() < 0.1:
                lines.append(self.fill("comment", names, calls, depth))
            lines.append(self.fill(self.rng.choice(simple + compound + compound), names, calls, depth))
        return "\n".join(lines)

    def function(self, calls: list[str], method: bool) -> str:
        t = self.t
        params = [self.name() for _ in range(self.rng.randint(1, 3))]
        names = [t.var % p for p in params] + [t.var % self.name() for _ in range(2)]
        spelled = [t.param % {"p": p} for p in params]
        if method and t.self_param:
            spelled.insert(0, t.self_param)
        decls = [self.fill("vardecl", names, calls, 0) for _ in range(self.rng.randint(0, 2) if t.decls_first else 0)]
        body = "\n".join([*decls, self.block(names, calls, depth=2), self.fill("return_", names, calls, 0)])
        construct = "method" if method and t.method else "function"
        return self.emit(construct, {"name": self.name(), "params": ", ".join(spelled), "body": _indent(body)})

    def program(self) -> str:
        t = self.t
        calls = [self.name() for _ in range(3)]
        parts = [t.prelude.rstrip("\n")] if t.prelude else []
        for _ in range(self.rng.randint(0, 2) if t.imports else 0):
            parts.append(self.emit("imports", {"mod": self.name(), "fn": calls[0], "cls": self.name(True),
                                               "base": self.name(True)}))
        if t.type_decl:
            parts.append(self.emit("type_decl", {"cls": self.name(True)}))
        in_type = bool(t.klass) and (t.methods_only or self.rng.random() < 0.6)
        functions = [self.function(calls, in_type) for _ in range(self.rng.randint(1, 2))]
        if in_type:
            parts.append(self.emit("klass", {"cls": self.name(True), "base": self.name(True),
                                             "members": _indent("\n\n".join(functions))}))
        else:
            parts.extend(functions)
        return "\n\n".join(parts) + "\n"


def _unmark(marked: str, instances: list[TemplateId]) -> LabelledProgram:
    """Strip the instance markers from `marked`, noting the byte span each one enclosed."""
    out, size, starts, spans = [], 0, [], {}
    last = 0
    for match in _MARK.finditer(marked):
        piece = marked[last:match.start()]
        out.append(piece)
        size += len(piece.encode("utf-8"))
        last = match.end()
        if match.group(1) is not None:
            starts.append((int(match.group(1)), size))
        else:  # instances nest, so a close ends the innermost open one
            number, start = starts.pop()
            spans[number] = Instance(instances[number], start, size)
    out.append(marked[last:])
    ordered = sorted(spans.values(), key=lambda inst: (inst.start_byte, -inst.end_byte))
    return LabelledProgram("".join(out), tuple(ordered))


def _allowed(language: str, heldout: frozenset[TemplateId], draw: Draw) -> dict[str, tuple[int, ...]]:
    out = {}
    for construct in CONSTRUCT_KINDS:
        indices = tuple(range(len(getattr(TEMPLATES[language], construct))))
        kept = tuple(i for i in indices if TemplateId(language, construct, i) in heldout)
        if draw == "seen":
            indices = tuple(i for i in indices if i not in kept)
        elif draw == "heldout" and kept:
            indices = kept
        out[construct] = indices
    return out


def labelled_program(language: str, seed: int, *, heldout: frozenset[TemplateId] = frozenset(),
                     draw: Draw = "all") -> LabelledProgram:
    """A random program in `language` (a name of gemini_jax.code.LANGUAGES), fixed by `seed`, with
    the span of each template instance in it.

    `draw` picks the templates: "all" of them; "seen", all but those in `heldout` (the training
    programs); "heldout", for each construct with a template in `heldout` only that one, other
    constructs as "all" (the programs the held-out templates are measured on).

    Raises ConfigError for a language without templates or an unknown `draw`.
    """
    if language not in TEMPLATES:
        raise ConfigError(f"language={language!r} has no program templates; choose one of {sorted(TEMPLATES)}.")
    if draw not in ("all", "seen", "heldout"):
        raise ConfigError(f"draw={draw!r} must be 'all', 'seen' or 'heldout'.")
    # The language is part of the seed so that one seed gives each language a different program shape.
    writer = _Writer(language, random.Random(f"{language}:{seed}"), _allowed(language, heldout, draw))
    return _unmark(writer.program(), writer.instances)


def program(language: str, seed: int, *, heldout: frozenset[TemplateId] = frozenset(), draw: Draw = "all") -> str:
    """The source of `labelled_program(language, seed, heldout=heldout, draw=draw)`."""
    return labelled_program(language, seed, heldout=heldout, draw=draw).source


assert set(TEMPLATES) == set(LANGUAGES), "every supported language has program templates"
assert all(getattr(t, c) or c in ("method", "klass", "type_decl", "vardecl", "imports")
           for t in TEMPLATES.values() for c in CONSTRUCT_KINDS), "every language spells the core constructs"
