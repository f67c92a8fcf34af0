"""The reference pages, generated from the code so that they cannot drift from it.

docs/cli.md comes from the click commands (every command, argument and option: type, default,
help) and docs/recipe.md from the recipe's pydantic schema (every key: type, constraints,
default, and the comment that documents it in exporter/recipe.py).

    python -m specexport.docs           # rewrite both pages (make docs)
    python -m specexport.docs --check   # exit 1 naming each page that differs from the code

tests/test_docs.py regenerates them and compares byte for byte.
"""

from __future__ import annotations

import ast
import inspect
import io
import sys
import tokenize
import types
import typing
from collections.abc import Callable
from pathlib import Path

import click
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

REPO = Path(__file__).resolve().parents[1]
DOCS = REPO / "docs"
_UNSET = click.Option(["--x"]).default  # click's "no default given" marker (None before click 8.3)
GENERATED = "generated from the code by `python -m specexport.docs` (`make docs`); do not edit by hand"


# --- shared helpers --------------------------------------------------------------------------


def _cell(text: str) -> str:
    """Text for one markdown table cell: one line, pipes escaped, and outside code spans the
    characters markdown would read as markup (an HTML tag's <, the * of *.onnx) escaped."""
    pieces = " ".join(text.split()).replace("|", "\\|").split("`")
    for i in range(0, len(pieces), 2):  # even pieces lie outside code spans
        pieces[i] = pieces[i].replace("<", "&lt;").replace("*", "\\*")
    return "`".join(pieces)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return lines


def _paragraphs(text: str) -> list[str]:
    """A docstring as markdown paragraphs: its lines joined, blank lines kept."""
    blocks = [" ".join(block.split()).replace("``", "`") for block in inspect.cleandoc(text).split("\n\n")]
    return [block for block in blocks if block]


# --- docs/cli.md -----------------------------------------------------------------------------


def _exit_codes() -> list[list[str]]:
    from specexport.errors import BadInput, SpecexportError

    return [
        ["0", "success"],
        [str(SpecexportError.exit_code), "a runtime failure; for `bench --baseline` a regression against the "
                                         "baseline, for `lint` a graph TensorRT would reject"],
        [str(BadInput.exit_code), "bad input: a recipe, path, argument or engine directory that is wrong, an "
                                  "optional package that is missing (the line names the extra), or a usage error"],
        ["130", "interrupted (Ctrl-C or SIGTERM): `build` and `distill` leave nothing half-written"],
    ]


def _range_text(kind: str, param_type) -> str:
    bounds = []
    if param_type.min is not None:
        bounds.append(f"{'>' if param_type.min_open else '≥'} {param_type.min}")
    if param_type.max is not None:
        bounds.append(f"{'<' if param_type.max_open else '≤'} {param_type.max}")
    return f"{kind}, {' and '.join(bounds)}"


def _param_type(param: click.Parameter) -> str:
    kind = param.type
    if isinstance(param, click.Option) and param.is_flag:
        return "flag"
    if isinstance(kind, click.Choice):
        return " | ".join(f"`{c}`" for c in kind.choices)
    if isinstance(kind, click.IntRange):
        return _range_text("integer", kind)
    if isinstance(kind, click.FloatRange):
        return _range_text("number", kind)
    names = {click.INT: "integer", click.FLOAT: "number", click.STRING: "text", click.BOOL: "boolean"}
    if kind in names:
        return names[kind]
    if isinstance(kind, click.Path):
        return "folder" if not kind.file_okay else "path"
    return kind.name


def _param_default(param: click.Parameter, ctx: click.Context) -> str:
    if param.required:
        return "required"
    default = param.get_default(ctx, call=False)
    if isinstance(param, click.Option) and param.is_flag:
        if param.secondary_opts:
            return f"`{param.opts[0] if default else param.secondary_opts[0]}`"
        return "off"
    if param.multiple or default is None or default == "" or default is _UNSET:
        return "–"
    return f"`{default}`"


def _option_names(option: click.Option) -> str:
    return " / ".join(f"`{name}`" for name in [*option.opts, *option.secondary_opts])


def _option_help(option: click.Option) -> str:
    notes = []
    if option.multiple and "repeatable" not in (option.help or "").lower():
        notes.append("Repeatable.")
    if isinstance(option.envvar, str) and option.envvar not in (option.help or ""):
        notes.append(f"Environment: `{option.envvar}`.")
    return " ".join([option.help or "", *notes]).strip()


def _command_section(name: str, command: click.Command, parent: click.Context) -> list[str]:
    ctx = click.Context(command, info_name=name, parent=parent)
    usage = command.get_usage(ctx).removeprefix("Usage: ")
    lines = [f"## `specexport {name}`", "", "```", usage, "```", ""]
    for paragraph in _paragraphs(command.help or ""):
        lines += [paragraph, ""]
    arguments = [p for p in command.params if isinstance(p, click.Argument)]
    if arguments:
        rows = [[f"`{p.human_readable_name}`", _param_type(p), "yes" if p.required else "no"]
                for p in arguments]
        lines += _table(["argument", "type", "required"], rows) + [""]
    options = [p for p in command.params if isinstance(p, click.Option)]
    rows = [[_option_names(p), _param_type(p), _param_default(p, ctx), _option_help(p)] for p in options]
    rows.append(["`-h` / `--help`", "flag", "off", "Show the command's help and exit."])
    lines += _table(["option", "type", "default", "description"], rows) + [""]
    return lines


