"""docs/knobs.md: every configuration field, rendered from the frozen dataclasses in gemini_jax/config/.

    python experiments/knobs.py            # rewrite docs/knobs.md
    python experiments/knobs.py --check    # exit 1 when docs/knobs.md is not what config/ renders to

One section per config: where it sits in a Hydra job (and which conf/ group presets it), the class
docstring as written, then one row per field with its type, its default and the comment written
beside it (or on the lines above it) in its module, else the comment beside it in its default conf/
preset. Values that conf/'s default presets set
differently from the dataclass defaults are listed at the end of each section, read from the YAML. Last,
the table of which features combine (`gemini_jax.config.compat`).
tests/test_results_files.py fails when the page and config/ disagree.
"""

from __future__ import annotations

import argparse
import ast
import dataclasses
import inspect
import io
import os
import sys
import textwrap
import tokenize
import typing

import yaml

from gemini_jax import config
from gemini_jax.config import compat

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
DOC = os.path.join("docs", "knobs.md")


@dataclasses.dataclass(frozen=True)
class Section:
    cls: type
    key: str  # the Hydra path of its fields (engine.cache -> engine.cache.block_size)
    where: str  # how a job selects or overrides it
    presets: tuple = ()  # (conf file, Hydra path the file lands at): the default presets, for their values


SECTIONS = (
    Section(config.EngineConfig, "engine", "`experiments/run.py` and `python -m gemini_jax.serve`: "
            "`engine.<field>=...`; Python: `gj.EngineConfig(...)`", (("engine/default.yaml", "engine"),)),
    Section(config.CacheConfig, "engine.cache", "`engine.cache.<field>=...`; Python: `gj.config.CacheConfig(...)`",
            (("engine/default.yaml", "engine"),)),
    Section(config.SparseConfig, "engine.sparse", "presets `sparse=<name>` (conf/sparse/), then "
            "`engine.sparse.<field>=...`; Python: `gj.config.SparseConfig(...)`",
            (("sparse/off.yaml", "engine.sparse"),)),
    Section(config.TierConfig, "engine.tier", "presets `tier=<name>` (conf/tier/), then `engine.tier.<field>=...`; "
            "Python: `gj.config.TierConfig(...)`", (("tier/all_device.yaml", "engine.tier"),)),
    Section(config.LinkConfig, "engine.tier.link_model", "`engine.tier.link_model.<field>=...` (with "
            "`engine.tier.link=emulate`)"),
    Section(config.MeshConfig, "engine.mesh", "`engine.mesh='{data: D, model: M}'` ([multihost.md](multihost.md))",
            (("engine/default.yaml", "engine"),)),
    Section(config.SamplingParams, "sampling", "`sampling.<field>=...`; Python: `gj.SamplingParams(...)`",
            (("sampling/default.yaml", "sampling"),)),
    Section(config.ServeConfig, "serve", "`python -m gemini_jax.serve serve.<field>=...` ([serving.md](serving.md))",
            (("serve/default.yaml", "serve"),)),
    Section(config.HardwareConfig, "hardware", "presets `hardware=<name>` (conf/hardware/), then "
            "`hardware.<field>=...` ([tiers.md](tiers.md))", (("hardware/cpu.yaml", "hardware"),)),
    Section(config.ModelConfig, "model", "presets `model=<name>` (conf/model/); the weights' own config "
            "when weights are loaded", (("model/tiny.yaml", "model"),)),
    Section(config.RopeConfig, "model.rope", "`model.rope.<field>` and `model.local_rope.<field>`"),
)

GROUPS = ("model", "hardware", "engine", "sparse", "tier", "sampling", "serve", "experiment")


def field_comments(cls) -> dict[str, str]:
    """Field name -> the comment beside it in its class body, after any comment lines just above it."""
    source, _ = inspect.getsourcelines(cls)
    text = textwrap.dedent("".join(source))
    comments = {}  # line (1-based within the class source) -> comment text
    for tok in tokenize.generate_tokens(io.StringIO(text).readline):
        if tok.type == tokenize.COMMENT:
            comments[tok.start[0]] = tok.string.lstrip("#").strip()
    lines = text.splitlines()
    out = {}
    for node in ast.parse(text).body[0].body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            continue
        above = []
        j = node.lineno - 1
        while j >= 1 and lines[j - 1].strip().startswith("#"):
            above.insert(0, comments[j])
            j -= 1
        inline = comments.get(node.lineno, "")
        out[node.target.id] = " ".join(above) + (f" ({inline})" if above and inline else inline)
    return out


def _default(f: dataclasses.Field) -> str:
    if f.default is not dataclasses.MISSING:
        return f"`{f.default!r}`"
    if f.default_factory is not dataclasses.MISSING:
        made = f.default_factory()
        return f"a `{type(made).__name__}` (its section)" if dataclasses.is_dataclass(made) else f"`{made!r}`"
    return "required"


