"""Random small programs, one construct vocabulary written out in every supported language: the
training and evaluation snippets of the node encoder (gemini_jax.code.encoder).

Each language has templates for the same constructs (function, type, if, for, while, return, call,
assignment, variable declaration, import, comment), often several spellings of one (a counting and
a for-each loop). `program(language, seed)` draws a program from them with random identifiers,
literals and nesting; a seed fixes it, so held-out seeds give held-out programs. Templates are
%-format strings; `%(body)s` stands alone on its line and receives the indented inner statements.
"""

from __future__ import annotations

import dataclasses
import random

from gemini_jax.code.languages import LANGUAGES
from gemini_jax.errors import ConfigError


@dataclasses.dataclass(frozen=True, kw_only=True)
class Templates:
    """One language's spellings. A tuple holds alternatives; None: the language has no such construct."""

    function: str
    method: str | None = None           # a function inside `klass`, when spelled differently
    param: str = "%(p)s"
    self_param: str | None = None       # first parameter of a method (Python's self, Rust's &self)
    klass: str | None = None            # a type holding methods: %(cls)s, %(members)s
    type_decl: str | None = None        # a type declared beside top-level functions (Go, C)
    methods_only: bool = False          # functions must live in a type (Java, C#)
    if_: tuple[str, ...]
    for_: tuple[str, ...]
    while_: tuple[str, ...]
    return_: str
    call: tuple[str, ...]
    assign: tuple[str, ...]
    vardecl: tuple[str, ...] = ()
    comment: str
    imports: tuple[str, ...] = ()
    prelude: str = ""
    decls_first: bool = False           # declarations only at the top of a function (Verilog)
    var: str = "%s"                     # how a variable name is spelled (PHP: "$%s")
    string: str = '"%s"'


_C_IF = ("if (%(cond)s) {\n%(body)s\n}", "if (%(cond)s) {\n%(body)s\n} else {\n%(body2)s\n}")
_C_WHILE = ("while (%(cond)s) {\n%(body)s\n}", "do {\n%(body)s\n} while (%(cond)s);")
_C_CALL = ("%(fn)s(%(args)s);",)
_C_ASSIGN = ("%(var)s = %(expr)s;", "%(var)s += %(expr)s;")

