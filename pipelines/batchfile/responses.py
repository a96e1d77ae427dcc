"""OpenAI Batch lines with ``url: /v1/responses``: a Responses API request, answered in the
Responses API's shape.

A body's ``input`` (a string, or a list of messages whose content is a string or
``input_text``/``input_image`` parts), ``instructions`` (the system message, first),
``max_output_tokens``, ``temperature``, ``top_p`` and ``text.format`` (``json_schema`` with
its ``schema``, ``json_object``, ``text``) become a row of the prepared table, as a chat
request's do (pipelines/batchfile/lines.py): the same prompt through the same template, so its
greedy text equals the chat completion's. Its result body is a ``response`` object::

    {"id": "resp_...", "object": "response", "status": "completed", "output": [{"type":
     "message", "role": "assistant", "status": "completed", "content": [{"type":
     "output_text", "text": "...", "annotations": []}]}], "usage": {"input_tokens",
     "output_tokens", "total_tokens", ...}, ...}

``status`` is ``incomplete`` (with ``incomplete_details.reason: max_output_tokens``) when the
budget ran out. A field overnight cannot honour (a tool other than a function, such as
``web_search``; ``previous_response_id``, ``reasoning``, ``background``...) is the request's
error naming it, never silently ignored. The response echoes the request's sampling settings
and tools, but not its ``instructions`` (null).

Function tools, as vLLM's Responses server maps them to its chat path (vllm/entrypoints/openai/
responses/utils.py): ``tools`` (``{"type": "function", "name", "description", "parameters",
"strict"}``) become chat tools, ``tool_choice`` (none, auto, required, ``{"type": "function",
"name"}``) and ``parallel_tool_calls`` the chat request's, checked as an OpenAI chat line's are
(udfs/rows/tool_calls.py). Input items ``function_call`` (``call_id``, ``name``, ``arguments``)
join the assistant message before them as its ``tool_calls`` (or make one), and
``function_call_output`` (``call_id``, ``output``) items become ``tool`` messages; one whose
``call_id`` no earlier ``function_call`` made is the request's error. A result's output is a
message item when there is text, then one ``function_call`` item per call.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from udfs.rows.tool_calls import ToolError, read_spec, tool_spec

URL = "/v1/responses"
KIND = "responses"  # the prepared table's kind of such a request

# Fields that change nothing overnight writes: accepted and ignored.
IGNORED_FIELDS = {"metadata", "store", "user", "service_tier", "safety_identifier",
                  "prompt_cache_key"}
ROLES = {"user": "user", "assistant": "assistant", "system": "system", "developer": "system"}


class Body(BaseModel):
    """The Responses API fields overnight honours."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    text: dict[str, Any] | None = None
    stream: bool | None = None
    truncation: str | None = None
    # function tools and the choice among them: see _tools
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None


def parse_body(body: dict, reject, default_max_tokens: int | None, max_model_len: int,
               content, response_format, tool_parser: str | None = None) -> dict:
    """A ``/v1/responses`` body -> the prepared table's fields (kind, prompt, max_tokens,
    overrides, model, tools); ``reject(code, message)`` builds the exception for one that
    cannot run. ``content`` and ``response_format``: pipelines.batchfile.lines's readings of a
    chat request's message content and response_format. ``tool_parser``: the job's
    model.tool_parser (a tool_choice other than none needs one)."""
    try:
        parsed = Body.model_validate({k: v for k, v in body.items()
                                      if k not in IGNORED_FIELDS})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise reject("invalid_body", f"body.{key}: not supported by overnight, which "
                         "would have to ignore it; remove it") from None
        raise reject("invalid_body", f"body.{key}: {first['msg']}") from None
    if parsed.stream:
        raise reject("invalid_body", "body.stream: true is not supported in a batch")
    if parsed.truncation not in (None, "disabled"):
        raise reject("invalid_body", "body.truncation: only 'disabled' (a prompt too long is "
                     "the request's error)")
    messages = [{"role": "system", "content": parsed.instructions}] \
        if parsed.instructions is not None else []
    if isinstance(parsed.input, str):
        messages.append({"role": "user", "content": parsed.input})
    else:
        called: set[str] = set()  # the call_ids of the function_call items so far
        for i, item in enumerate(parsed.input):
            _add_item(messages, i, item, reject, content, called)
    tools = _tools(parsed, reject, tool_parser)
    if not messages or messages[-1]["role"] == "system":
        raise reject("invalid_body", "body.input: no message to answer")
    max_tokens = parsed.max_output_tokens or default_max_tokens
    if max_tokens is not None and max_tokens >= max_model_len:
        raise reject("invalid_body", f"max_output_tokens {max_tokens} leaves no room for a "
                     f"prompt in max_model_len {max_model_len}")
    overrides: dict = {"logprobs": None, "n": 1}
    for key in ("temperature", "top_p"):
        if getattr(parsed, key) is not None:
            overrides[key] = getattr(parsed, key)
    fmt = (parsed.text or {}).get("format")
    if tools is not None and read_spec(tools)["tool_choice"] != "none" \
            and isinstance(fmt, dict) and fmt.get("type") not in (None, "text"):
        raise reject("invalid_body", "body.text.format does not go with a tool_choice other "
                     "than none (the tool call is the output's format); remove one")
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise reject("invalid_body", "body.text.format must be an object")
        if fmt.get("type") == "json_schema":  # the schema sits in the format itself here
            fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        overrides.update(response_format(fmt, "body.text.format", "body.text.format.schema"))
    return {"kind": KIND, "prompt": json.dumps(messages, ensure_ascii=False),
            "max_tokens": max_tokens, "overrides": json.dumps(overrides),
            "model": parsed.model, "tools": tools}


