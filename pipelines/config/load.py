"""Loading a job: YAML read in one place, ``--set`` overrides applied, and every validation
error turned into one line that names the file and the key.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import yaml
from pydantic import ValidationError

from pipelines.config.job import JobConfig
from pipelines.errors import ConfigError


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    if loc[:1] == ["engine"] and len(loc) > 1 and loc[1] in ("vllm", "http"):
        del loc[1]  # the union's tag, not a key the user wrote
    key = ".".join(str(p) for p in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        what = "unknown key"
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
    return f"{source}: {key}: {what}{more}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """'sampling.max_tokens=32' -> (['sampling', 'max_tokens'], 32); the value is YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. sampling.max_tokens=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML: {exc.problem}") from None
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
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{name}: no such config file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{name}: cannot read: {exc}") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{name}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: expected a mapping of sections (input, model, ...)")
    raw = apply_overrides(_deep_copy(raw), list(overrides))
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, name)) from None


def _deep_copy(raw):
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    return [_deep_copy(v) for v in raw] if isinstance(raw, list) else raw
