"""A request's tools: the functions a model may call, checked and held as one JSON value
(``tools``, ``tool_choice``, ``parallel_tool_calls``), the way a job, a Batch line and the
engine all read them; and the Arrow type of the calls a row made."""

from __future__ import annotations

import functools
import json

import pyarrow as pa

from udfs.rows.parsers import outside_ref, validator

CHOICES = ("none", "auto", "required")
# a function's fields; ``strict`` is accepted and changes nothing (a named or required choice
# is always held to the schema)
FUNCTION_FIELDS = {"name", "description", "parameters", "strict"}
# the tool_calls column: one entry per call, its arguments as the model wrote them (JSON text)
TOOL_CALL_TYPE = pa.struct([("id", pa.string()), ("name", pa.string()),
                            ("arguments", pa.string())])
TOOL_CALLS_TYPE = pa.list_(TOOL_CALL_TYPE)


class ToolError(ValueError):
    """What is wrong with a request's tools, in one line that names the field."""


def function_tools(tools, where: str = "tools") -> list[dict]:
    """The tools as the chat template and vLLM's parsers read them, each ``{"type":
    "function", "function": {"name", "description", "parameters"}}`` as vLLM's request model
    dumps it (``description`` and ``parameters`` None where not given; other fields, such as
    ``strict``, dropped). ToolError names the first tool that is not one."""
    if not isinstance(tools, list) or not tools:
        raise ToolError(f"{where}: must be a non-empty list of function tools")
    out, names = [], set()
    for i, tool in enumerate(tools):
        at = f"{where}[{i}]"
        if not isinstance(tool, dict) or tool.get("type") != "function":
            raise ToolError(f"{at}: only tools of type 'function' are supported")
        function = tool.get("function")
        if not isinstance(function, dict):
            raise ToolError(f"{at}.function: must be an object with the function's name")
        extra = sorted({*(f".{k}" for k in set(tool) - {"type", "function"}),
                        *(f".function.{k}" for k in set(function) - FUNCTION_FIELDS)})
        if extra:
            raise ToolError(f"{at}{extra[0][:80]}: not supported by overnight, which would "
                            "have to ignore it; remove it")
        name = function.get("name")
        if not isinstance(name, str) or not name:
            raise ToolError(f"{at}.function.name: must be a non-empty string")
        if name in names:
            raise ToolError(f"{at}.function.name: {name[:64]!r} is declared twice")
        names.add(name)
        description = function.get("description")
        if description is not None and not isinstance(description, str):
            raise ToolError(f"{at}.function.description: must be a string")
        parameters = function.get("parameters")
        if parameters is not None:
            check_schema(parameters, f"{at}.function.parameters")
        out.append({"type": "function", "function": {"name": name, "description": description,
                                                     "parameters": parameters}})
    return out


def check_schema(schema, where: str) -> None:
    """A function's parameters: a JSON Schema object (any draft its ``$schema`` names)."""
    import jsonschema

    if not isinstance(schema, dict):
        raise ToolError(f"{where}: must be a JSON Schema object")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(map(str, exc.path)) or "the top level"
        raise ToolError(f"{where}: not a valid JSON Schema: at {at}: {exc.message}"[:300]) \
            from None
    except Exception as exc:  # noqa: BLE001 - a schema the checker itself cannot walk
        raise ToolError(f"{where}: not a JSON Schema the checker can read "
                        f"({type(exc).__name__})") from None
    ref = outside_ref(schema)
    if ref is not None:
        raise ToolError(f"{where}: $ref {ref[:80]!r} points outside the schema; only its own "
                        "places (#/$defs/...) are followed")


def tool_choice(choice, tools: list[dict], where: str = "tool_choice"):
    """The choice as vLLM reads it: "none", "auto", "required", or ``{"type": "function",
    "function": {"name": N}}`` naming a declared tool (a plain name is taken for that)."""
    if choice is None:
        return "auto"  # tools without a choice: auto, as in OpenAI's API and vLLM
    if isinstance(choice, str) and choice in CHOICES:
        return choice
    name = choice if isinstance(choice, str) else (
        (choice.get("function") or {}).get("name")
        if isinstance(choice, dict) and choice.get("type") == "function"
        and isinstance(choice.get("function"), dict) else None)
    if not isinstance(name, str):
        raise ToolError(f"{where}: must be none, auto, required or "
                        "{\"type\": \"function\", \"function\": {\"name\": ...}}")
    declared = [t["function"]["name"] for t in tools]
    if name not in declared:
        raise ToolError(f"{where}: names {name[:64]!r}, which is not one of the declared "
                        f"tools ({', '.join(declared)[:200]})")
    return {"type": "function", "function": {"name": name}}