def _tools(parsed: Body, reject, tool_parser: str | None) -> str | None:
    """The request's function tools as the prepared table's tools value (udfs/rows/
    tool_calls.py: tool_spec; None: none), each flat tool in the chat shape as vLLM's
    convert_tool_responses_to_completions_format makes it; reject names what cannot run."""
    choice = parsed.tool_choice
    if not parsed.tools:  # none, or [] (as a client may send): no tools
        if choice not in (None, "none", "auto"):
            raise reject("invalid_body", "body.tool_choice: needs body.tools")
        return None
    functions = []
    for i, tool in enumerate(parsed.tools):
        at = f"body.tools[{i}]"
        kind = tool.get("type") if isinstance(tool, dict) else None
        if kind != "function":
            shown = f"{kind[:40]!r} tools are" if isinstance(kind, str) else "this tool is"
            raise reject("invalid_body", f"{at}.type: {shown} not supported by overnight "
                         "(function tools are)")
        extra = sorted(set(tool) - {"type", "name", "description", "parameters", "strict"})
        if extra:
            raise reject("invalid_body", f"{at}.{extra[0]}: not supported by overnight, "
                         "which would have to ignore it; remove it")
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool.get("parameters")}})
    if isinstance(choice, dict):
        if choice.get("type") != "function" or set(choice) != {"type", "name"}:
            raise reject("invalid_body", "body.tool_choice: must be none, auto, required or "
                         "{\"type\": \"function\", \"name\": ...}")
        choice = {"type": "function", "function": {"name": choice["name"]}}
    elif choice is not None and choice not in ("none", "auto", "required"):
        raise reject("invalid_body", "body.tool_choice: must be none, auto, required or "
                     "{\"type\": \"function\", \"name\": ...}")
    try:
        spec = tool_spec(functions, choice, parsed.parallel_tool_calls, "body")
    except ToolError as exc:  # in the Responses API's words for the fields
        message = str(exc).replace(".function.", ".")
        raise reject("invalid_body", message.replace("\"function\": {\"name\": ...}}",
                                                     "\"name\": ...}")) from None
    chosen = read_spec(spec)["tool_choice"]
    if chosen != "none" and tool_parser is None:
        shown = chosen if isinstance(chosen, str) else "a named function"
        raise reject("invalid_body", f"body.tool_choice: {shown} needs a tool-call parser: "
                     "the operator runs this file with model.tool_parser (e.g. hermes) set")
    return spec


def _add_item(messages: list[dict], index: int, item: dict, reject, content_of,
              called: set) -> None:
    """An input item onto the chat messages, as vLLM's _construct_message_from_response_item
    adds it: a ``function_call`` joins the assistant message before it (or makes one), an
    assistant message's text fills one made of calls; ``called``: the call_ids so far."""
    where = f"body.input[{index}]"
    kind = item.get("type", "message")
    last = messages[-1] if messages and messages[-1]["role"] == "assistant" else None
    if kind == "function_call":
        call = _function_call(item, where, reject)
        called.add(call["id"])
        if last is not None:
            last.setdefault("tool_calls", []).append(call)
        else:
            messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        return
    if kind == "function_call_output":
        extra = sorted(set(item) - {"type", "call_id", "output", "id", "status"})
        if extra:
            raise reject("invalid_body", f"{where}.{extra[0]}: not supported by overnight, "
                         "which would have to ignore it; remove it")
        call_id = item.get("call_id")
        if not isinstance(call_id, str) or call_id not in called:
            raise reject("invalid_body", f"{where}.call_id: {str(call_id)[:64]!r} answers no "
                         "earlier function_call item")
        if not isinstance(item.get("output"), str):
            raise reject("invalid_body", f"{where}.output: must be a string")
        messages.append({"role": "tool", "tool_call_id": call_id, "content": item["output"]})
        return
    message = _message(index, item, reject, content_of)
    if message["role"] == "assistant" and last is not None and last["content"] is None:
        last["content"] = message["content"]
        return
    messages.append(message)


