"""Loading a job: YAML read in one place, ``--set`` overrides applied, and every validation
error turned into one line that names the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from types import UnionType
from typing import Annotated, Any, Union, get_args, get_origin

import yaml
from pydantic import BaseModel, ValidationError

from pipelines.config.job import JobConfig
from pipelines.errors import ConfigError, did_you_mean


def _format_validation_error(err: ValidationError, source: str,
                             overrides: list[str] = ()) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    if loc[:1] == ["engine"] and len(loc) > 1 and loc[1] in ("vllm", "http"):
        del loc[1]  # the union's tag, not a key the user wrote
    key = ".".join(str(p) for p in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        what = "unknown key" + did_you_mean(loc[-1], _known_keys(first["loc"]))
    elif first["type"] == "missing":
        what = "required key is missing"
    else:
        what = first["msg"]
        if "input" in first and not isinstance(first["input"], dict):
            what += f" (got {first['input']!r})"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if first["type"] == "value_error":  # our own checks: their message names the keys
        what = what.removeprefix("Value error, ")
        if not loc:
            return f"{source}: {what}{more}"
    given = _override_of(loc, overrides)
    if given is not None:  # the value came from the command line, not the file
        return f"--set {given}: {key}: {what}{more}"
    return f"{source}: {key}: {what}{more}"


def _override_of(loc: list, overrides: list[str]) -> str | None:
    """The last ``--set`` that gave the value at ``loc``: it, a section holding it, or a key
    under it (``--set promt.template=x`` made the unknown section ``promt``)."""
    path = [str(p) for p in loc]
    found = None
    for text in overrides:
        keys = text.partition("=")[0].strip().split(".")
        if path[:len(keys)] == keys or keys[:len(path)] == path:
            found = text
    return found


def _known_keys(loc: tuple) -> list[str]:
    """The keys the section holding ``loc``'s last part takes (an unknown key's
    neighbours, for a suggestion); [] where the path cannot be followed."""
    types: list = [JobConfig]
    for part in loc[:-1]:
        nested: list = []
        for kind in _members(types):
            if isinstance(kind, type) and issubclass(kind, BaseModel):
                field = kind.model_fields.get(str(part))
                if field is not None:
                    nested.append(field.annotation)
                elif part in get_args(getattr(kind.model_fields.get("kind"), "annotation",
                                              None)):
                    nested.append(kind)  # a tagged union's tag (engine: vllm | http)
            elif get_origin(kind) in (list, tuple) and isinstance(part, int):
                nested.extend(get_args(kind)[:1])
        types = nested
    keys = []
    for kind in _members(types):
        if isinstance(kind, type) and issubclass(kind, BaseModel):
            keys += [n for n, f in kind.model_fields.items()] + \
                [f.alias for f in kind.model_fields.values() if f.alias]
    return keys


def _members(types: list) -> list:
    """Each type with its Optional, union and Annotated wrappers taken off."""
    out = []
    for kind in types:
        origin = get_origin(kind)
        if origin is Annotated:
            out += _members([get_args(kind)[0]])
        elif origin in (Union, UnionType):
            out += _members(list(get_args(kind)))
        else:
            out.append(kind)
    return out


class DuplicateKey(yaml.YAMLError):
    """A mapping gives one key twice: YAML's own loaders keep the last value, silently."""

    def __init__(self, key, line: int):
        super().__init__(f"key {key!r} is given twice")
        self.key, self.line = key, line


class _UniqueKeyLoader(yaml.SafeLoader):
    """PyYAML's SafeLoader, refusing a mapping that gives one key twice (a merge key's
    ``<<: *defaults`` entries may still be overridden: that is what a merge is for)."""

    def construct_mapping(self, node, deep=False):
        if isinstance(node, yaml.MappingNode):
            seen = set()
            for key_node, _ in node.value:
                if key_node.tag == "tag:yaml.org,2002:merge":
                    continue
                key = self.construct_object(key_node, deep=True)
                try:
                    repeated = key in seen
                except TypeError:  # an unhashable key: SafeLoader says so itself
                    continue
                if repeated:
                    raise DuplicateKey(key, key_node.start_mark.line + 1)
                seen.add(key)
        return super().construct_mapping(node, deep=deep)


def load_yaml(text: str, source: str, lines: bool = True) -> Any:
    """YAML text as Python values, a key given twice refused; ConfigError, in one line
    naming ``source`` and (``lines``: a file's) the line: "job.yaml:7: key 'max_tokens' is
    given twice"."""
    try:
        return yaml.load(text, Loader=_UniqueKeyLoader)  # noqa: S506 - a SafeLoader
    except DuplicateKey as exc:
        where = f":{exc.line}" if lines else ""
        raise ConfigError(f"{source}{where}: {exc} (YAML would keep the last value "
                          "silently; give it once)") from None
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f":{mark.line + 1}" if mark and lines else ""
        problem = " ".join(str(getattr(exc, "problem", None) or exc).split())
        raise ConfigError(f"{source}{where}: {'not' if lines else 'value is not'} valid YAML: "
                          f"{problem}") from None


def read_yaml(path: str | Path) -> Any:
    """A YAML file's values (``load_yaml``); ConfigError in one line where it cannot be
    read. Every YAML a user writes is read through here (job configs, serve's and batch's
    --config)."""
    name = str(path)
    try:
        text = Path(path).read_text(encoding="utf-8")
    except FileNotFoundError:
        raise ConfigError(f"{name}: no such config file") from None
    except (OSError, UnicodeDecodeError) as exc:
        raise ConfigError(f"{name}: cannot read: {exc}") from None
    return load_yaml(text, name)


def parse_override(text: str) -> tuple[list[str], Any]:
    """'sampling.max_tokens=32' -> (['sampling', 'max_tokens'], 32); the value is YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. sampling.max_tokens=32")
    value = load_yaml(raw, f"--set {key}", lines=False) if raw.strip() else ""
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for depth, part in enumerate(path):
            if isinstance(node, list):  # steps.1.sampling.max_tokens: a list's item by index
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[:depth])} has "
                                      f"{len(node)} item(s); {part!r} is not one of their "
                                      "indices")
                part = int(part)
            if depth == len(path) - 1:
                node[part] = value
                break
            child = node[part] if isinstance(node, list) else node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {'.'.join(path)}: {path[depth]!r} is not a section")
            node = child
    return raw


def load_config(
    source: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()
) -> JobConfig:
    """Load a job config from a YAML path or a dict, apply ``--set`` overrides, validate."""
    if isinstance(source, dict):
        raw, name = dict(source), "config"
    else:
        name = str(source)
        raw = read_yaml(source)
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: expected a mapping of sections (input, model, ...)")
    raw = apply_overrides(_deep_copy(raw), list(overrides))
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, name, list(overrides))) from None


def _deep_copy(raw):
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    return [_deep_copy(v) for v in raw] if isinstance(raw, list) else raw
