"""Output parsing: constrained generations checked, and JSON parsed into typed Arrow columns.

Generation is constrained by the engine (JSON Schema, a choice, a regex), so a valid output is
the rule; a generation cut off at ``max_tokens`` is the usual exception. Such a row keeps its
raw text and gets a ``parse_error``; the job goes on.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass

import jsonschema
import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind

_SCALARS = {"string": pa.string(), "integer": pa.int64(), "number": pa.float64(),
            "boolean": pa.bool_()}


class SchemaError(ValueError):
    """A JSON Schema that cannot be used: invalid, or not representable as a column."""


def schema_to_arrow(schema: dict, where: str = "$") -> pa.DataType:
    """The Arrow type of values valid under ``schema``: objects become structs, arrays
    lists, enums of strings strings. Everything is nullable."""
    kind = schema.get("type")
    if isinstance(kind, list):  # ["string", "null"]: nullable, which every Arrow field is
        kinds = [k for k in kind if k != "null"]
        if len(kinds) != 1:
            raise SchemaError(f"{where}: a union of types {kind} has no single column type")
        kind = kinds[0]
    if kind is None and "enum" in schema:
        values = schema["enum"]
        if all(isinstance(v, str) for v in values):
            return pa.string()
        raise SchemaError(f"{where}: an enum of mixed values has no single column type")
    if kind is None and "const" in schema:
        return schema_to_arrow({"type": _json_type(schema["const"])}, where)
    if kind in _SCALARS:
        return _SCALARS[kind]
    if kind == "array":
        items = schema.get("items")
        if not isinstance(items, dict):
            raise SchemaError(f"{where}: an array needs one 'items' schema")
        return pa.list_(schema_to_arrow(items, f"{where}[]"))
    if kind == "object":
        props = schema.get("properties")
        if not props:
            raise SchemaError(f"{where}: an object needs 'properties' to become a struct")
        return pa.struct([pa.field(name, schema_to_arrow(sub, f"{where}.{name}"))
                          for name, sub in props.items()])
    raise SchemaError(f"{where}: type {kind!r} is not supported (use string, integer, "
                      "number, boolean, array, object or a string enum)")


def _json_type(value) -> str:
    return {bool: "boolean", int: "integer", float: "number", str: "string"}.get(
        type(value), "string")


@dataclass(frozen=True)
class StructuredSpec:
    """One of: a JSON Schema, a list of choices, a regex. Picklable."""

    json_schema: dict | None = None
    choice: tuple[str, ...] | None = None
    regex: str | None = None
    parsed_column: str = "parsed"

    def engine_params(self) -> dict:
        """Keyword arguments of vLLM's StructuredOutputsParams."""
        if self.json_schema is not None:
            return {"json": self.json_schema}
        if self.choice is not None:
            return {"choice": list(self.choice)}
        return {"regex": self.regex}

    def check(self) -> None:
        """Raise SchemaError naming what is wrong, before any engine starts."""
        if self.json_schema is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(self.json_schema)
            except jsonschema.SchemaError as exc:
                path = "/".join(str(p) for p in exc.path) or "(top)"
                raise SchemaError(f"at {path}: {exc.message}") from None
            if self.json_schema.get("type") != "object":
                raise SchemaError("the top level must be an object (type: object)")
            schema_to_arrow(self.json_schema)
        elif self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise SchemaError(f"regex does not compile: {exc}") from None
        elif not self.choice:
            raise SchemaError("choice needs at least one value")


class OutputParser:
    """``map_batches`` callable: checks each generated text against the spec, and for a
    JSON Schema adds the parsed value as a struct column."""

    def __init__(self, spec: StructuredSpec, output_column: str):
        self.spec, self.output_column = spec, output_column
        if spec.json_schema is not None:
            self.validator = jsonschema.Draft202012Validator(spec.json_schema)
            self.arrow_type = schema_to_arrow(spec.json_schema)
        self.pattern = re.compile(spec.regex) if spec.regex is not None else None

    def parse(self, text: str):
        """-> (parsed value or None, error or None) for one generated text."""
        if self.spec.choice is not None:
            ok = text in self.spec.choice
            return None, None if ok else f"output {text[:80]!r} is not one of the choices"
        if self.pattern is not None:
            ok = self.pattern.fullmatch(text) is not None
            return None, None if ok else f"output {text[:80]!r} does not match the regex"
        try:
            value = json.loads(text)
        except json.JSONDecodeError as exc:
            return None, f"output is not valid JSON ({exc.msg} at char {exc.pos})"
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(top)"
            return None, f"output does not match the schema at {path}: {error.message[:200]}"
        return value, None

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(self.output_column).to_pylist()
        kinds = batch.column(columns.ERROR_KIND).to_pylist()
        errors = batch.column(columns.ERROR).to_pylist()
        parsed = [None] * batch.num_rows
        for i, text in enumerate(texts):
            if text is None or kinds[i] is not None:
                continue
            parsed[i], error = self.parse(text)
            if error is not None:
                kinds[i], errors[i] = ErrorKind.PARSE, error
        batch = batch.set_column(batch.schema.get_field_index(columns.ERROR_KIND),
                                 columns.ERROR_KIND, pa.array(kinds, pa.string()))
        batch = batch.set_column(batch.schema.get_field_index(columns.ERROR), columns.ERROR,
                                 pa.array(errors, pa.string()))
        if self.spec.json_schema is not None:
            batch = batch.append_column(self.spec.parsed_column,
                                        pa.array(parsed, type=self.arrow_type))
        return batch
