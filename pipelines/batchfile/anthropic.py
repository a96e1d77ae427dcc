"""Anthropic's Message Batches files: ``{"custom_id", "params"}`` lines, Anthropic's results.

A line is one request of ``POST /v1/messages/batches``: ``custom_id`` and ``params``, the body
of a Messages API call (``model``, ``max_tokens``, ``messages``, ``system``, ``temperature``,
``top_p``, ``top_k``, ``stop_sequences``, ``metadata``). pipelines/batchfile/lines.py reads
the file; here ``params`` becomes a row of the prepared table (the same columns as an OpenAI
chat request: its messages as JSON, its max_tokens, its sampling), and the job's rows become
result lines as Anthropic writes them::

    {"custom_id": "a", "result": {"type": "succeeded", "message": {"id", "type": "message",
     "role": "assistant", "model", "content": [{"type": "text", "text"}], "stop_reason",
     "stop_sequence", "usage": {"input_tokens", "output_tokens"}}}}
    {"custom_id": "b", "result": {"type": "errored", "error": {"type": "error",
     "error": {"type": "invalid_request_error", "message"}}}}

One file holds every request's result, in line order (Anthropic has no error file). A parameter
overnight cannot honour (a server tool such as ``web_search_20250305``, ``thinking``, a
document block, a prefilled assistant turn) is that request's ``errored`` result naming it,
never silently ignored.

Tools, as vLLM's Anthropic server maps them to its chat path (vllm/entrypoints/anthropic/
serving.py): ``tools`` (``name``, ``description``, ``input_schema``) become function tools, and
``tool_choice`` ``auto``/``any``/``tool`` (with ``name``)/``none`` the chat choices auto/
required/named/none (``disable_parallel_tool_use: true``: ``parallel_tool_calls`` false); they
are then checked as an OpenAI line's tools are (udfs/rows/tool_calls.py). A tool's
``cache_control`` and ``strict`` are accepted and change nothing (a forced or ``any`` choice is
held to the schemas anyway; under ``auto`` nothing holds a call to its schema, as in vLLM). An
assistant's ``tool_use`` blocks become its ``tool_calls``; a user's ``tool_result`` blocks
become ``tool`` messages (their text blocks joined by newlines; ``is_error`` is not shown to
the template, as in vLLM), placed before the turn's other content. A ``tool_result`` whose
``tool_use_id`` no earlier ``tool_use`` block made is the request's error. A result's calls are
``tool_use`` blocks after its text (the text block left out when empty), its stop_reason
``tool_use``. A user turn's ``image``
blocks (base64, or a url fetched only where the config allows) go to a vision model as an
OpenAI request's ``image_url`` parts do.

``stop_reason``: ``max_tokens`` (the budget ran out), ``stop_sequence`` (one of the request's
``stop_sequences``, then named in ``stop_sequence``), else ``end_turn``. To know which sequence
stopped a request, the engine keeps it at the text's end (vLLM's
``include_stop_str_in_output``) and the result line strips it: the text is the same as an
OpenAI request's with ``stop``.
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from udfs.rows.tool_calls import ToolError, read_spec, tool_spec

KIND = "messages"  # the prepared table's kind of an Anthropic request
FORMAT = "anthropic"

# Params that change nothing overnight writes: accepted and ignored (a user id, a tier, prompt
# caching's marks: vLLM caches prefixes by itself)
IGNORED_PARAMS = {"metadata", "service_tier", "cache_control", "inference_geo", "speed"}
IGNORED_BLOCK_FIELDS = {"cache_control", "citations"}
# a client tool's fields (``strict`` and ``cache_control`` accepted, changing nothing: see above)
TOOL_FIELDS = {"type", "name", "description", "input_schema", "strict", "cache_control"}
# Anthropic's tool_choice types -> the chat path's choices (vLLM's _convert_tool_choice)
CHOICES = {"auto": "auto", "any": "required", "none": "none"}


class Params(BaseModel):
    """The Messages API parameters overnight honours."""

    model_config = ConfigDict(extra="forbid")
    model: str = Field(min_length=1)
    max_tokens: int = Field(gt=0)
    messages: list[dict[str, Any]] = Field(min_length=1)
    system: str | list[dict[str, Any]] | None = None
    temperature: float | None = Field(None, ge=0, le=1)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=0)
    stop_sequences: list[str] | None = None
    stream: bool | None = None
    # client tools and the choice among them: see _tools
    tools: list[Any] | None = None
    tool_choice: dict[str, Any] | None = None


class Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=64)
    params: dict[str, Any]


def is_anthropic(data: Any) -> bool:
    """A line of a Message Batches file (``custom_id`` and ``params``), not an OpenAI one."""
    return isinstance(data, dict) and "params" in data and not {"body", "url"} & set(data)


def parse_line(data: dict, reject, max_model_len: int | None = None,
               tool_parser: str | None = None) -> dict:
    """One line -> the prepared table's fields; ``reject(code, message)`` builds the
    exception for a line that cannot run. A ``max_tokens`` that leaves no room for a prompt
    in ``max_model_len`` is the request's error (it once became the whole job's cap, and
    the job refused it: every request of the file failed). ``tool_parser``: the job's
    model.tool_parser (a tool_choice other than none needs one)."""
    if not is_anthropic(data):
        raise reject("invalid_request", "an OpenAI Batch line (url, body) in a Message Batches "
                     "file; put it in a file of its own")
    try:
        line = Line.model_validate(data)
    except ValidationError as err:
        raise reject("invalid_request", _first(err, "")) from None
    raw = {k: v for k, v in line.params.items() if k not in IGNORED_PARAMS}
    try:
        params = Params.model_validate(raw)
    except ValidationError as err:
        first = err.errors()[0]
        if first["type"] == "extra_forbidden":
            key = ".".join(str(p) for p in first["loc"])
            raise reject("invalid_request", f"params.{key}: not supported by overnight, which "
                         "would have to ignore it; remove it") from None
        raise reject("invalid_request", _first(err, "params.")) from None
    if params.stream:
        raise reject("invalid_request", "params.stream: true is not supported in a batch")
    if max_model_len is not None and params.max_tokens >= max_model_len:
        raise reject("invalid_request", f"params.max_tokens {params.max_tokens} leaves no "
                     f"room for a prompt in max_model_len {max_model_len}")
    tools = _tools(params, reject, tool_parser)
    messages = []
    if params.system is not None:
        messages.append({"role": "system", "content": _text(params.system, "params.system",
                                                             reject, joined=True)})
    called: set[str] = set()  # the ids of the tool_use blocks so far
    for i, message in enumerate(params.messages):
        where = f"params.messages[{i}]"
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise reject("invalid_request", f"{where}.{extra[0]}: not supported by overnight, "
                         "which would have to ignore it; remove it")
        if message.get("role") not in ("user", "assistant"):
            raise reject("invalid_request", f"{where}.role: must be 'user' or 'assistant' "
                         "(the system prompt is params.system)")
        messages += _turn(message, where, reject, called)
    if messages[-1]["role"] == "assistant":
        raise reject("invalid_request", f"params.messages[{len(params.messages) - 1}]: a last "
                     "assistant turn (a prefill to continue) is not supported yet; end with "
                     "a user turn")
    # every request says it wants no logprobs (the job's column is there for OpenAI's)
    overrides: dict = {"logprobs": None, "n": 1}
    for key in ("temperature", "top_p", "top_k"):
        if getattr(params, key) is not None:
            overrides[key] = getattr(params, key)
    if params.stop_sequences:
        overrides["stop"] = params.stop_sequences
        overrides["include_stop_str_in_output"] = True  # which one stopped it: see above
    return {"kind": KIND, "prompt": json.dumps(messages, ensure_ascii=False),
            "max_tokens": params.max_tokens, "overrides": json.dumps(overrides),
            "model": params.model, "tools": tools}


def _tools(params: Params, reject, tool_parser: str | None) -> str | None:
    """The request's tools as the prepared table's tools value (udfs/rows/tool_calls.py:
    tool_spec; None: none), mapped as vLLM's _convert_tools and _convert_tool_choice map
    them; reject names what cannot run."""
    choice = params.tool_choice
    if params.tools is None:
        if choice is not None and choice.get("type") != "none":
            raise reject("invalid_request", "params.tool_choice: needs params.tools")
        return None
    functions = []
    for i, tool in enumerate(params.tools):
        at = f"params.tools[{i}]"
        if not isinstance(tool, dict):
            raise reject("invalid_request", f"{at}: must be a tool object (name, input_schema)")
        if tool.get("type") not in (None, "custom"):
            raise reject("invalid_request", f"{at}.type: {str(tool['type'])[:60]!r} is a server "
                         "tool, which overnight cannot run (only client tools, with name and "
                         "input_schema, are supported)")
        extra = sorted(set(tool) - TOOL_FIELDS)
        if extra:
            raise reject("invalid_request", f"{at}.{extra[0]}: not supported by overnight, "
                         "which would have to ignore it; remove it")
        if "input_schema" not in tool:
            raise reject("invalid_request", f"{at}.input_schema: a tool needs its input's "
                         "JSON Schema")
        if not isinstance(tool.get("strict", False), bool):
            raise reject("invalid_request", f"{at}.strict: must be true or false")
        functions.append({"type": "function", "function": {
            "name": tool.get("name"), "description": tool.get("description"),
            "parameters": tool["input_schema"]}})
    parallel = None
    if choice is not None:
        kind, name = choice.get("type"), choice.get("name")
        extra = sorted(set(choice) - {"type", "name", "disable_parallel_tool_use"})
        if extra or kind not in (*CHOICES, "tool") or (kind == "tool") != ("name" in choice):
            raise reject("invalid_request", "params.tool_choice: must be {\"type\": \"auto\"}, "
                         "{\"type\": \"any\"}, {\"type\": \"none\"} or {\"type\": \"tool\", "
                         "\"name\": ...}, with disable_parallel_tool_use beside it")
        if not isinstance(choice.get("disable_parallel_tool_use", False), bool):
            raise reject("invalid_request", "params.tool_choice.disable_parallel_tool_use: "
                         "must be true or false")
        parallel = not choice.get("disable_parallel_tool_use", False)
        choice = CHOICES.get(kind) or {"type": "function", "function": {"name": name}}
        if kind == "tool" and not isinstance(name, str):
            raise reject("invalid_request", "params.tool_choice.name: must be a tool's name")
    try:
        spec = tool_spec(functions, choice, parallel, "params")
    except ToolError as exc:  # in Anthropic's words for the fields
        message = str(exc).replace(".function.parameters", ".input_schema") \
            .replace(".function.name", ".name").replace(".function.description", ".description")
        raise reject("invalid_request", message) from None
    chosen = read_spec(spec)["tool_choice"]
    if chosen != "none" and tool_parser is None:
        shown = {"auto": "auto (the default with tools)", "required": "any"}.get(chosen, "tool") \
            if isinstance(chosen, str) else "tool"
        raise reject("invalid_request", f"params.tool_choice: {shown} needs a tool-call parser: "
                     "the operator runs this file with model.tool_parser (e.g. hermes) set")
    return spec


def _turn(message: dict, where: str, reject, called: set) -> list[dict]:
    """A user or assistant turn -> its chat messages, as vLLM's _convert_message_content
    makes them: an assistant's tool_use blocks its ``tool_calls``; each of a user's
    tool_result blocks a ``tool`` message, before a user message of the turn's other blocks
    (none where it has none). ``called``: the tool_use ids so far, this turn's added."""
    role, content = message["role"], message.get("content")
    calls: list[dict] = []
    results: list[dict] = []

    def tool_block(i: int, block: dict) -> None:
        at = f"{where}.content[{i}]"
        kind = block["type"]
        if (kind == "tool_use") != (role == "assistant"):
            raise reject("invalid_request", f"{at}: {kind} blocks go in "
                         + ("an assistant turn" if kind == "tool_use" else "a user turn"))
        if kind == "tool_use":
            calls.append(_tool_use(block, at, reject))
            called.add(block["id"])
        else:
            results.append(_tool_result(block, at, reject, called))

    text = _text(content, where + ".content", reject, images=role == "user", tools=tool_block)
    if role == "assistant":
        return [{"role": role, "content": text, **({"tool_calls": calls} if calls else {})}]
    return results + ([{"role": role, "content": text}] if text is not None else [])


