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
overnight cannot honour (``tools``, ``thinking``, a document block, a prefilled assistant turn)
is that request's ``errored`` result naming it, never silently ignored. A user turn's ``image``
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

KIND = "messages"  # the prepared table's kind of an Anthropic request
FORMAT = "anthropic"

# Params that change nothing overnight writes: accepted and ignored (a user id, a tier, prompt
# caching's marks: vLLM caches prefixes by itself)
IGNORED_PARAMS = {"metadata", "service_tier", "cache_control", "inference_geo", "speed"}
IGNORED_BLOCK_FIELDS = {"cache_control", "citations"}


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


class Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1, max_length=64)
    params: dict[str, Any]


def is_anthropic(data: Any) -> bool:
    """A line of a Message Batches file (``custom_id`` and ``params``), not an OpenAI one."""
    return isinstance(data, dict) and "params" in data and not {"body", "url"} & set(data)


def parse_line(data: dict, reject, max_model_len: int | None = None) -> dict:
    """One line -> the prepared table's fields; ``reject(code, message)`` builds the
    exception for a line that cannot run. A ``max_tokens`` that leaves no room for a prompt
    in ``max_model_len`` is the request's error (it once became the whole job's cap, and
    the job refused it: every request of the file failed)."""
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
    messages = []
    if params.system is not None:
        messages.append({"role": "system", "content": _text(params.system, "params.system",
                                                             reject)})
    for i, message in enumerate(params.messages):
        where = f"params.messages[{i}]"
        extra = sorted(set(message) - {"role", "content"})
        if extra:
            raise reject("invalid_request", f"{where}.{extra[0]}: not supported by overnight, "
                         "which would have to ignore it; remove it")
        if message.get("role") not in ("user", "assistant"):
            raise reject("invalid_request", f"{where}.role: must be 'user' or 'assistant' "
                         "(the system prompt is params.system)")
        messages.append({"role": message["role"],
                         "content": _text(message.get("content"), where + ".content", reject,
                                          images=message["role"] == "user")})
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
            "model": params.model}


def _first(err: ValidationError, prefix: str) -> str:
    first = err.errors()[0]
    key = ".".join(str(p) for p in first["loc"])
    return f"{prefix}{key}: {first['msg']}" if key else first["msg"]


def _text(content, where: str, reject, images: bool = False) -> str | list[dict]:
    """A content (a string, or a list of text blocks) as the chat template takes it. With
    ``images`` (a user turn), ``image`` blocks too (``source`` base64 with its media_type, or
    a url): then the text and ``image_url`` parts in their order, as an OpenAI request's
    content is read (pipelines/batchfile/lines.py)."""
    if isinstance(content, str):
        return content
    if not isinstance(content, list) or not content:
        raise reject("invalid_request", f"{where}: must be a string or a list of content "
                     "blocks")
    parts = []
    for i, block in enumerate(content):
        kind = block.get("type") if isinstance(block, dict) else None
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
    if all(part["type"] == "text" for part in parts):
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


def succeeded(sample: dict, model: str, thinking: bool) -> dict:
    """A request's row of the job -> its ``succeeded`` result line."""
    text, stop, stop_sequence = sample["text"], sample["finish_reason"], None
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
    content = []
    if thinking and sample.get("reasoning") is not None:
        content.append({"type": "thinking", "thinking": sample["reasoning"], "signature": ""})
    if text is not None:
        content.append({"type": "text", "text": text})
    custom_id, line = sample["custom_id"], sample["line"]
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