def _function_call(item: dict, where: str, reject) -> dict:
    """A ``function_call`` item (call_id, name, arguments: JSON text) as an assistant's tool
    call; its ``id`` and ``status`` (an earlier output's, sent back) change nothing."""
    extra = sorted(set(item) - {"type", "call_id", "name", "arguments", "id", "status"})
    if extra:
        raise reject("invalid_body", f"{where}.{extra[0]}: not supported by overnight, which "
                     "would have to ignore it; remove it")
    for key in ("call_id", "name", "arguments"):
        if not isinstance(item.get(key), str) or key != "arguments" and not item[key]:
            raise reject("invalid_body", f"{where}.{key}: must be a "
                         + ("string (the arguments as JSON)" if key == "arguments"
                            else "non-empty string"))
    return {"id": item["call_id"], "type": "function",
            "function": {"name": item["name"], "arguments": item["arguments"]}}


def _message(index: int, item: dict, reject, content_of) -> dict:
    where = f"body.input[{index}]"
    if item.get("type", "message") != "message":
        raise reject("invalid_body", f"{where}.type: {str(item.get('type'))[:40]!r} items "
                     "are not supported (message, function_call and function_call_output "
                     "are)")
    extra = sorted(set(item) - {"type", "role", "content"})
    if extra:
        raise reject("invalid_body", f"{where}.{extra[0]}: not supported by overnight, which "
                     "would have to ignore it; remove it")
    role = ROLES.get(item.get("role")) if isinstance(item.get("role"), str) else None
    if role is None:
        raise reject("invalid_body", f"{where}.role: one of user, assistant, system, developer")
    content = item.get("content")
    if isinstance(content, str):
        return {"role": role, "content": content}
    if not isinstance(content, list) or not content:
        raise reject("invalid_body", f"{where}.content: a string or a list of content parts")
    parts = []
    for j, part in enumerate(content):
        kind = part.get("type") if isinstance(part, dict) else None
        if kind in ("input_text", "output_text") and isinstance(part.get("text"), str):
            parts.append({"type": "text", "text": part["text"]})
        elif kind == "input_image" and isinstance(part.get("image_url"), str):
            # as a chat request's image_url part (pipelines/batchfile/lines.py checks the URL)
            parts.append({"type": "image_url", "image_url": {"url": part["image_url"]}})
        else:
            shown = kind if isinstance(kind, str) and kind else "a"
            raise reject("invalid_body", f"{where}.content[{j}]: {shown[:40]} part not "
                         "supported (input_text, output_text, input_image with image_url)")
    try:
        return {"role": role, "content": content_of(parts, f"{where}.content")}
    except ValueError as exc:
        raise reject("invalid_body", str(exc)) from None


def result_body(sample: dict, model: str, created: int, message: dict | None = None) -> dict:
    """A request's row of the job -> its ``response`` object. ``message``: its content and
    ``tool_calls`` as an OpenAI chat result holds them (envelopes.chat_message), which become
    its output items as vLLM's build_response_output_items makes them; None: the row's
    text."""
    custom_id, line = sample["custom_id"], sample["line"]
    message = message if message is not None else {"content": sample["text"]}
    calls = message.get("tool_calls") or []
    incomplete = sample["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    overrides = json.loads(sample["overrides"] or "{}")
    schema = overrides.get("json_schema")
    spec = read_spec(sample.get("tools"))  # the prepared table's tools column
    prompt_tokens = sample["prompt_tokens"] or 0
    completion = sample["completion_tokens"] or 0
    output = []
    if message["content"] or not calls:  # a message item where there is text
        output.append({"type": "message", "id": _id("msg", custom_id, line), "status": status,
                       "role": "assistant", "content": [{"type": "output_text",
                                                         "text": message["content"] or "",
                                                         "annotations": []}]})
    output += [{"type": "function_call", "id": _id("fc", f"{custom_id}:{i}", line),
                "call_id": call["id"], "name": call["function"]["name"],
                "arguments": call["function"]["arguments"], "status": "completed"}
               for i, call in enumerate(calls)]
    return {
        "id": _id("resp", custom_id, line), "object": "response", "created_at": created,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": sample["max_tokens"], "model": model,
        "output": output,
        # without tools, the API's defaults (the request's own values changed nothing)
        "parallel_tool_calls": spec["parallel_tool_calls"] if spec else True,
        "temperature": overrides.get("temperature", 1.0),
        "top_p": overrides.get("top_p", 1.0), "tool_choice": _choice(spec),
        "tools": [{"type": "function", "name": t["function"]["name"],
                   "description": t["function"]["description"],
                   "parameters": t["function"]["parameters"], "strict": None}
                  for t in (spec or {}).get("tools", ())],
        "text": {"format": {"type": "json_schema", "name": "response", "schema": schema,
                            "strict": True} if schema else {"type": "text"}},
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0,
                                                           "cache_write_tokens": 0},
                  "output_tokens": completion,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion},
        "metadata": {}}


def _choice(spec: dict | None):
    """A tool spec's choice as the Responses API writes it ("none" without tools)."""
    if spec is None:
        return "none"
    choice = spec["tool_choice"]
    return choice if isinstance(choice, str) else {"type": "function",
                                                   "name": choice["function"]["name"]}


def _id(prefix: str, custom_id, line: int) -> str:
    key = f"{custom_id}:{line}".encode("utf-8", "surrogatepass")  # any custom_id a line holds
    return f"{prefix}_{hashlib.sha1(key).hexdigest()[:24]}"