def _tool_use(block: dict, where: str, reject) -> dict:
    """An earlier call (``tool_use``: id, name, input) as an assistant's tool call, its
    arguments ``json.dumps(input)`` (vLLM's _convert_tool_use_block)."""
    extra = sorted(set(block) - {"type", "id", "name", "input"} - IGNORED_BLOCK_FIELDS)
    if extra:
        raise reject("invalid_request", f"{where}.{extra[0]}: not supported by overnight")
    for key, kind, shown in (("id", str, "a string"), ("name", str, "a string"),
                             ("input", dict, "an object")):
        if not isinstance(block.get(key), kind) or kind is str and not block[key]:
            raise reject("invalid_request", f"{where}.{key}: must be {shown}")
    return {"id": block["id"], "type": "function",
            "function": {"name": block["name"], "arguments": json.dumps(block["input"])}}


def _tool_result(block: dict, where: str, reject, called: set) -> dict:
    """A ``tool_result`` block as a ``tool`` message (vLLM's _convert_user_tool_result): its
    text blocks joined by newlines; it must answer an earlier tool_use block."""
    extra = sorted(set(block) - {"type", "tool_use_id", "content", "is_error"}
                   - IGNORED_BLOCK_FIELDS)
    if extra:
        raise reject("invalid_request", f"{where}.{extra[0]}: not supported by overnight")
    call_id = block.get("tool_use_id")
    if not isinstance(call_id, str) or call_id not in called:
        raise reject("invalid_request", f"{where}.tool_use_id: {str(call_id)[:64]!r} answers "
                     "no earlier tool_use block")
    content = block.get("content", "")
    if isinstance(content, list):
        texts = []
        for j, part in enumerate(content):
            if not isinstance(part, dict) or part.get("type") != "text" \
                    or not isinstance(part.get("text"), str):
                raise reject("invalid_request", f"{where}.content[{j}]: only text blocks "
                             "(with a string text) are supported in a tool_result")
            texts.append(part["text"])
        content = "\n".join(texts)
    elif not isinstance(content, str):
        raise reject("invalid_request", f"{where}.content: a string or a list of text blocks")
    return {"role": "tool", "tool_call_id": call_id, "content": content}


