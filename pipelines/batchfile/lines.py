"""A Batch file's lines read: each line's JSON checked (``custom_id``, ``method``, ``url``,
``body``) and made one row of the prepared table of requests, or a ``Reject`` that names
why it cannot run (a code and a message, for its error line)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from pipelines.batchfile import anthropic
from pipelines.batchfile import embeddings
from pipelines.batchfile import responses
from pipelines.errors import one_line
from udfs.rows.tool_calls import ToolError, read_spec, tool_spec

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Sampling fields a body may set beside temperature, top_p, n, seed and stop: OpenAI's
# penalties and vLLM's extensions (udfs/stages/row_overrides.py: RowOverrides carries them to the engine).
EXTRA_SAMPLING = ("presence_penalty", "frequency_penalty", "ignore_eos", "top_k",
                  "min_tokens", "repetition_penalty", "stop_token_ids", "logit_bias")

# Columns of the prepared table of requests. TOOLS: a chat request's tools, as one JSON
# value (udfs/rows/tool_calls.py: tool_spec), null for a request without.
CUSTOM_ID, LINE, KIND, PROMPT, MAX_TOKENS, OVERRIDES, MODEL, TOOLS = (
    "custom_id", "line", "kind", "prompt", "max_tokens", "overrides", "model", "tools")
SCHEMA = pa.schema([(CUSTOM_ID, pa.string()), (LINE, pa.int64()), (KIND, pa.string()),
                    (PROMPT, pa.string()), (MAX_TOKENS, pa.int64()), (OVERRIDES, pa.string()),
                    (MODEL, pa.string()), (TOOLS, pa.string())])


# Body fields that change nothing overnight writes: accepted and ignored. Any field not
# here and not a field of _Body is that request's error, never silently dropped (a body
# with ignore_eos: true once ran as if it had not asked).
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "safety_identifier",
                  "prompt_cache_key", "stream_options"}


class Reject(ValueError):
    """A line that cannot run: its error line's code and one-line message (a key or value
    quoted from the line is cut short, its line breaks made spaces)."""

    def __init__(self, code: str, message: str):
        message = " ".join(message.split()) if "\n" in message or "\r" in message \
            else message
        message = message if len(message) <= 400 else message[:399] + "…"
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, None


def load_line(raw: str | bytes):
    """A line's JSON, or Reject ``invalid_json`` for anything ``json.loads`` refuses: bad
    syntax, a nesting too deep for it (RecursionError), an integer of over 4,300 digits."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise Reject("invalid_json", f"not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise Reject("invalid_json", "not valid JSON: nested too deeply") from None
    except ValueError as exc:  # Python's limit on an integer's digits
        raise Reject("invalid_json", f"not valid JSON: {one_line(exc, 200, typed=True)}") from None


def numbered_lines(path: Path):
    """(line number, raw bytes) of each line of a file that is not blank, counted from 1."""
    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if raw.strip():
                yield number, raw


def file_format(requests: Path) -> str:
    """"anthropic" for a Message Batches file, else "openai": the first line that is a JSON
    object says (``custom_id`` and ``params``, or ``url`` and ``body``)."""
    with open(requests, "rb") as source:
        for raw in source:
            try:
                data = load_line(raw)
            except Reject:  # not JSON (nested too deep for it included): the next line
                continue
            if isinstance(data, dict):
                return anthropic.FORMAT if anthropic.is_anthropic(data) else "openai"
    return "openai"