def cli_page() -> str:
    from specexport.cli import cli

    root = click.Context(cli, info_name="specexport")
    commands = sorted(cli.commands.items())
    lines = [
        "# Command-line reference",
        "",
        f"<!-- {GENERATED} -->",
        "",
        *_paragraphs(cli.help or ""),
        "",
        "```",
        cli.get_usage(root).removeprefix("Usage: "),
        "```",
        "",
        "`specexport --version` prints the version; `-h` / `--help` works on every command. Every error is one "
        "line on stderr (`specexport: error: ...`), never a traceback (`SPECEXPORT_DEBUG=1` shows the "
        "traceback of an internal error).",
        "",
        "## Exit codes",
        "",
        *_table(["code", "meaning"], _exit_codes()),
        "",
        "## Commands",
        "",
        *_table(["command", "what it does"],
                [[f"[`{name}`](#specexport-{name})", command.get_short_help_str(limit=200)]
                 for name, command in commands]),
        "",
    ]
    for name, command in commands:
        lines += _command_section(name, command, root)
    return "\n".join(lines).rstrip() + "\n"


# --- docs/recipe.md --------------------------------------------------------------------------


def _field_comments(model: type[BaseModel]) -> dict[str, str]:
    """Each field's comment in the source, for the fields ``model`` and its bases declare (a
    subclass's comment wins)."""
    comments: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        if isinstance(cls, type) and issubclass(cls, BaseModel) and not cls.__module__.startswith("pydantic"):
            comments.update(_class_comments(inspect.getsource(cls)))
    return comments


def _class_comments(source: str) -> dict[str, str]:
    """{field: its comment} in one top-level class's source: the comment lines just above the
    field's line, then the comment at the end of it."""
    by_line = {tok.start[0]: _without_pragmas(tok.string.lstrip("#").strip())
               for tok in tokenize.generate_tokens(io.StringIO(source).readline) if tok.type == tokenize.COMMENT}
    lines = source.splitlines()
    comments = {}
    for node in ast.parse(source).body[0].body:  # type: ignore[attr-defined]
        if not (isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name)):
            continue
        above, line = [], node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#"):
            above.insert(0, by_line[line])
            line -= 1
        trailing = [by_line[n] for n in range(node.lineno, (node.end_lineno or node.lineno) + 1) if n in by_line]
        text = " ".join(" ".join([*above, *trailing]).split())
        if text:
            comments[node.target.id] = text
    return comments


def _without_pragmas(comment: str) -> str:
    """A comment less a tool's pragma before it (``type: ignore[...]  # the real note``)."""
    if comment.startswith("type: ignore"):
        return comment.partition("#")[2].strip()
    return comment


_SCALARS = {int: "integer", float: "number", bool: "boolean", str: "string", Path: "path", type(None): "null"}


def _type_text(annotation, anchors: dict[type, str]) -> tuple[str, list[str]]:
    """(the type in words, constraints carried by Annotated) for a field's annotation."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        inner, _ = _type_text(args[0], anchors)
        return inner, [c for meta in args[1:] for c in _constraints(getattr(meta, "metadata", [meta]))]
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args), []
    if origin in (typing.Union, types.UnionType):
        parts = [_type_text(a, anchors) for a in args]
        return " or ".join(p[0] for p in parts), [c for p in parts for c in p[1]]
    if origin is list:
        inner, constraints = _type_text(args[0], anchors)
        return f"list of {inner}", [f"each {c}" for c in constraints]
    if origin is dict:
        return f"mapping {_type_text(args[0], anchors)[0]} → {_type_text(args[1], anchors)[0]}", []
    if annotation in anchors:
        return f"[{annotation.__name__}](#{anchors[annotation]})", []
    return _SCALARS.get(annotation, getattr(annotation, "__name__", str(annotation))), []


def _constraints(metadata) -> list[str]:
    words = {"ge": "≥", "gt": ">", "le": "≤", "lt": "<"}
    found = []
    for meta in metadata:
        for attr, word in words.items():
            if getattr(meta, attr, None) is not None:
                found.append(f"{word} {getattr(meta, attr)}")
        if getattr(meta, "min_length", None) is not None:
            found.append(f"at least {meta.min_length} item{'s' * (meta.min_length > 1)}")
        if getattr(meta, "pattern", None) is not None:
            found.append(f"matches `{meta.pattern}`")
    return found


def _yaml_value(value) -> str:
    if value is None:
        return "null"
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, list):
        return "[" + ", ".join(_yaml_value(v) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k}: {_yaml_value(v)}" for k, v in value.items()) + "}"
    return str(value)


def _default_text(field: FieldInfo, anchors: dict[type, str]) -> str:
    if field.is_required():
        return "required"
    value = field.default_factory() if field.default_factory is not None else field.default  # type: ignore[call-arg]
    if value is PydanticUndefined:
        return "required"
    if isinstance(value, BaseModel):
        return f"its keys' defaults ([{type(value).__name__}](#{anchors[type(value)]}))"
    return f"`{_yaml_value(value)}`"


def _discriminator_text(name: str, field: FieldInfo) -> str | None:
    """The tag of a union's variant (`source: gguf`, `kind: eagle3`) describes itself."""
    values = typing.get_args(field.annotation) if typing.get_origin(field.annotation) is typing.Literal else ()
    if name in ("source", "kind") and len(values) == 1:
        return f"`{name}: {values[0]}` selects this {'model source' if name == 'source' else 'drafter'}"
    return None