def _first(err: ValidationError, prefix: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    return f"{prefix}{key}: {first['msg']}" if key else first["msg"]


def _text(content, where: str, reject, images: bool = False,
          tools=None, joined: bool = False) -> str | list[dict] | None:
    """A content (a string, or a list of text blocks) as the chat template takes it. With
    ``images`` (a user turn), ``image`` blocks too (``source`` base64 with its media_type, or
    a url): then the text and ``image_url`` parts in their order, as an OpenAI request's
    content is read (pipelines/batchfile/lines.py). ``tools(i, block)`` takes the tool_use
    and tool_result blocks; None where those were all the blocks."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise reject("invalid_request", f"{where}: must be a string or a list of content "
                     "blocks")
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
        if kind in ("tool_use", "tool_result") and tools is not None:
            tools(i, block)
            continue
        if kind == "image" and images:
            parts.append({"type": "image_url", "image_url": {
                "url": _image_url(block, f"{where}[{i}]", reject)}})
            continue
        if kind != "text":
            raise reject("invalid_request", f"{where}[{i}]: {kind or 'a non-text'} blocks "
                         "are not supported " + ("yet (text and image blocks are)" if images
                                                 else "here (text blocks are)"))
        extra = sorted(set(block) - {"type", "text"} - IGNORED_BLOCK_FIELDS)
        if extra or not isinstance(block.get("text"), str):
            key = extra[0] if extra else "text"
            raise reject("invalid_request", f"{where}[{i}].{key}: "
                         + ("not supported by overnight" if extra else "must be a string"))
        parts.append({"type": "text", "text": block["text"]})
    if not parts:
        return None
    # a system prompt's blocks joined, a turn's several texts kept as parts (the template's
    # content format joins or keeps them), as vLLM's Anthropic server converts them
    if all(part["type"] == "text" for part in parts) and (joined or len(parts) == 1):
        return "".join(part["text"] for part in parts)
    return parts


def _image_url(block: dict, where: str, reject) -> str:
    """An image block's source as a URL: ``data:`` for base64 data, else its url."""
    source = block.get("source")
    extra = sorted(set(block) - {"type", "source"} - IGNORED_BLOCK_FIELDS)
    if extra:
        raise reject("invalid_request", f"{where}.{extra[0]}: not supported by overnight")
    kind = source.get("type") if isinstance(source, dict) else None
    if kind == "base64" and isinstance(source.get("data"), str) \
            and str(source.get("media_type", "")).startswith("image/"):
        return f"data:{source['media_type']};base64,{source['data']}"
    if kind == "url" and str(source.get("url", "")).startswith(("http://", "https://")):
        return source["url"]
    raise reject("invalid_request", f"{where}.source: a base64 source (media_type image/..., "
                 "data) or a url source (an http(s) URL)")


def _id(prefix: str, custom_id, line: int) -> str:
    key = f"{custom_id}:{line}".encode("utf-8", "surrogatepass")  # any custom_id a line holds
    return f"{prefix}_{hashlib.sha1(key).hexdigest()[:24]}"


def succeeded(sample: dict, model: str, thinking: bool, message: dict | None = None) -> dict:
    """A request's row of the job -> its ``succeeded`` result line. ``message``: its content
    and ``tool_calls`` as an OpenAI chat result holds them (envelopes.chat_message), which
    become its blocks as vLLM's messages_full_converter makes them; None: the row's text. A
    call cut at max_tokens is what it wrote, as text, with stop_reason max_tokens; other
    arguments that are not a JSON object cannot be a ``tool_use`` block: the request's
    errored result names them."""
    message = message if message is not None else {"content": sample["text"]}
    text, stop, stop_sequence = message["content"], sample["finish_reason"], None
    calls = message.get("tool_calls") or []
    sequences = json.loads(sample["overrides"] or "{}").get("stop") or ()
    if stop == "length":
        reason = "max_tokens"
    else:
        # the longest of the sequences the text ends with (kept there by the engine)
        stop_sequence = max((s for s in sequences if text and text.endswith(s)), key=len,
                            default=None)
        reason = "end_turn" if stop_sequence is None else "stop_sequence"
    if stop_sequence is not None:
        text = text[:-len(stop_sequence)]
    if calls and stop != "length":  # a call made wins over a stop sequence, as in vLLM
        reason, stop_sequence = "tool_use", None
    content = []
    if thinking and sample.get("reasoning") is not None:
        content.append({"type": "thinking", "thinking": sample["reasoning"], "signature": ""})
    if text is not None and (text or not calls):
        content.append({"type": "text", "text": text})
    custom_id, line = sample["custom_id"], sample["line"]
    for i, call in enumerate(calls):
        try:
            arguments = json.loads(call["function"]["arguments"] or "{}")
        except (ValueError, RecursionError):
            arguments = None
        if not isinstance(arguments, dict) and stop == "length":
            # a call cut at max_tokens: what it wrote, as text, where the budget ran out
            cut = [{"type": "text", "text": c["function"]["arguments"] or ""} for c in calls[i:]]
            content = [*content, *cut]
            reason = "max_tokens"
            break
        if not isinstance(arguments, dict):
            return errored(custom_id, "invalid_tool_call", f"tool call {i} "
                           f"({call['function']['name'][:64]}): its arguments are not a JSON "
                           f"object (finish_reason {stop}), so no tool_use block can hold "
                           "them", line)
        content.append({"type": "tool_use", "id": call["id"], "name": call["function"]["name"],
                        "input": arguments})
    return {"custom_id": custom_id, "result": {"type": "succeeded", "message": {
        "id": _id("msg", custom_id, line), "type": "message", "role": "assistant",
        "model": model, "content": content, "stop_reason": reason,
        "stop_sequence": stop_sequence,
        "usage": {"input_tokens": sample["prompt_tokens"] or 0,
                  "output_tokens": sample["completion_tokens"] or 0}}}}


# overnight's error codes that are the request's own fault; any other is the engine's
REQUEST_ERRORS = {"invalid_json", "invalid_request", "invalid_body", "invalid_url",
                  "duplicate_custom_id", "model_not_found", "prompt_too_long",
                  "invalid_overrides", "render_error", "null_field", "unknown_adapter"}


def errored(custom_id, code: str, message: str, line: int) -> dict:
    """A request that could not run -> its ``errored`` result line, Anthropic's error object
    with overnight's code and the line in its message."""
    kind = "invalid_request_error" if code in REQUEST_ERRORS else "api_error"
    return {"custom_id": custom_id, "result": {"type": "errored", "error": {
        "type": "error", "error": {"type": kind, "message": f"{message} (line {line}, {code})"},
        "request_id": _id("req", custom_id, line)}}}


def unfinished(custom_id, kind: str, line: int) -> dict:
    """A request a stopped batch did not reach -> its ``canceled`` or ``expired`` result (or
    ``errored``, where the batch could not go on)."""
    if kind == "errored":
        return errored(custom_id, "batch_failed", "the batch stopped before this request ran",
                       line)
    return {"custom_id": custom_id, "result": {"type": kind}}


def count_results(path) -> dict:
    """An ended batch's results file, counted by result type."""
    counts: dict[str, int] = {}
    try:
        with open(path, encoding="utf-8") as lines:
            for line in lines:
                if line.strip():
                    kind = json.loads(line)["result"]["type"]
                    counts[kind] = counts.get(kind, 0) + 1
    except FileNotFoundError:
        pass
    return counts