def parse_request(raw: str, default_max_tokens: int | None, max_model_len: int,
                  fmt: str = "openai", tool_parser: str | None = None) -> dict:
    """One line -> one row of the prepared table; raises Reject (code, message, the line's
    custom_id when it could be read) if it cannot run. ``default_max_tokens`` None: a request
    without max_tokens may use the room its prompt leaves (its row's max_tokens is null until
    ``prepare`` has counted the prompt). ``fmt`` "anthropic": a Message Batches line.
    ``tool_parser``: the job's model.tool_parser (a tool_choice other than none needs one).

    Whatever a line holds, it is that line's Reject or its row, never another exception:
    one bad value once raised out of ``prepare`` and failed the whole file."""
    data = load_line(raw)
    if not isinstance(data, dict):
        raise Reject("invalid_request", "a line must be a JSON object")
    custom_id = data.get("custom_id")
    try:
        if fmt == anthropic.FORMAT:
            row = {CUSTOM_ID: custom_id, **anthropic.parse_line(data, Reject, max_model_len,
                                                                   tool_parser)}
        elif anthropic.is_anthropic(data):
            raise Reject("invalid_request", "a Message Batches line (custom_id, params) in "
                         "an OpenAI Batch file; put it in a file of its own")
        else:
            row = _parse(data, default_max_tokens, max_model_len, tool_parser)
        _check_text(row)
        return row
    except Reject as reject:
        reject.custom_id = custom_id if isinstance(custom_id, str) else None
        raise
    except Exception as exc:  # noqa: BLE001 - a value no check foresaw: this line's error
        reject = Reject("invalid_request", f"cannot be read: {one_line(exc, 200, typed=True)}")
        reject.custom_id = custom_id if isinstance(custom_id, str) else None
        raise reject from None


def _check_text(row: dict) -> None:
    """Every text of the row is UTF-8: a lone surrogate (a JSON escape such as ``\\ud800``
    that pairs with nothing) once failed the prepared table's write, for every line."""
    for key, value in row.items():
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError as exc:
                where = {PROMPT: "the prompt", OVERRIDES: "a sampling field",
                         MODEL: "body.model"}.get(key, key)
                raise Reject("invalid_body" if key != CUSTOM_ID else "invalid_request",
                             f"{where}: holds {value[exc.start]!r}, a lone surrogate, "
                             "which is not text") from None


def _parse(data: dict, default_max_tokens: int | None, max_model_len: int,
           tool_parser: str | None = None) -> dict:
    try:
        line = _Line.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(line)"
        raise Reject("invalid_request", f"{key}: {first['msg']}") from None
    if line.url == embeddings.URL:  # pipelines/batchfile/embeddings.py
        fields = embeddings.parse_body(line.body, lambda m: Reject("invalid_body", m))
        return {CUSTOM_ID: line.custom_id, KIND: embeddings.KIND, MAX_TOKENS: 0, **fields}
    if line.url == responses.URL:  # pipelines/batchfile/responses.py
        return {CUSTOM_ID: line.custom_id, **responses.parse_body(
            line.body, Reject, default_max_tokens, max_model_len, _content,
            _response_format, tool_parser)}
    kind = URLS.get(line.url)
    if kind is None:
        raise Reject("invalid_url", f"url {line.url!r} is not supported; use one of "
                     + ", ".join([*URLS, responses.URL, embeddings.URL]))
    try:
        body = _Body.model_validate(line.body)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise Reject("invalid_body", f"body.{key}: not supported by overnight, which "
                         "would have to ignore it; remove it") from None
        raise Reject("invalid_body", f"body.{key}: {first['msg']}") from None
    tools = _tools(body, kind, tool_parser)
    if kind == "chat":
        if not body.messages:
            raise Reject("invalid_body", "body.messages is required for /v1/chat/completions")
        messages = [_message(i, m) for i, m in enumerate(body.messages)]
        check_tool_turns(messages, lambda m: Reject("invalid_body", m))
    else:
        if body.prompt is None or isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise Reject("invalid_body", "body.prompt must be one string for /v1/completions")
        messages = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    # JSON either way: a list is chat messages, a string a raw prompt (see udfs/stages/prompts.py)
    prompt = json.dumps(messages, ensure_ascii=False)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    if max_tokens is not None and max_tokens >= max_model_len:
        raise Reject("invalid_body", f"max_tokens {max_tokens} leaves no room for a prompt "
                     f"in max_model_len {max_model_len}")
    # every request says whether it wants logprobs (null: no), over the job's default
    overrides: dict = {"logprobs": body.top_logprobs_of(kind)}
    for key in ("temperature", "top_p", "n", "seed", *EXTRA_SAMPLING):
        if getattr(body, key) is not None:
            overrides[key] = getattr(body, key)
    if body.stop is not None:
        overrides["stop"] = [body.stop] if isinstance(body.stop, str) else body.stop
    if body.response_format is not None:
        overrides.update(_response_format(body.response_format))
    return {CUSTOM_ID: line.custom_id, KIND: kind, PROMPT: prompt, MAX_TOKENS: max_tokens,
            OVERRIDES: json.dumps(overrides), MODEL: body.model, TOOLS: tools}