def _model_section(model: type[BaseModel], key: str, anchors: dict[type, str]) -> list[str]:
    comments = _field_comments(model)
    lines = [f"### {model.__name__}", "", f"`{key}`", ""]
    doc = model.__doc__ if model.__doc__ and "__doc__" in vars(model) else ""
    lines += [*(p + "\n" for p in _paragraphs(doc))] if doc else []
    rows = []
    tags_first = sorted(model.model_fields.items(), key=lambda item: item[0] not in ("source", "kind"))
    for name, field in tags_first:
        kind, constraints = _type_text(field.annotation, anchors)
        constraints += _constraints(field.metadata)
        description = field.description or comments.get(name) or _discriminator_text(name, field)
        if not description:
            raise ValueError(f"exporter/recipe.py: {model.__name__}.{name} has no comment or description; "
                             "document it where it is declared")
        rows.append([f"`{name}`", kind + (f" ({', '.join(constraints)})" if constraints else ""),
                     _default_text(field, anchors), description])
    return lines + _table(["key", "type", "default", "description"], rows) + [""]


def _recipe_models() -> list[tuple[type[BaseModel], str]]:
    """Every schema class, with where it sits in a recipe, in reading order."""
    from specexport.exporter import recipe as r

    sources = [(r.GgufSource, "target: {source: gguf, ...}"), (r.HfSource, "target: {source: hf, ...}"),
               (r.TinySource, "target: {source: tiny, ...}")]
    # every spec of the recipe's drafter union, in its order: a new kind is documented as it is added
    drafters = [(spec, f"drafters: [{{kind: {typing.get_args(spec.model_fields['kind'].annotation)[0]}, ...}}]")
                for spec in typing.get_args(typing.get_args(r.DrafterSpec)[0])]
    sections = [(r.Shapes, "shapes"), (r.DraftPlan, "draft"), (r.TreePlan, "draft.tree"), (r.Quantization, "quantization"),
                (r.Validation, "validation"),
                (r.TensorRTSettings, "tensorrt")]
    return [(r.Recipe, "(top level)"), *sources, *drafters, *sections]


def recipe_page() -> str:
    from specexport.exporter import recipe as r

    models = _recipe_models()
    anchors = {model: model.__name__.lower() for model, _ in models}
    # the unions are named by their discriminator, pointing at each variant's section
    anchors_for_unions = {
        "target": " · ".join(f"[{m.__name__}](#{anchors[m]})" for m, k in models if k.startswith("target")),
        "drafters": " · ".join(f"[{m.__name__}](#{anchors[m]})" for m, k in models if k.startswith("drafters")),
    }
    example = (REPO / "recipes" / "smollm2-135m.yaml").read_text()
    lines = [
        "# Recipe reference",
        "",
        f"<!-- {GENERATED} -->",
        "",
        *(p + "\n" for p in _paragraphs(r.__doc__ or "")),
        "A recipe is a YAML mapping. `target` is one of the model sources below, chosen by its `source` key "
        f"({anchors_for_unions['target']}); each entry of `drafters` is one of the drafter kinds, chosen by its "
        f"`kind` key ({anchors_for_unions['drafters']}). Paths are relative to the recipe's folder.",
        "",
        "## The default recipe",
        "",
        "`recipes/smollm2-135m.yaml`:",
        "",
        "```yaml",
        example.rstrip(),
        "```",
        "",
        "## Keys",
        "",
    ]
    for model, key in models:
        lines += _model_section(model, key, anchors)
    return "\n".join(lines).rstrip() + "\n"


# --- the command -----------------------------------------------------------------------------


PAGES: dict[str, Callable[[], str]] = {"cli.md": cli_page, "recipe.md": recipe_page}


def stale_pages(docs: Path = DOCS) -> list[str]:
    """The pages whose committed text differs from what the code generates now."""
    return [name for name, render in PAGES.items()
            if not (docs / name).is_file() or (docs / name).read_text() != render()]


def main(argv: list[str] | None = None) -> int:
    args = sys.argv[1:] if argv is None else argv
    if args == ["--check"]:
        stale = stale_pages()
        for name in stale:
            print(f"docs/{name} is stale: run `make docs` (python -m specexport.docs)", file=sys.stderr)
        return 1 if stale else 0
    if args:
        print("usage: python -m specexport.docs [--check]", file=sys.stderr)
        return 2
    for name, render in PAGES.items():
        (DOCS / name).write_text(render())
        print(f"wrote docs/{name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