TEMPLATES = {
    "python": Templates(
        function="def %(name)s(%(params)s):\n%(body)s", self_param="self", klass="class %(cls)s:\n%(members)s",
        if_=("if %(cond)s:\n%(body)s", "if %(cond)s:\n%(body)s\nelse:\n%(body2)s"),
        for_=("for %(var)s in range(%(n)s):\n%(body)s", "for %(var)s in %(coll)s:\n%(body)s"),
        while_=("while %(cond)s:\n%(body)s",), return_="return %(expr)s", call=("%(fn)s(%(args)s)",),
        assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s"), comment="# %(words)s",
        imports=("import %(mod)s", "from %(mod)s import %(fn)s"),
    ),
    "javascript": Templates(
        function="function %(name)s(%(params)s) {\n%(body)s\n}", method="%(name)s(%(params)s) {\n%(body)s\n}",
        klass="class %(cls)s {\n%(members)s\n}",
        if_=_C_IF, for_=("for (let %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (const %(var)s of %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("let %(var)s = %(expr)s;", "const %(var)s = %(expr)s;"), comment="// %(words)s",
        imports=('import %(fn)s from "%(mod)s";',),
    ),
    "typescript": Templates(
        function="function %(name)s(%(params)s): number {\n%(body)s\n}", param="%(p)s: number",
        method="%(name)s(%(params)s): number {\n%(body)s\n}",
        klass="class %(cls)s {\n%(members)s\n}",
        if_=_C_IF, for_=("for (let %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (const %(var)s of %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("let %(var)s: number = %(expr)s;", "const %(var)s = %(expr)s;"), comment="// %(words)s",
        imports=('import { %(fn)s } from "%(mod)s";',),
    ),
    "go": Templates(
        function="func %(name)s(%(params)s) int {\n%(body)s\n}", param="%(p)s int",
        type_decl="type %(cls)s struct {\n\tn int\n}",
        if_=("if %(cond)s {\n%(body)s\n}", "if %(cond)s {\n%(body)s\n} else {\n%(body2)s\n}"),
        for_=("for %(var)s := 0; %(var)s < %(n)s; %(var)s++ {\n%(body)s\n}",
              "for _, %(var)s := range %(coll)s {\n%(body)s\n}"),
        while_=("for %(cond)s {\n%(body)s\n}",), return_="return %(expr)s", call=("%(fn)s(%(args)s)",),
        assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s"),
        vardecl=("%(var)s := %(expr)s", "var %(var)s int = %(expr)s"), comment="// %(words)s",
        imports=('import "%(mod)s"',), prelude="package main\n",
    ),
    "rust": Templates(
        function="fn %(name)s(%(params)s) -> i32 {\n%(body)s\n}", param="%(p)s: i32", self_param="&self",
        klass="struct %(cls)s {\n    n: i32,\n}\nimpl %(cls)s {\n%(members)s\n}",
        if_=("if %(cond)s {\n%(body)s\n}", "if %(cond)s {\n%(body)s\n} else {\n%(body2)s\n}"),
        for_=("for %(var)s in 0..%(n)s {\n%(body)s\n}", "for %(var)s in %(coll)s.iter() {\n%(body)s\n}"),
        while_=("while %(cond)s {\n%(body)s\n}", "loop {\n%(body)s\n    break;\n}"), return_="return %(expr)s;",
        call=_C_CALL, assign=_C_ASSIGN, vardecl=("let mut %(var)s = %(expr)s;", "let %(var)s: i32 = %(expr)s;"),
        comment="// %(words)s", imports=("use std::%(mod)s;", "use %(mod)s::%(fn)s;"),
    ),
    "c": Templates(
        function="int %(name)s(%(params)s) {\n%(body)s\n}", param="int %(p)s",
        type_decl="struct %(cls)s {\n    int n;\n};",
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "long %(var)s = %(expr)s;"), comment="/* %(words)s */",
        imports=("#include <%(mod)s.h>", '#include "%(mod)s.h"'),
    ),
    "cpp": Templates(
        function="int %(name)s(%(params)s) {\n%(body)s\n}", param="int %(p)s",
        klass="class %(cls)s {\n public:\n%(members)s\n};",
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (int %(var)s : %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "auto %(var)s = %(expr)s;"), comment="// %(words)s",
        imports=("#include <%(mod)s>",),
    ),
    "java": Templates(
        function="int %(name)s(%(params)s) {\n%(body)s\n}", param="int %(p)s", methods_only=True,
        klass="class %(cls)s {\n%(members)s\n}",
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "for (int %(var)s : %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "var %(var)s = %(expr)s;"), comment="// %(words)s",
        imports=("import java.util.%(cls)s;",),
    ),
    "csharp": Templates(
        function="int %(name)s(%(params)s) {\n%(body)s\n}", param="int %(p)s", methods_only=True,
        klass="class %(cls)s {\n%(members)s\n}",
        if_=_C_IF, for_=("for (int %(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "foreach (var %(var)s in %(coll)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN,
        vardecl=("int %(var)s = %(expr)s;", "var %(var)s = %(expr)s;"), comment="// %(words)s",
        imports=("using %(cls)s;",),
    ),
    "ruby": Templates(
        function="def %(name)s(%(params)s)\n%(body)s\nend", klass="class %(cls)s\n%(members)s\nend",
        if_=("if %(cond)s\n%(body)s\nend", "if %(cond)s\n%(body)s\nelse\n%(body2)s\nend"),
        for_=("for %(var)s in 0..%(n)s\n%(body)s\nend", "for %(var)s in %(coll)s\n%(body)s\nend"),
        while_=("while %(cond)s\n%(body)s\nend", "until %(cond)s\n%(body)s\nend"), return_="return %(expr)s",
        call=("%(fn)s(%(args)s)",), assign=("%(var)s = %(expr)s", "%(var)s += %(expr)s"), comment="# %(words)s",
    ),
    "lua": Templates(
        function="function %(name)s(%(params)s)\n%(body)s\nend",
        if_=("if %(cond)s then\n%(body)s\nend", "if %(cond)s then\n%(body)s\nelse\n%(body2)s\nend"),
        for_=("for %(var)s = 1, %(n)s do\n%(body)s\nend", "for _, %(var)s in ipairs(%(coll)s) do\n%(body)s\nend"),
        while_=("while %(cond)s do\n%(body)s\nend", "repeat\n%(body)s\nuntil %(cond)s"), return_="return %(expr)s",
        call=("%(fn)s(%(args)s)",), assign=("%(var)s = %(expr)s",), vardecl=("local %(var)s = %(expr)s",),
        comment="-- %(words)s",
    ),
    "php": Templates(
        function="function %(name)s(%(params)s) {\n%(body)s\n}", param="$%(p)s",
        klass="class %(cls)s {\n%(members)s\n}",
        if_=_C_IF, for_=("for (%(var)s = 0; %(var)s < %(n)s; %(var)s++) {\n%(body)s\n}",
                         "foreach (%(coll)s as %(var)s) {\n%(body)s\n}"),
        while_=_C_WHILE, return_="return %(expr)s;", call=_C_CALL, assign=_C_ASSIGN, comment="// %(words)s",
        imports=("use App\\%(cls)s;",), prelude="<?php\n", var="$%s",
    ),
    "verilog": Templates(
        function="function automatic integer %(name)s(%(params)s);\n  begin\n%(body)s\n  end\nendfunction",
        param="input integer %(p)s", methods_only=True, klass="module %(cls)s;\n%(members)s\nendmodule",
        if_=("if (%(cond)s) begin\n%(body)s\nend", "if (%(cond)s) begin\n%(body)s\nend else begin\n%(body2)s\nend"),
        for_=("for (%(var)s = 0; %(var)s < %(n)s; %(var)s = %(var)s + 1) begin\n%(body)s\nend",),
        while_=("while (%(cond)s) begin\n%(body)s\nend",), return_="return %(expr)s;",
        # A bare call to a user function is not a statement this grammar accepts.
        call=('$display("%%d", %(args)s);', "%(var)s = %(fn)s(%(args)s);"),
        assign=("%(var)s = %(expr)s;", "%(var)s <= %(expr)s;"), vardecl=("integer %(var)s = %(expr)s;",),
        decls_first=True,
        comment="// %(words)s", imports=('`include "%(mod)s.vh"',),
    ),
}

_WORDS = ("total", "count", "limit", "value", "index", "items", "result", "offset", "size", "next", "step",
          "delta", "score", "left", "right", "acc", "buf", "key", "node", "tmp")
_COMMENT_WORDS = ("sum", "the", "values", "check", "bounds", "skip", "empty", "keep", "order", "fast", "path")
_INDENT = "    "


def _indent(text: str) -> str:
    return "\n".join(_INDENT + line if line else line for line in text.split("\n"))


class _Writer:
    """Draws one program; all randomness comes from `rng`."""

    def __init__(self, templates: Templates, rng: random.Random):
        self.t, self.rng = templates, rng

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
        return self.t.string % self.rng.choice(_COMMENT_WORDS) if self.t is not TEMPLATES["verilog"] else "8'd7"

    def expr(self, names: list[str], calls: list[str]) -> str:
        roll = self.rng.random()
        if roll < 0.3:
            return self.atom(names)
        if roll < 0.85:
            return f"{self.atom(names)} {self.rng.choice('+-*')} {self.atom(names)}"
        return f"{self.rng.choice(calls)}({self.atom(names)})"

    def cond(self, names: list[str]) -> str:
        return f"{self.rng.choice(names)} {self.rng.choice(('<', '>', '==', '<=', '>='))} {self.rng.randint(0, 99)}"

    def fill(self, template: str, names: list[str], calls: list[str], depth: int, **extra) -> str:
        fields = {"var": self.rng.choice(names), "expr": self.expr(names, calls), "cond": self.cond(names),
                  "n": str(self.rng.randint(2, 64)), "coll": self.rng.choice(names), "fn": self.rng.choice(calls),
                  "args": ", ".join(self.atom(names) for _ in range(self.rng.randint(1, 3))),
                  "words": " ".join(self.rng.sample(_COMMENT_WORDS, 3))}
        if "%(body" in template:
            fields["body"] = _indent(self.block(names, calls, depth - 1))
            fields["body2"] = _indent(self.block(names, calls, depth - 1))
        fields.update(extra)
        return template % fields

    def block(self, names: list[str], calls: list[str], depth: int) -> str:
        t = self.t
        simple = [t.call, t.assign] + ([t.vardecl] if t.vardecl and not t.decls_first else [])
        compound = [t.if_, t.for_, t.while_] if depth > 0 else []
        lines = []
        for _ in range(self.rng.randint(1, 3)):
            choices = simple + compound + compound
            if self.rng.random() < 0.1:
                lines.append(self.fill(t.comment, names, calls, depth))
            lines.append(self.fill(self.rng.choice(self.rng.choice(choices)), names, calls, depth))
        return "\n".join(lines)

    def function(self, calls: list[str], method: bool) -> str:
        t = self.t
        params = [self.name() for _ in range(self.rng.randint(1, 3))]
        names = [t.var % p for p in params] + [t.var % self.name() for _ in range(2)]
        spelled = [t.param % {"p": p} for p in params]
        if method and t.self_param:
            spelled.insert(0, t.self_param)
        decls = [self.fill(t.vardecl[0], names, calls, 0) for _ in range(self.rng.randint(0, 2) if t.decls_first else 0)]
        body = "\n".join([*decls, self.block(names, calls, depth=2), self.fill(t.return_, names, calls, 0)])
        template = t.method if method and t.method else t.function
        return template % {"name": self.name(), "params": ", ".join(spelled), "body": _indent(body)}

    def program(self) -> str:
        t = self.t
        calls = [self.name() for _ in range(3)]
        parts = [t.prelude.rstrip("\n")] if t.prelude else []
        for _ in range(self.rng.randint(0, 2) if t.imports else 0):
            parts.append(self.rng.choice(t.imports) % {"mod": self.name(), "fn": calls[0], "cls": self.name(True)})
        if t.type_decl:
            parts.append(t.type_decl % {"cls": self.name(True)})
        in_type = t.klass is not None and (t.methods_only or self.rng.random() < 0.6)
        functions = [self.function(calls, in_type) for _ in range(self.rng.randint(1, 2))]
        if in_type:
            parts.append(t.klass % {"cls": self.name(True), "members": _indent("\n\n".join(functions))})
        else:
            parts.extend(functions)
        return "\n\n".join(parts) + "\n"


def program(language: str, seed: int) -> str:
    """A random program in `language` (a name of gemini_jax.code.LANGUAGES), fixed by `seed`.

    Raises ConfigError for a language without templates.
    """
    if language not in TEMPLATES:
        raise ConfigError(f"language={language!r} has no program templates; choose one of {sorted(TEMPLATES)}.")
    # The language is part of the seed so that one seed gives each language a different program shape.
    return _Writer(TEMPLATES[language], random.Random(f"{language}:{seed}")).program()


assert set(TEMPLATES) == set(LANGUAGES), "every supported language has program templates"