def _tools(body: _Body, kind: str, tool_parser: str | None) -> str | None:
    """A body's tools as the prepared table's TOOLS value (None: none), checked as vLLM's
    server checks them, in its words where it has them; Reject where they cannot run."""
    if body.tools is None:
        if body.tool_choice not in (None, "none"):
            raise Reject("invalid_body", "body.tool_choice: when using `tool_choice`, "
                         "`tools` must be set")
        return None
    if kind != "chat":
        raise Reject("invalid_body", "body.tools: tools are for /v1/chat/completions")
    try:
        spec = tool_spec(body.tools, body.tool_choice, body.parallel_tool_calls, "body")
    except ToolError as exc:
        raise Reject("invalid_body", str(exc)) from None
    choice = read_spec(spec)["tool_choice"]
    if choice != "none" and tool_parser is None:
        shown = choice if isinstance(choice, str) else "a named function"
        raise Reject("invalid_body", f"body.tool_choice: {shown} needs a tool-call parser: "
                     "the operator runs this file with model.tool_parser (e.g. hermes) set")
    if choice != "none" and body.response_format is not None \
            and body.response_format.get("type") not in (None, "text"):
        raise Reject("invalid_body", "body.response_format does not go with a tool_choice "
                     "other than none (the tool call is the output's format); remove one")
    return spec


def check_tool_turns(messages: list[dict], error) -> None:
    """A conversation's tool turns hold together: each tool message answers a call an earlier
    assistant turn made (its tool_call_id); ``error(message)`` is raised where one does not."""
    called: set = set()
    for i, message in enumerate(messages):
        for call in message.get("tool_calls") or ():
            called.add(call.get("id"))
        if message["role"] == "tool" and message.get("tool_call_id") not in called:
            raise error(f"body.messages[{i}].tool_call_id: "
                        f"{str(message.get('tool_call_id'))[:64]!r} answers no earlier "
                        "assistant tool call")


