"""Output parsing: constrained generations checked, and JSON parsed into typed Arrow columns.

Generation is constrained by the engine (JSON Schema, a choice, a regex), so a valid output is
the rule; a generation cut off at ``max_tokens`` is the usual exception. Such a row keeps its
raw text and gets a ``parse_error``; the job goes on. So does an output that is valid under the
schema but does not fit its column (an integer past int64, a lone surrogate, 1e400): nothing a
row holds stops the job.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass

import jsonschema
import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind

_INT64_MIN, _INT64_MAX = -(1 << 63), (1 << 63) - 1
_FLOAT_EXACT = 1 << 53  # integers up to this are exact in a float64; Arrow refuses others
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

    def check(self, arrays: bool = False) -> None:
        """Raise SchemaError naming what is wrong, before any engine starts. ``arrays``: the
        top level may be an array too (a step's, which may explode it into rows)."""
        if self.json_schema is not None:
            try:
                jsonschema.Draft202012Validator.check_schema(self.json_schema)
            except jsonschema.SchemaError as exc:
                path = "/".join(str(p) for p in exc.path) or "(top)"
                raise SchemaError(f"at {path}: {exc.message}") from None
            ref = outside_ref(self.json_schema)
            if ref is not None:
                raise SchemaError(f"$ref {ref[:80]!r} points outside the schema; only its own "
                                  "places (#/$defs/...) are followed")
            if self.json_schema.get("type") != "object" and not (
                    arrays and self.json_schema.get("type") == "array"):
                raise SchemaError("the top level must be an object (type: object)"
                                  + (" or an array" if arrays else ""))
            schema_to_arrow(self.json_schema)
        elif self.regex is not None:
            try:
                re.compile(self.regex)
            except re.error as exc:
                raise SchemaError(f"regex does not compile: {exc}") from None
        elif not self.choice:
            raise SchemaError("choice needs at least one value")


def outside_ref(schema) -> str | None:
    """The first ``$ref`` (or ``$dynamicRef``) of a schema that points outside it (a URL, a
    file), or None: a schema's references are its own ``#...`` places, never fetched."""
    stack = [schema]
    while stack:
        node = stack.pop()
        if isinstance(node, dict):
            for key, value in node.items():
                if key in ("$ref", "$dynamicRef") and isinstance(value, str) \
                        and not value.startswith("#"):
                    return value
                stack.append(value)
        elif isinstance(node, list):
            stack.extend(node)
    return None


def validator(schema: dict):
    """A validator for a schema that resolves its ``#...`` references only: nothing is fetched
    from a URL or read from a file (jsonschema's default registry would)."""
    import referencing

    return jsonschema.validators.validator_for(schema)(schema, registry=referencing.Registry())


class OutputParser:
    """``map_batches`` callable: checks each generated text against the spec, and for a
    JSON Schema adds the parsed value as a struct column. Never raises for what a row holds:
    whatever goes wrong with one output is that row's ``parse_error``."""

    def __init__(self, spec: StructuredSpec, output_column: str):
        self.spec, self.output_column = spec, output_column
        if spec.json_schema is not None:
            self.validator = validator(spec.json_schema)
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
            value = json.loads(text, parse_constant=_refuse_constant)
        except json.JSONDecodeError as exc:
            return None, f"output is not valid JSON ({exc.msg} at char {exc.pos})"
        except RecursionError:
            return None, "output is nested too deeply to read"
        except ValueError as exc:  # NaN/Infinity; an integer of more than 4,300 digits
            return None, f"output is not valid JSON ({_one_line(exc)})"
        error = next(iter(self.validator.iter_errors(value)), None)
        if error is not None:
            path = "/".join(str(p) for p in error.absolute_path) or "(top)"
            return None, f"output does not match the schema at {path}: {error.message[:200]}"
        problem = misfit(value, self.arrow_type)
        if problem is not None:
            return None, f"output does not fit its column: {problem}"
        return value, None

    def _parse_row(self, text: str):
        try:
            return self.parse(text)
        except Exception as exc:  # e.g. jsonschema's multipleOf on a huge int: the row's error
            return None, f"output could not be checked: {type(exc).__name__}: {_one_line(exc)}"

    def __call__(self, batch: pa.Table) -> pa.Table:
        texts = batch.column(self.output_column).to_pylist()
        kinds = batch.column(columns.ERROR_KIND).to_pylist()
        errors = batch.column(columns.ERROR).to_pylist()
        parsed = [None] * batch.num_rows
        for i, text in enumerate(texts):
            if text is None or kinds[i] is not None:
                continue
            parsed[i], error = self._parse_row(text)
            if error is not None:
                kinds[i], errors[i] = ErrorKind.PARSE, _utf8(error)
        if self.spec.json_schema is not None:
            values = self._to_arrow(parsed, kinds, errors)
        batch = batch.set_column(batch.schema.get_field_index(columns.ERROR_KIND),
                                 columns.ERROR_KIND, pa.array(kinds, pa.string()))
        batch = batch.set_column(batch.schema.get_field_index(columns.ERROR), columns.ERROR,
                                 pa.array(errors, pa.string()))
        if self.spec.json_schema is not None:
            batch = batch.append_column(self.spec.parsed_column, values)
        return batch

    def _to_arrow(self, parsed: list, kinds: list, errors: list) -> pa.Array:
        """The struct column; should Arrow still refuse a value ``misfit`` let through, that
        row (not the block) gets the parse error."""
        try:
            return pa.array(parsed, type=self.arrow_type)
        except Exception:  # whatever Arrow refuses: find the row, row by row
            pass
        for i, value in enumerate(parsed):
            try:
                pa.array([value], type=self.arrow_type)
            except Exception as exc:
                parsed[i], kinds[i] = None, ErrorKind.PARSE
                errors[i] = _utf8(f"output does not fit its column: {type(exc).__name__}: "
                                  f"{_one_line(exc)}")
        return pa.array(parsed, type=self.arrow_type)


def misfit(value, arrow_type: pa.DataType, where: str = "(top)") -> str | None:
    """Why a value valid under the schema cannot be stored in its Arrow column, or None.
    JSON has no bounds; int64, float64 and UTF-8 do."""
    if value is None:
        return None
    if pa.types.is_struct(arrow_type):
        if not isinstance(value, dict):
            return f"at {where}: expected an object"
        for field in arrow_type:
            path = field.name if where == "(top)" else f"{where}/{field.name}"
            problem = misfit(value.get(field.name), field.type, path)
            if problem is not None:
                return problem
        return None
    if pa.types.is_list(arrow_type):
        if not isinstance(value, list):
            return f"at {where}: expected an array"
        for i, item in enumerate(value):
            problem = misfit(item, arrow_type.value_type, f"{where}/{i}")
            if problem is not None:
                return problem
        return None
    if isinstance(value, bool) or pa.types.is_boolean(arrow_type):
        return None if isinstance(value, bool) and pa.types.is_boolean(arrow_type) \
            else f"at {where}: {type(value).__name__} in a {arrow_type} column"
    if pa.types.is_int64(arrow_type):
        if isinstance(value, float) and not value.is_integer():
            return f"at {where}: {value!r} is not an integer"
        if isinstance(value, (int, float)) and _INT64_MIN <= value <= _INT64_MAX:
            return None
        return f"at {where}: {_number_text(value)} is outside the 64-bit integer range"
    if pa.types.is_float64(arrow_type):
        if isinstance(value, float):
            return None if math.isfinite(value) else \
                f"at {where}: a number beyond the 64-bit float range"
        if isinstance(value, int) and (abs(value) <= _FLOAT_EXACT or _exact_float(value)):
            return None
        return f"at {where}: {_number_text(value)} has no exact 64-bit float"
    if pa.types.is_string(arrow_type):
        if not isinstance(value, str):
            return f"at {where}: {type(value).__name__} in a string column"
        try:
            value.encode("utf-8")
        except UnicodeEncodeError as exc:
            return f"at {where}: the string holds {value[exc.start]!r}, a lone surrogate " \
                "that UTF-8 cannot encode"
        return None
    return None  # schema_to_arrow makes no other type


def _exact_float(n: int) -> bool:
    try:
        return int(float(n)) == n
    except OverflowError:
        return False


def _number_text(n) -> str:
    """A number for an error line: Python will not print an int of more than 4,300 digits."""
    if isinstance(n, int) and n.bit_length() > 128:
        return f"an integer of {int(n.bit_length() * math.log10(2)) + 1} digits"
    return repr(n)


def _refuse_constant(name: str):
    raise ValueError(f"{name} is not a JSON number")


def _one_line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200]


def _utf8(text: str) -> str:
    """An error line Arrow can store: a lone surrogate quoted from the output is escaped."""
    return text.encode("utf-8", "backslashreplace").decode("utf-8")