def _type(tp) -> str:
    """A field's resolved type as one reads it: `Literal['xla', 'pallas']`, `Optional[int]`, `CacheConfig`."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        return f"Literal[{', '.join(repr(a) for a in args)}]"
    if origin is typing.Union and type(None) in args and len(args) == 2:
        return f"Optional[{_type(args[0] if args[1] is type(None) else args[1])}]"
    if origin is not None:
        inner = ", ".join("..." if a is Ellipsis else _type(a) for a in args)
        return f"{getattr(origin, '__name__', str(origin))}[{inner}]"
    return getattr(tp, "__name__", str(tp))


def _cell(text: str) -> str:
    return text.replace("|", "\\|")


def _flatten(data, prefix: str) -> dict:
    out = {}
    for k, v in data.items():
        if k == "defaults":
            continue
        path = f"{prefix}.{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, path))
        else:
            out[path] = v
    return out


def yaml_comments(path: str, at: str) -> dict[str, str]:
    """Dotted key (under `at`) -> the comment at the end of its line in the YAML file at `path`."""
    out, stack = {}, []  # stack: (indent, key) of the mappings the current line is inside
    with open(path) as fh:
        for line in fh:
            quoted = '"' in line or "'" in line  # a '#' may sit inside a quoted value: no comment read there
            body, _, comment = (line, "", "") if quoted else line.partition("#")
            if not body.strip() or body.lstrip().startswith("-") or ":" not in body:
                continue
            indent = len(line) - len(line.lstrip())
            while stack and stack[-1][0] >= indent:
                stack.pop()
            key, _, value = body.partition(":")
            if comment.strip():
                out[".".join([at, *[k for _, k in stack], key.strip()])] = comment.strip()
            if not value.strip():
                stack.append((indent, key.strip()))
    return out


def preset_values(section: Section, root: str) -> list[tuple[str, str, object, object]]:
    """(conf file, key, value there, dataclass default) for each field a default preset sets to another value
    than the dataclass default (required fields and nested configs aside: they have no default here)."""
    fields = {f"{section.key}.{f.name}": f for f in dataclasses.fields(section.cls)}
    rows = []
    for rel, at in section.presets:
        with open(os.path.join(root, "conf", rel)) as fh:
            data = yaml.safe_load(fh) or {}
        for key, value in _flatten(data, at).items():
            f = fields.get(key)
            if f is None or f.default is dataclasses.MISSING:
                continue
            default = list(f.default) if isinstance(f.default, tuple) else f.default
            if value != default:
                rows.append((rel, key, value, f.default))
    return rows


def render(root: str = ROOT) -> str:
    """The whole of docs/knobs.md."""
    lines = [
        "# Knobs",
        "",
        "Every configuration field, generated from the frozen dataclasses in",
        "[`gemini_jax/config/`](../gemini_jax/config/) (one module per concern) by `python experiments/knobs.py` (do",
        "not edit by hand; `tests/test_results_files.py` fails when this page and config/ disagree). Each config",
        "validates itself when it is built and names the field, the value and what is allowed when it refuses",
        "(`ConfigError`); which features combine is one table, [at the end](#which-features-combine).",
        "",
        "In a Hydra job (`experiments/run.py`, `python -m gemini_jax.serve`) every field is an override,",
        "`engine.sparse.budget=1024`; Hydra checks its type against a schema mirrored from these dataclasses",
        "(`gemini_jax.hydra_schema`) and the job validates it again. Preset groups under [`conf/`](../conf/):",
        "",
    ]
    for group in GROUPS:
        names = sorted(f[:-5] for f in os.listdir(os.path.join(root, "conf", group))
                       if f.endswith(".yaml") and f != "schema.yaml")
        lines.append(f"- `{group}=`: " + ", ".join(f"`{n}`" for n in names))
    lines += ["", "Defaults below are the dataclasses'; where a default preset of `conf/` sets another value, the",
              "section says so (a Hydra job starts from those presets, Python code from the dataclasses).", ""]
    lines += ["Sections: " + ", ".join(f"[`{s.key}`](#{s.key.replace('.', '')})" for s in SECTIONS)
              + ", [which features combine](#which-features-combine).", ""]
    for s in SECTIONS:
        lines += [f"## {s.key}", "", f"`{s.cls.__name__}` — {s.where}.", ""]
        doc = inspect.getdoc(s.cls) or ""
        lines += [doc, ""]
        notes = field_comments(s.cls)
        conf_notes = {}
        for rel, at in s.presets:
            for key, note in yaml_comments(os.path.join(root, "conf", rel), at).items():
                conf_notes.setdefault(key, f"{note} (conf/{rel})")
        hints = typing.get_type_hints(s.cls)
        lines += ["| field | type | default | note (its comment in config/, else in the conf/ preset; "
                  "the docstring above says the rest) |", "|---|---|---|---|"]
        for f in dataclasses.fields(s.cls):
            key = f"{s.key}.{f.name}"
            note = notes.get(f.name) or conf_notes.get(key, "")
            lines.append(f"| `{key}` | `{_cell(_type(hints[f.name]))}` | {_cell(_default(f))} | {_cell(note)} |")
        preset = preset_values(s, root)
        if preset:
            lines += ["", "Set otherwise by the default presets: " + "; ".join(
                f"`{key}={value!r}` in conf/{rel} (dataclass: {default!r})" for rel, key, value, default in preset)
                + "."]
        lines.append("")
    lines += ["## Which features combine", "", inspect.getdoc(compat).split("\n\n")[1].replace("\n", " "), "",
              "| checked | feature | does not run without |", "|---|---|---|"]
    lines += [f"| {_cell(where)} | `{_cell(r.feature)}` | {_cell(r.needs)} |" for where, r in compat.ROWS]
    lines.append("")
    return "\n".join(lines)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--check", action="store_true", help="exit 1 when docs/knobs.md differs from the render")
    args = ap.parse_args(argv)
    path = os.path.join(ROOT, DOC)
    text = render()
    same = os.path.exists(path) and open(path).read() == text
    if args.check:
        verdict = "up to date" if same else "differs from gemini_jax/config/: run python experiments/knobs.py"
        print(f"{DOC}: {verdict}")
        return 0 if same else 1
    if not same:
        with open(path, "w") as fh:
            fh.write(text)
    print(f"{DOC}: {'unchanged' if same else 'rewritten'}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
