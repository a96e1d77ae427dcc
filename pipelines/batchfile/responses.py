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
budget ran out. A field overnight cannot honour (``tools``, ``previous_response_id``,
``reasoning``, ``background``...) is the request's error naming it, never silently ignored.
The response echoes the request's sampling settings, but not its ``instructions`` (null).
"""

from __future__ import annotations

import hashlib
import json
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError

URL = "/v1/responses"
KIND = "responses"  # the prepared table's kind of such a request

# Fields that change nothing overnight writes: accepted and ignored.
IGNORED_FIELDS = {"metadata", "store", "user", "service_tier", "safety_identifier",
                  "prompt_cache_key", "parallel_tool_calls"}
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


def parse_body(body: dict, reject, default_max_tokens: int | None, max_model_len: int,
               content, response_format) -> dict:
    """A ``/v1/responses`` body -> the prepared table's fields (kind, prompt, max_tokens,
    overrides, model); ``reject(code, message)`` builds the exception for one that cannot run.
    ``content`` and ``response_format``: pipelines.batchfile.lines's readings of a chat request's
    message content and response_format."""
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
        messages += [_message(i, item, reject, content)
                     for i, item in enumerate(parsed.input)]
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
    if fmt is not None:
        if not isinstance(fmt, dict):
            raise reject("invalid_body", "body.text.format must be an object")
        if fmt.get("type") == "json_schema":  # the schema sits in the format itself here
            fmt = {"type": "json_schema", "json_schema": {"schema": fmt.get("schema")}}
        overrides.update(response_format(fmt, "body.text.format", "body.text.format.schema"))
    return {"kind": KIND, "prompt": json.dumps(messages, ensure_ascii=False),
            "max_tokens": max_tokens, "overrides": json.dumps(overrides),
            "model": parsed.model}


def _message(index: int, item: dict, reject, content_of) -> dict:
    where = f"body.input[{index}]"
    if item.get("type", "message") != "message":
        raise reject("invalid_body", f"{where}.type: {str(item.get('type'))[:40]!r} items "
                     "are not supported (messages are)")
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


def result_body(sample: dict, model: str, created: int) -> dict:
    """A request's row of the job -> its ``response`` object."""
    custom_id, line = sample["custom_id"], sample["line"]
    incomplete = sample["finish_reason"] == "length"
    status = "incomplete" if incomplete else "completed"
    overrides = json.loads(sample["overrides"] or "{}")
    schema = overrides.get("json_schema")
    prompt_tokens = sample["prompt_tokens"] or 0
    completion = sample["completion_tokens"] or 0
    return {
        "id": _id("resp", custom_id, line), "object": "response", "created_at": created,
        "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if incomplete else None,
        "instructions": None, "max_output_tokens": sample["max_tokens"], "model": model,
        "output": [{"type": "message", "id": _id("msg", custom_id, line), "status": status,
                    "role": "assistant", "content": [{"type": "output_text",
                                                      "text": sample["text"] or "",
                                                      "annotations": []}]}],
        "parallel_tool_calls": False, "temperature": overrides.get("temperature", 1.0),
        "top_p": overrides.get("top_p", 1.0), "tool_choice": "none", "tools": [],
        "text": {"format": {"type": "json_schema", "name": "response", "schema": schema,
                            "strict": True} if schema else {"type": "text"}},
        "usage": {"input_tokens": prompt_tokens, "input_tokens_details": {"cached_tokens": 0,
                                                           "cache_write_tokens": 0},
                  "output_tokens": completion,
                  "output_tokens_details": {"reasoning_tokens": 0},
                  "total_tokens": prompt_tokens + completion},
        "metadata": {}}


def _id(prefix: str, custom_id, line: int) -> str:
    key = f"{custom_id}:{line}".encode("utf-8", "surrogatepass")  # any custom_id a line holds
    return f"{prefix}_{hashlib.sha1(key).hexdigest()[:24]}"