class _Body(BaseModel):
    """The request body fields overnight honours: OpenAI's, and vLLM's extra sampling
    parameters as vLLM's own run_batch takes them."""

    model_config = ConfigDict(extra="forbid")
    model: str | None = None
    messages: list[dict[str, Any]] | None = None
    prompt: str | list[str] | None = None
    max_tokens: int | None = Field(None, gt=0)
    max_completion_tokens: int | None = Field(None, gt=0)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    n: int | None = Field(None, ge=1, le=128)
    seed: int | None = Field(None, ge=-(1 << 63), lt=1 << 63)  # OpenAI's: an int64
    stop: str | list[str] | None = None
    response_format: dict[str, Any] | None = None
    # function tools, checked in _tools (udfs/rows/tool_calls.py)
    tools: list[Any] | None = None
    tool_choice: str | dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    stream: bool | None = None
    # chat: true/false, with top_logprobs; completions: the number of alternatives
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token ids (as JSON keys) to a bias from -100 to 100 (udfs/stages/row_overrides.py checks)
    logit_bias: dict[str, float] | None = None
    # vLLM's extensions
    ignore_eos: bool | None = None
    top_k: int | None = Field(None, ge=-1)
    min_tokens: int | None = Field(None, ge=0)
    repetition_penalty: float | None = Field(None, gt=0, le=2)
    stop_token_ids: list[int] | None = None

    @field_validator("logit_bias", mode="before")
    @classmethod
    def _bias(cls, value):
        from udfs.stages.row_overrides import check_logit_bias

        value = check_logit_bias(value)
        for token in value if isinstance(value, dict) else ():
            # ASCII digits an int64 holds: "²" passes str.isdigit and int() refuses it
            if not (token.isascii() and token.isdigit() and len(token) <= 18):
                raise ValueError(f"{token[:20]!r} is not a token id")
        return value

    @model_validator(mode="before")
    @classmethod
    def _drop_ignored(cls, data):
        return {k: v for k, v in data.items() if k not in IGNORED_FIELDS} \
            if isinstance(data, dict) else data

    @model_validator(mode="after")
    def _checks(self) -> _Body:
        if self.stream:
            raise ValueError("stream: true is not supported in a batch")
        return self

    def top_logprobs_of(self, kind: str) -> int | None:
        """The logprobs this request asks for, as top alternatives per token (None: none);
        raises Reject for a shape its endpoint does not take."""
        if kind == "chat":
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise Reject("invalid_body", "body.logprobs must be true or false for "
                             "/v1/chat/completions (top_logprobs says how many)")
            if self.top_logprobs is not None and not self.logprobs:
                raise Reject("invalid_body", "body.top_logprobs needs body.logprobs: true")
            return (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None:
            raise Reject("invalid_body", "body.top_logprobs is for /v1/chat/completions; "
                         "/v1/completions takes body.logprobs: N")
        if isinstance(self.logprobs, bool) or not 0 <= (self.logprobs or 0) <= 20:
            raise Reject("invalid_body", "body.logprobs must be an integer from 0 to 20 "
                         "for /v1/completions")
        return self.logprobs


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


def _message(index: int, message: dict) -> dict:
    """A chat message as the prompt renderer takes it: role and content, an assistant's
    ``tool_calls`` (its content may then be null) and a tool message's ``tool_call_id``. Its
    other fields (``name``...) would reach no template, so a message that sets one is the
    request's error, as an unknown body field is, never dropped silently."""
    where = f"body.messages[{index}]"
    if "role" not in message:
        raise Reject("invalid_body", f"{where}: no 'role'")
    role = message["role"]
    allowed = {"role", "content", *({"tool_calls"} if role == "assistant" else ()),
               *({"tool_call_id"} if role == "tool" else ())}
    extra = sorted(set(message) - allowed)
    if extra:
        raise Reject("invalid_body", f"{where}.{extra[0]}: not supported by overnight, "
                     "which would have to ignore it; remove it")
    if not isinstance(role, str) or not role:
        raise Reject("invalid_body", f"{where}.role: must be a string such as 'user'")
    out = {"role": role}
    if role == "tool" and not isinstance(message.get("tool_call_id"), str):
        raise Reject("invalid_body", f"{where}.tool_call_id: a tool message needs the id "
                     "of the call it answers")
    if message.get("tool_call_id") is not None:
        out["tool_call_id"] = message["tool_call_id"]
    if message.get("tool_calls"):
        out["tool_calls"] = _tool_calls(message["tool_calls"], f"{where}.tool_calls")
    try:
        content = message.get("content")
        out["content"] = (None if content is None and "tool_calls" in out
                          else _content(content, f"{where}.content"))
    except ValueError as exc:
        raise Reject("invalid_body", str(exc)) from None
    return out


def _tool_calls(calls, where: str) -> list[dict]:
    """An assistant's earlier calls: each {id, type: function, function: {name, arguments
    (JSON text)}}, as OpenAI's API takes them."""
    if not isinstance(calls, list):
        raise Reject("invalid_body", f"{where}: must be a list of tool calls")
    out = []
    for i, call in enumerate(calls):
        function = call.get("function") if isinstance(call, dict) else None
        if not isinstance(function, dict) or call.get("type", "function") != "function" \
                or not isinstance(call.get("id"), str) \
                or not isinstance(function.get("name"), str) \
                or not isinstance(function.get("arguments", ""), str):
            raise Reject("invalid_body", f"{where}[{i}]: must be {{id, type: function, "
                         "function: {name, arguments (a JSON string)}}")
        out.append({"id": call["id"], "type": "function",
                    "function": {"name": function["name"],
                                 "arguments": function.get("arguments", "")}})
    return out


def _content(content, where: str = "content") -> str | list[dict]:
    """A message's content: a string; one text part's text; or its text parts (and, where it
    holds images, its ``image_url`` parts: a ``data:`` or http(s) URL each; ``detail`` is
    accepted and, as in vLLM, has no effect) in their order. ValueError names the part
    (``where``)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not all(isinstance(p, dict) for p in content):
        raise ValueError(f"{where}: must be a string or a list of content parts")
    for i, part in enumerate(content):  # each part's fields checked before they are used
        if part.get("type") not in ("text", "image_url"):
            raise ValueError(f"{where}[{i}]: parts of type {str(part.get('type'))[:40]!r} "
                             "are not supported (text and image_url are)")
        if part["type"] == "text" and not isinstance(part.get("text", ""), str):
            raise ValueError(f"{where}[{i}].text: must be a string")
    if all(p["type"] == "text" for p in content):
        texts = [p.get("text", "") for p in content]
        # several texts stay parts, which the template's content format joins (a newline
        # between them, for a string-format template) or keeps, as vLLM's chat path does
        return texts[0] if len(texts) == 1 else [{"type": "text", "text": t} for t in texts]
    parts = []
    for i, part in enumerate(content):
        if part["type"] == "text":
            parts.append({"type": "text", "text": part.get("text", "")})
            continue
        image = part.get("image_url")
        url = image.get("url") if isinstance(image, dict) else None
        if not isinstance(url, str) or not url.startswith(("data:", "http://", "https://")):
            raise ValueError(f"{where}[{i}]: an image_url part needs image_url.url, a data: "
                             "URL or an http(s) URL")
        parts.append({"type": "image_url", "image_url": {"url": url}})
    return parts


def _response_format(fmt: dict, where: str = "body.response_format",
                     schema_at: str | None = None) -> dict:
    """A response_format's structured output (``json_schema`` in the overrides); its fields'
    types checked before use. ``schema_at``: where the schema sits, for the messages."""
    schema_at = schema_at or f"{where}.json_schema.schema"
    kind = fmt.get("type")
    if kind is not None and not isinstance(kind, str):
        raise Reject("invalid_body", f"{where}.type: must be a string")
    if kind in (None, "text"):
        return {}
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise Reject("invalid_body", f"{where}.json_schema: must be an object with "
                         "the schema in its 'schema'")
        return {"json_schema": check_json_schema(spec.get("schema"), schema_at)}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    raise Reject("invalid_body", f"{where}.type {kind[:40]!r} is not supported")


def check_json_schema(schema, where: str) -> dict:
    """A response's JSON Schema, checked as one (any draft its ``$schema`` names). A valid
    JSON Schema is all the engine needs: a Batch result is text, never parsed into a typed
    column (so $ref, anyOf and free-form objects are all fine). What the engine's grammar
    cannot take (a look-behind, a $ref to nowhere) is that request's error in the run, in
    vLLM's words."""
    import jsonschema

    if not isinstance(schema, dict):
        raise Reject("invalid_body", f"{where} must be a JSON Schema object")
    if not isinstance(schema.get("$schema", ""), str):
        raise Reject("invalid_body", f"{where}.$schema: must be a string (a draft's URI)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(map(str, exc.path)) or "the top level"
        raise Reject("invalid_body", f"{where}: at {at}: {exc.message}"[:300]) from None
    except Exception as exc:  # noqa: BLE001 - a schema the checker itself cannot walk
        raise Reject("invalid_body", f"{where}: not a JSON Schema the checker can read "
                     f"({one_line(exc, 120, typed=True)})") from None
    return schema
