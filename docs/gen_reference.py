"""The reference pages, generated from the code so that they cannot drift from it.

``config_reference()`` walks the job config's pydantic models (``pipelines/config/``) from
``JobConfig`` down, one section per model, one row per field: its name, type, default and
description. ``cli_reference()`` walks the argument parser of ``pipelines/cli.py``
(``build_parser()``), one section per subcommand. mkdocs.yml declares this file as a hook:
``on_files`` adds both pages to the site at build time (and CHANGELOG.md as the changelog
page), so nothing generated is kept in git.
``tests/test_docs.py`` checks that every field and every subcommand is in them.
"""

from __future__ import annotations

import argparse
import sys
import types
import typing
from pathlib import Path

from pydantic import BaseModel
from pydantic_core import PydanticUndefined

ROOT = Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

CONFIG_PAGE = "reference/config.md"
CLI_PAGE = "reference/cli.md"


# --- the config reference -------------------------------------------------------------------

def _models_in(annotation) -> list[type[BaseModel]]:
    """The pydantic models an annotation holds (through unions, lists, Annotated...)."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return [annotation]
    found = []
    for arg in typing.get_args(annotation):
        found += _models_in(arg)
    return found


def config_sections(root: type[BaseModel] | None = None) -> list[tuple[str, type[BaseModel]]]:
    """(the section's key path, its model) for every model reachable from JobConfig, in the
    order a config file names them; a model met again under another key gets its own section
    (``steps[].sampling`` is ``sampling``'s model, listed where it is used)."""
    if root is None:
        from pipelines.config import JobConfig
        root = JobConfig
    sections: list[tuple[str, type[BaseModel]]] = []

    def walk(path: str, model: type[BaseModel], seen: tuple) -> None:
        sections.append((path, model))
        for name, field in model.model_fields.items():
            inner = _models_in(field.annotation)
            list_like = typing.get_origin(_strip_optional(field.annotation)) is list
            for sub in inner:
                if sub in seen:
                    continue
                key = f"{path}.{name}" if path else name
                if list_like:
                    key += "[]"
                if len(inner) > 1:
                    kind = sub.model_fields.get("kind")
                    key += (f" (kind: {typing.get_args(kind.annotation)[0]})" if kind is not None
                            else f" ({sub.__name__})")
                walk(key, sub, seen + (sub,))

    walk("", root, (root,))
    return sections


def _strip_optional(annotation):
    args = typing.get_args(annotation)
    if typing.get_origin(annotation) in (typing.Union, types.UnionType) and type(None) in args:
        rest = [a for a in args if a is not type(None)]
        return rest[0] if len(rest) == 1 else annotation
    return annotation


def type_name(annotation) -> str:
    """A field's type as a config author reads it."""
    origin, args = typing.get_origin(annotation), typing.get_args(annotation)
    if origin is typing.Annotated:
        return type_name(args[0])
    if origin is typing.Literal:
        return " | ".join(f'`{a}`' if not isinstance(a, str) else f'`"{a}"`' for a in args)
    if origin in (typing.Union, types.UnionType):
        return " | ".join(type_name(a) for a in args)
    if origin in (list, tuple, set):
        return f"list[{', '.join(type_name(a) for a in args)}]"
    if origin is dict:
        return f"map[{', '.join(type_name(a) for a in args)}]"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return f"[{annotation.__name__}](#{annotation.__name__.lower()})"
    return getattr(annotation, "__name__", str(annotation))


def _constraints(field) -> str:
    words = {"gt": ">", "ge": "≥", "lt": "<", "le": "≤", "min_length": "at least",
             "max_length": "at most", "pattern": "matches"}
    found = []
    for meta in field.metadata:
        for attr, word in words.items():
            value = getattr(meta, attr, None)
            if value is not None:
                found.append(f"{word} `{value}`")
    return ", ".join(found)


def default_text(field) -> str:
    if field.is_required():
        return "**required**"
    if field.default_factory is not None:
        value = field.default_factory()
    else:
        value = field.default
    if value is PydanticUndefined:
        return "**required**"
    if isinstance(value, BaseModel):
        return "*(its section's defaults)*"
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    if isinstance(value, str):
        return f'`"{value}"`'
    return f"`{value!r}`"


def _cell(text: str) -> str:
    return " ".join(text.split()).replace("|", "\\|")


def config_reference() -> str:
    from pipelines.config import JobConfig
    out = ["# Config reference", "",
           "Generated from the pydantic models in `pipelines/config/` at build time "
           "(`docs/gen_reference.py`): it is the code's own list of every key. A job's YAML "
           "file has one section per top-level key; an unknown key is an error that names it, "
           "and any key can be set from the command line with `--set KEY=VALUE` (the value is "
           "YAML), e.g. `--set sampling.max_tokens=32`. Relative paths are relative to the "
           "directory `overnight` runs from.", ""]
    paths: dict[type[BaseModel], list[str]] = {}
    order: dict[type[BaseModel], int] = {}
    for i, (path, model) in enumerate(config_sections(JobConfig)):
        paths.setdefault(model, []).append(path)
    for model, where in paths.items():   # each model under its shortest key, in file order
        where.sort(key=lambda w: w.count("."))
    shortest = [p for p, _ in config_sections(JobConfig)]
    for model, where in sorted(paths.items(), key=lambda mw: shortest.index(mw[1][0])):
        key, _, kind = where[0].partition(" ")
        title = (f"`{key}` {kind}".strip() if key else "The job (top level)")
        out += [f"## {title} {{#{model.__name__.lower()}}}", ""]
        doc = (model.__doc__ or "").strip()
        if doc and not doc.startswith("!!!") and "A base class for" not in doc:
            out += [" ".join(doc.split()).replace("``", "`"), ""]
        also = "".join(f", `{w}`" for w in where[1:])
        out += [f"Model: `{model.__name__}`" + (f"; also used at {also[2:]}" if also else "")
                + ".", "", "| key | type | default | description |", "|---|---|---|---|"]
        for name, field in model.model_fields.items():
            desc = (field.description or "").replace("``", "`")
            extra = _constraints(field)
            if extra:
                desc = f"{desc} ({extra})" if desc else extra
            out.append(f"| `{name}` | {_cell(type_name(field.annotation))} | "
                       f"{default_text(field)} | {_cell(desc) or '—'} |")
        out.append("")
    return "\n".join(out)


# --- the CLI reference ----------------------------------------------------------------------

def subcommands(parser: argparse.ArgumentParser | None = None) -> dict[str, argparse.ArgumentParser]:
    if parser is None:
        from pipelines.cli import build_parser
        parser = build_parser()
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return dict(action.choices)
    return {}


def _help_of(parser: argparse.ArgumentParser) -> dict[str, str]:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            return {a.dest: a.help or "" for a in action._choices_actions}
    return {}


def _arguments(parser: argparse.ArgumentParser) -> list[str]:
    rows = ["| argument | default | help |", "|---|---|---|"]
    for action in parser._actions:
        if isinstance(action, (argparse._HelpAction, argparse._SubParsersAction)):
            continue
        if action.option_strings:
            name = ", ".join(f"`{o}`" for o in action.option_strings)
            if action.nargs != 0:
                name += f" `{action.metavar or action.dest.upper()}`"
        else:
            name = f"`{action.metavar or action.dest}`"
        default = action.default
        shown = ("—" if default in (None, False, [], argparse.SUPPRESS)
                 else f"`{default}`")
        if action.required:
            shown = "**required**"
        help_text = (action.help or "").replace("%(default)s", str(default))
        rows.append(f"| {name} | {shown} | {_cell(help_text) or '—'} |")
    return rows


def cli_reference() -> str:
    from pipelines.cli import build_parser
    parser = build_parser()
    parser.prog = "overnight"
    helps = _help_of(parser)
    out = ["# CLI reference", "",
           "Generated from the argument parser in `pipelines/cli.py` (`build_parser()`) at "
           "build time (`docs/gen_reference.py`). A user's mistake prints one line, "
           "`overnight: error: ...`, and exits with status 2; `--debug` (before the "
           "subcommand) shows the traceback.", "",
           "```", parser.format_usage().strip(), "```", "", "Options of `overnight` itself:", ""]
    out += _arguments(parser) + [""]
    for name, sub in subcommands(parser).items():
        out += [f"## `overnight {name}`", ""]
        if helps.get(name):
            out += [helps[name][0].upper() + helps[name][1:] + ".", ""]
        if sub.description:
            out += [" ".join(sub.description.split()), ""]
        out += ["```", sub.format_usage().strip().replace("usage: ", ""), "```", ""]
        out += _arguments(sub) + [""]
    return "\n".join(out)


# --- the mkdocs hook ------------------------------------------------------------------------

def on_files(files, config):
    from mkdocs.structure.files import File
    changelog = (ROOT / "CHANGELOG.md").read_text()
    for page, text in ((CONFIG_PAGE, config_reference()), (CLI_PAGE, cli_reference()),
                       ("changelog.md", changelog)):
        files.append(File.generated(config, page, content=text))
    return files


if __name__ == "__main__":
    print(config_reference() if sys.argv[1:] != ["cli"] else cli_reference())