def tool_spec(tools, choice=None, parallel_tool_calls=None, where: str = "") -> str:
    """A request's tools checked and written as the one JSON value the renderer and the engine
    read (``GenerationRequest.tools``); ToolError names what is wrong."""
    prefix = f"{where}." if where else ""
    checked = function_tools(tools, f"{prefix}tools")
    if parallel_tool_calls is not None and not isinstance(parallel_tool_calls, bool):
        raise ToolError(f"{prefix}parallel_tool_calls: must be true or false")
    return json.dumps({"tools": checked,
                       "tool_choice": tool_choice(choice, checked, f"{prefix}tool_choice"),
                       "parallel_tool_calls": parallel_tool_calls is not False},
                      ensure_ascii=False)


@functools.lru_cache(maxsize=256)
def row_spec(value: str | None) -> str | None:
    """A tools column's value (JSON ``{tools, tool_choice, parallel_tool_calls}``) checked and
    written as ``tool_spec`` writes it (None: no tools); ToolError says what is wrong."""
    if not value:
        return None
    try:
        given = json.loads(value)
    except (ValueError, RecursionError):
        raise ToolError("not JSON: a tools value is {tools, tool_choice, "
                        "parallel_tool_calls}") from None
    if not isinstance(given, dict) or set(given) - {"tools", "tool_choice",
                                                   "parallel_tool_calls"}:
        raise ToolError("must be a JSON object of tools, tool_choice and parallel_tool_calls")
    return tool_spec(given.get("tools"), given.get("tool_choice"),
                     given.get("parallel_tool_calls"))


def read_spec(value: str | None) -> dict | None:
    """A tool spec written by ``tool_spec`` (None: no tools)."""
    return json.loads(value) if value else None


def forced_name(spec: dict) -> str | None:
    """The function a spec forces (a named choice), or None."""
    choice = spec.get("tool_choice")
    return choice["function"]["name"] if isinstance(choice, dict) else None


def calls_expected(spec: dict | None) -> bool:
    """Whether the request must call a tool: a named or ``required`` choice."""
    return spec is not None and (spec["tool_choice"] == "required" or forced_name(spec) is not None)


def parameters_of(spec: dict, name: str) -> dict | None:
    """The JSON Schema of a declared function's parameters (None: none given)."""
    for tool in spec["tools"]:
        if tool["function"]["name"] == name:
            return tool["function"]["parameters"]
    return None


def call_problem(spec: dict, calls: list[dict]) -> str | None:
    """Why a request's calls do not answer it, in one line, or None: a named or required
    choice that made no call; a call to an undeclared function; arguments that are not a JSON
    object or do not match the function's parameters."""
    if not calls:
        return (f"no tool call in the output (tool_choice {_choice_text(spec)} needs one)"
                if calls_expected(spec) else None)
    declared = {t["function"]["name"]: t["function"]["parameters"] for t in spec["tools"]}
    for i, call in enumerate(calls):
        if call["name"] not in declared:
            return f"tool call {i} names {str(call['name'])[:64]!r}, which is not a declared tool"
        try:
            arguments = json.loads(call["arguments"] or "{}")
        except (ValueError, RecursionError):
            return f"tool call {i} ({call['name']}): its arguments are not valid JSON"
        if not isinstance(arguments, dict):
            return f"tool call {i} ({call['name']}): its arguments are not a JSON object"
        schema = declared[call["name"]]
        if schema:
            error = next(iter(validator(schema).iter_errors(arguments)), None)
            if error is not None:
                at = "/".join(str(p) for p in error.absolute_path) or "(top)"
                return (f"tool call {i} ({call['name']}): its arguments do not match the "
                        f"function's parameters at {at}: {error.message[:200]}")
    return None


def _choice_text(spec: dict) -> str:
    name = forced_name(spec)
    return repr(name) if name is not None else repr(spec["tool_choice"])
