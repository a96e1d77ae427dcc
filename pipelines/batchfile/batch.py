"""OpenAI Batch files: a request file in, a result file and an error file out (and
Anthropic's Message Batches files, whose one result file holds both: pipelines/batch_anthropic).

``overnight batch requests.jsonl -o results.jsonl`` runs a file written for the hosted Batch API
on the same pipeline as every other job:

1. ``prepare``: the file is read one line at a time; each line is checked (JSON, ``custom_id``,
   ``method``, ``url``, ``body``) and a runnable request becomes one row of a Parquet table of
   requests (messages or prompt, its own max_tokens and sampling as JSON). A line that cannot
   run goes to the error file instead, with its line number, ``custom_id`` when one could be
   read, a ``code`` and a ``message``. A repeated ``custom_id`` runs once; the repeat is an error.
2. the job: that table through Ray Data and the engine, like any table (resumable: the table and
   the job's parts live in a work directory beside the result file, ``RESULTS.overnight/``).
3. ``write_results``: the job's Parquet parts, in input order, become result lines in the Batch
   output format; rows that failed (a prompt too long, an engine error) join the error file.

Every input line with a readable ``custom_id`` ends in exactly one of the two files. The two
are one commit (``WRITTEN``): a kill leaves both or neither; a re-run completes a cut write.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
import os
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import pyarrow as pa
import pyarrow.parquet as pq
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from pipelines.batchfile import anthropic
from pipelines.batchfile import embeddings
from pipelines.batchfile import responses
from pipelines.config import JobConfig, apply_overrides, load_config, read_yaml
from pipelines.errors import ConfigError, InputError, OutputError, one_line
from pipelines.storage import Location, scrub_record
from pipelines.write import list_parts, write_atomically
from udfs import columns
from udfs.rows.logprobs import text_offsets, token_bytes_of

URLS = {"/v1/chat/completions": "chat", "/v1/completions": "completions"}
# Sampling fields a body may set beside temperature, top_p, n, seed and stop: OpenAI's
# penalties and vLLM's extensions (udfs/predictor.RowOverrides carries them to the engine).
EXTRA_SAMPLING = ("presence_penalty", "frequency_penalty", "ignore_eos", "top_k",
                  "min_tokens", "repetition_penalty", "stop_token_ids", "logit_bias")
# requests per row group of the prepared table, and their bytes at most (an embeddings line
# may hold 2,048 inputs): memory stays flat, here and where the table is read
CHUNK, CHUNK_BYTES = 10_000, 64 << 20

# Columns of the prepared table of requests.
CUSTOM_ID, LINE, KIND, PROMPT, MAX_TOKENS, OVERRIDES, MODEL = (
    "custom_id", "line", "kind", "prompt", "max_tokens", "overrides", "model")
SCHEMA = pa.schema([(CUSTOM_ID, pa.string()), (LINE, pa.int64()), (KIND, pa.string()),
                    (PROMPT, pa.string()), (MAX_TOKENS, pa.int64()), (OVERRIDES, pa.string()),
                    (MODEL, pa.string())])


# Body fields that change nothing overnight writes: accepted and ignored. Any field not
# here and not a field of _Body is that request's error, never silently dropped (a body
# with ignore_eos: true once ran as if it had not asked).
IGNORED_FIELDS = {"user", "metadata", "store", "service_tier", "safety_identifier",
                  "prompt_cache_key", "parallel_tool_calls", "stream_options"}


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
    stream: bool | None = None
    # chat: true/false, with top_logprobs; completions: the number of alternatives
    logprobs: bool | int | None = None
    top_logprobs: int | None = Field(None, ge=0, le=20)
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    # token ids (as JSON keys) to a bias from -100 to 100 (udfs/predictor.RowOverrides checks)
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
        from udfs.stages.predictor import check_logit_bias

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
        raises _Reject for a shape its endpoint does not take."""
        if kind == "chat":
            if self.logprobs is not None and not isinstance(self.logprobs, bool):
                raise _Reject("invalid_body", "body.logprobs must be true or false for "
                              "/v1/chat/completions (top_logprobs says how many)")
            if self.top_logprobs is not None and not self.logprobs:
                raise _Reject("invalid_body", "body.top_logprobs needs body.logprobs: true")
            return (self.top_logprobs or 0) if self.logprobs else None
        if self.top_logprobs is not None:
            raise _Reject("invalid_body", "body.top_logprobs is for /v1/chat/completions; "
                          "/v1/completions takes body.logprobs: N")
        if isinstance(self.logprobs, bool) or not 0 <= (self.logprobs or 0) <= 20:
            raise _Reject("invalid_body", "body.logprobs must be an integer from 0 to 20 "
                          "for /v1/completions")
        return self.logprobs


class _Line(BaseModel):
    model_config = ConfigDict(extra="forbid")
    custom_id: str = Field(min_length=1)
    method: Literal["POST"]
    url: str
    body: dict[str, Any]


@dataclass
class Prepared:
    table: Path  # the prepared requests (Parquet)
    errors: Path  # lines that cannot run (JSONL, in line order)
    requests: int
    rejected: int
    max_tokens: int  # the largest a request asks for: the job's cap
    task: str = "generate"  # or "embed": a file of /v1/embeddings lines


def _error_line(line: int, custom_id, code: str, message: str) -> dict:
    return {"id": _id("batch_req", custom_id, line), "custom_id": custom_id, "response": None,
            "error": {"code": code, "message": message, "line": line}}


def _id(prefix: str, custom_id, line: int) -> str:
    key = f"{custom_id}:{line}".encode("utf-8", "surrogatepass")  # any custom_id a line holds
    return f"{prefix}_{hashlib.sha1(key).hexdigest()[:24]}"


def jsonl(obj: dict) -> str:
    """One JSONL line, UTF-8 as written; \\u escapes where a value holds a lone surrogate
    (a custom_id such as "\\ud800"), which no UTF-8 file can hold as it is."""
    text = json.dumps(obj, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(obj)
    return text + "\n"


def _content(content, where: str = "content") -> str | list[dict]:
    """A message's content: a string; a list of text parts, joined; or, where it holds images,
    its text and ``image_url`` parts (a ``data:`` or http(s) URL each; ``detail`` is accepted
    and, as in vLLM, has no effect) in their order. ValueError names the part (``where``)."""
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
        return "".join(p.get("text", "") for p in content)
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


def parse_request(raw: str, default_max_tokens: int | None, max_model_len: int,
                  fmt: str = "openai") -> dict:
    """One line -> one row of the prepared table; raises _Reject (code, message, the line's
    custom_id when it could be read) if it cannot run. ``default_max_tokens`` None: a request
    without max_tokens may use the room its prompt leaves (its row's max_tokens is null until
    ``prepare`` has counted the prompt). ``fmt`` "anthropic": a Message Batches line.

    Whatever a line holds, it is that line's _Reject or its row, never another exception:
    one bad value once raised out of ``prepare`` and failed the whole file."""
    data = load_line(raw)
    if not isinstance(data, dict):
        raise _Reject("invalid_request", "a line must be a JSON object")
    custom_id = data.get("custom_id")
    try:
        if fmt == anthropic.FORMAT:
            row = {CUSTOM_ID: custom_id, **anthropic.parse_line(data, _Reject, max_model_len)}
        elif anthropic.is_anthropic(data):
            raise _Reject("invalid_request", "a Message Batches line (custom_id, params) in "
                          "an OpenAI Batch file; put it in a file of its own")
        else:
            row = _parse(data, default_max_tokens, max_model_len)
        _check_text(row)
        return row
    except _Reject as reject:
        reject.custom_id = custom_id if isinstance(custom_id, str) else None
        raise
    except Exception as exc:  # noqa: BLE001 - a value no check foresaw: this line's error
        reject = _Reject("invalid_request", f"cannot be read: {one_line(exc, 200, typed=True)}")
        reject.custom_id = custom_id if isinstance(custom_id, str) else None
        raise reject from None


def load_line(raw: str | bytes):
    """A line's JSON, or _Reject ``invalid_json`` for anything ``json.loads`` refuses: bad
    syntax, a nesting too deep for it (RecursionError), an integer of over 4,300 digits."""
    try:
        return json.loads(raw)
    except json.JSONDecodeError as exc:
        raise _Reject("invalid_json", f"not valid JSON: {exc.msg}") from None
    except RecursionError:
        raise _Reject("invalid_json", "not valid JSON: nested too deeply") from None
    except ValueError as exc:  # Python's limit on an integer's digits
        raise _Reject("invalid_json", f"not valid JSON: {one_line(exc, 200, typed=True)}") from None


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
                raise _Reject("invalid_body" if key != CUSTOM_ID else "invalid_request",
                              f"{where}: holds {value[exc.start]!r}, a lone surrogate, "
                              "which is not text") from None


def _parse(data: dict, default_max_tokens: int | None, max_model_len: int) -> dict:
    try:
        line = _Line.model_validate(data)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "(line)"
        raise _Reject("invalid_request", f"{key}: {first['msg']}") from None
    if line.url == embeddings.URL:  # pipelines/batchfile/embeddings.py
        fields = embeddings.parse_body(line.body, lambda m: _Reject("invalid_body", m))
        return {CUSTOM_ID: line.custom_id, KIND: embeddings.KIND, MAX_TOKENS: 0, **fields}
    if line.url == responses.URL:  # pipelines/batchfile/responses.py
        return {CUSTOM_ID: line.custom_id, **responses.parse_body(
            line.body, _Reject, default_max_tokens, max_model_len, _content,
            _response_format)}
    kind = URLS.get(line.url)
    if kind is None:
        raise _Reject("invalid_url", f"url {line.url!r} is not supported; use one of "
                      + ", ".join([*URLS, responses.URL, embeddings.URL]))
    try:
        body = _Body.model_validate(line.body)
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(p) for p in first["loc"]) or "body"
        if first["type"] == "extra_forbidden":
            raise _Reject("invalid_body", f"body.{key}: not supported by overnight, which "
                          "would have to ignore it; remove it") from None
        raise _Reject("invalid_body", f"body.{key}: {first['msg']}") from None
    if kind == "chat":
        if not body.messages:
            raise _Reject("invalid_body", "body.messages is required for /v1/chat/completions")
        messages = [_message(i, m) for i, m in enumerate(body.messages)]
    else:
        if body.prompt is None or isinstance(body.prompt, list) and len(body.prompt) != 1:
            raise _Reject("invalid_body", "body.prompt must be one string for /v1/completions")
        messages = body.prompt if isinstance(body.prompt, str) else body.prompt[0]
    # JSON either way: a list is chat messages, a string a raw prompt (see udfs/stages/prompts.py)
    prompt = json.dumps(messages, ensure_ascii=False)
    max_tokens = body.max_completion_tokens or body.max_tokens or default_max_tokens
    if max_tokens is not None and max_tokens >= max_model_len:
        raise _Reject("invalid_body", f"max_tokens {max_tokens} leaves no room for a prompt "
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
            OVERRIDES: json.dumps(overrides), MODEL: body.model}


def _message(index: int, message: dict) -> dict:
    """A chat message as the prompt renderer takes it: role and text content. Its other
    fields (``name``, ``tool_calls``...) would reach no template, so a message that sets one
    is the request's error, as an unknown body field is, never dropped silently."""
    where = f"body.messages[{index}]"
    if "role" not in message:
        raise _Reject("invalid_body", f"{where}: no 'role'")
    extra = sorted(set(message) - {"role", "content"})
    if extra:
        raise _Reject("invalid_body", f"{where}.{extra[0]}: not supported by overnight, "
                      "which would have to ignore it; remove it")
    if not isinstance(message["role"], str) or not message["role"]:
        raise _Reject("invalid_body", f"{where}.role: must be a string such as 'user'")
    try:
        return {"role": message["role"],
                "content": _content(message.get("content"), f"{where}.content")}
    except ValueError as exc:
        raise _Reject("invalid_body", str(exc)) from None


def _response_format(fmt: dict, where: str = "body.response_format",
                     schema_at: str | None = None) -> dict:
    """A response_format's structured output (``json_schema`` in the overrides); its fields'
    types checked before use. ``schema_at``: where the schema sits, for the messages."""
    schema_at = schema_at or f"{where}.json_schema.schema"
    kind = fmt.get("type")
    if kind is not None and not isinstance(kind, str):
        raise _Reject("invalid_body", f"{where}.type: must be a string")
    if kind in (None, "text"):
        return {}
    if kind == "json_schema":
        spec = fmt.get("json_schema") or {}
        if not isinstance(spec, dict):
            raise _Reject("invalid_body", f"{where}.json_schema: must be an object with "
                          "the schema in its 'schema'")
        return {"json_schema": check_json_schema(spec.get("schema"), schema_at)}
    if kind == "json_object":
        return {"json_schema": {"type": "object"}}
    raise _Reject("invalid_body", f"{where}.type {kind[:40]!r} is not supported")


def check_json_schema(schema, where: str) -> dict:
    """A response's JSON Schema, checked as one (any draft its ``$schema`` names). A valid
    JSON Schema is all the engine needs: a Batch result is text, never parsed into a typed
    column (so $ref, anyOf and free-form objects are all fine). What the engine's grammar
    cannot take (a look-behind, a $ref to nowhere) is that request's error in the run, in
    vLLM's words."""
    import jsonschema

    if not isinstance(schema, dict):
        raise _Reject("invalid_body", f"{where} must be a JSON Schema object")
    if not isinstance(schema.get("$schema", ""), str):
        raise _Reject("invalid_body", f"{where}.$schema: must be a string (a draft's URI)")
    try:
        jsonschema.validators.validator_for(schema).check_schema(schema)
    except jsonschema.SchemaError as exc:
        at = "/".join(map(str, exc.path)) or "the top level"
        raise _Reject("invalid_body", f"{where}: at {at}: {exc.message}"[:300]) from None
    except Exception as exc:  # noqa: BLE001 - a schema the checker itself cannot walk
        raise _Reject("invalid_body", f"{where}: not a JSON Schema the checker can read "
                      f"({one_line(exc, 120, typed=True)})") from None
    return schema


class _Reject(ValueError):
    """A line that cannot run: its error line's code and one-line message (a key or value
    quoted from the line is cut short, its line breaks made spaces)."""

    def __init__(self, code: str, message: str):
        message = " ".join(message.split()) if "\n" in message or "\r" in message \
            else message
        message = message if len(message) <= 400 else message[:399] + "…"
        super().__init__(message)
        self.code, self.message, self.custom_id = code, message, None


def file_format(requests: Path) -> str:
    """"anthropic" for a Message Batches file, else "openai": the first line that is a JSON
    object says (``custom_id`` and ``params``, or ``url`` and ``body``)."""
    with open(requests, "rb") as source:
        for raw in source:
            try:
                data = load_line(raw)
            except _Reject:  # not JSON (nested too deep for it included): the next line
                continue
            if isinstance(data, dict):
                return anthropic.FORMAT if anthropic.is_anthropic(data) else "openai"
    return "openai"


def prepare(requests: Path, work: Path, default_max_tokens: int | None,
            max_model_len: int, prompt_lengths=None, adapter_of=None,
            fmt: str = "openai") -> Prepared:
    """Read the request file once, streaming: runnable requests to Parquet, the rest to the
    error file (both in line order). With ``default_max_tokens`` None, a request without
    max_tokens gets the room its prompt leaves in the context, as the hosted API's and vLLM's
    defaults: ``prompt_lengths(prompts)`` counts the prompts' tokens (``prompt_counter``).
    ``adapter_of`` (a job with LoRA adapters, ``model_resolver``): a request's ``model`` ->
    the adapter it runs on (None: the base model); a model it does not serve is the
    request's error."""
    table, errors = work / "requests.parquet", work / "rejected.jsonl"
    seen: set[str] = set()
    rows: list[dict] = []
    count = rejected = top = size = 0  # size: the bytes of the lines in ``rows``
    family = None  # embeddings, or chat/completions: the first runnable line's
    tmp_table = work / ".requests.parquet.tmp"
    with pq.ParquetWriter(tmp_table, SCHEMA) as writer, \
            open(work / ".rejected.jsonl.tmp", "w", encoding="utf-8") as bad:
        with open(requests, "rb") as source:
            for number, raw in enumerate(source, start=1):
                if not raw.strip():
                    continue
                try:
                    row = parse_request(raw.decode("utf-8"), default_max_tokens,
                                        max_model_len, fmt)
                    if adapter_of is not None and row[KIND] != embeddings.KIND:
                        try:
                            row[MODEL] = adapter_of(row[MODEL])
                        except _Reject as caught:
                            caught.custom_id = row[CUSTOM_ID]
                            raise
                    if row[CUSTOM_ID] in seen:
                        exc = _Reject("duplicate_custom_id", f"custom_id {row[CUSTOM_ID]!r} "
                                      "was used by an earlier line, which runs; this one "
                                      "does not")
                        exc.custom_id, row = row[CUSTOM_ID], None
                    elif family is not None and _family(row[KIND]) != family:
                        exc = _Reject("invalid_url", f"{family} and other requests cannot "
                                      "share a file (a batch has one endpoint, as the Batch "
                                      "API's); put these lines in a file of their own")
                        exc.custom_id, row = row[CUSTOM_ID], None
                except UnicodeDecodeError:
                    row, exc = None, _Reject("invalid_json", "not valid UTF-8")
                except _Reject as caught:
                    row, exc = None, caught
                if row is None:
                    bad.write(jsonl(_error_line(number, exc.custom_id, exc.code, exc.message)))
                    rejected += 1
                    continue
                seen.add(row[CUSTOM_ID])
                family = family or _family(row[KIND])
                rows.append({**row, LINE: number})
                top = max(top, row[MAX_TOKENS] or 0)
                count += 1
                size += len(raw)
                if len(rows) >= CHUNK or size >= CHUNK_BYTES:
                    top = max(top, _fill_room(rows, max_model_len, prompt_lengths))
                    writer.write_table(pa.Table.from_pylist(rows, SCHEMA))
                    rows, size = [], 0
        if rows:
            top = max(top, _fill_room(rows, max_model_len, prompt_lengths))
            writer.write_table(pa.Table.from_pylist(rows, SCHEMA))
    os.replace(tmp_table, table)
    os.replace(work / ".rejected.jsonl.tmp", errors)
    return Prepared(table, errors, count, rejected, top or default_max_tokens or 1,
                    task="embed" if family == embeddings.KIND else "generate")


def _fill_room(rows: list[dict], max_model_len: int, prompt_lengths) -> int:
    """The rows without max_tokens given the room their prompts leave (at least 1: a prompt
    that fills the context is then the job's ``prompt_too_long``, in the job's own words);
    returns the largest of those."""
    todo = [row for row in rows if row[MAX_TOKENS] is None]
    if not todo:
        return 0
    lengths = prompt_lengths([row[PROMPT] for row in todo])
    for row, length in zip(todo, lengths):
        # a prompt the renderer refuses (no length) fails the same way in the job
        row[MAX_TOKENS] = 1 if length is None else max(1, max_model_len - length)
    return max(row[MAX_TOKENS] for row in todo)


def prompt_counter(model: str, max_model_len: int, trust_remote_code: bool = False):
    """``prompts -> token counts`` as the job will count them: its own renderer (the
    prepared table's prompt column through the model's chat template), loaded once."""
    from udfs.stages.prompts import PromptRenderer, RenderSpec

    renderer = None

    def count(prompts: list[str]) -> list[int | None]:
        nonlocal renderer
        if renderer is None:
            renderer = PromptRenderer(RenderSpec(
                template=None, tokenizer=model, max_model_len=max_model_len, max_tokens=1,
                trust_remote_code=trust_remote_code, messages_column=PROMPT))
        rendered = renderer.render_rows([{PROMPT: p} for p in prompts], [None] * len(prompts))
        return [length for _, length, *_ in rendered]  # None: the renderer refused it

    return count


def model_resolver(served: str, model: str, adapters) -> callable:
    """A request's ``model`` -> its LoRA adapter (None: the base model), as ``vllm serve
    --lora-modules`` routes it: an adapter's name runs on it; the served model's name, its
    path or no model on the base; any other name is the request's ``model_not_found``."""
    names = tuple(adapters)

    def adapter_of(name: str | None) -> str | None:
        if name in names:
            return name
        if name is None or name in (served, model):
            return None
        raise _Reject("model_not_found", f"body.model {name!r} is neither the served model "
                      f"({served!r}) nor one of its adapters ({', '.join(names)})")

    return adapter_of


def _family(kind: str) -> str:
    return embeddings.KIND if kind == embeddings.KIND else "chat/completions"


def embeddings_config(prepared: Prepared, output: Path, model: str, base: dict | None,
                      overrides: list[str]) -> JobConfig:
    """The embed job over a file of /v1/embeddings lines: one row per input."""
    raw = base or {}
    for section in ("input", "prompt", "output", "structured", "sampling"):
        if section in raw:
            raise ConfigError(f"batch: the config's {section!r} section is set by the batch "
                              "file; remove it")
    table = embeddings.explode(prepared.table, prepared.table.with_name("inputs.parquet"))
    return load_config(apply_overrides(embeddings.job_raw(table, output, model, raw),
                                       overrides))


def batch_config(prepared: Prepared, output: Path, model: str, base: dict | None,
                 overrides: list[str]) -> JobConfig:
    """The job that runs the prepared requests: messages (or a raw prompt) per row, each
    row's own max_tokens and sampling; the rest (engine, resources, context) from ``base``."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}
    for section in ("input", "prompt", "output", "structured"):
        if section in raw:
            raise ConfigError(f"batch: the config's {section!r} section is set by the batch "
                              "file; remove it")
    raw["input"] = {"path": str(prepared.table), "id_column": CUSTOM_ID}
    raw.setdefault("model", {})["name"] = model
    raw["prompt"] = {"messages_column": PROMPT, "on_too_long": "error"}
    sampling = raw.setdefault("sampling", {})
    sampling.update({"max_tokens": prepared.max_tokens, "max_tokens_column": MAX_TOKENS,
                     "overrides_column": OVERRIDES})
    sampling.setdefault("temperature", 1.0)  # the OpenAI default
    # the logprobs column is there for the requests that ask (each row says; null: not)
    raw["output"] = {"path": str(output), "column": "text", "logprobs": 0}
    raw = apply_overrides(raw, overrides)
    if (raw.get("model") or {}).get("adapters"):  # each request's model names its adapter
        raw["prompt"]["adapter_column"] = MODEL
    return load_config(raw)


# The result and error files are one commit. Both are written to staged names beside their
# targets; then a journal in the work directory names the pair (the commit point); then each is
# renamed into place. A kill at any point leaves either no journal for this pair (the write is
# done again, and nothing in place is ours to refuse) or a journal whose staged files a re-run
# renames in (``finish_write``): never one file of a pair without the other.
WRITTEN = "written.json"  # the journal: in RESULTS.overnight/, beside the job's parts


def work_dir(results: Path) -> Path:
    """Where a result file's job lives: its prepared table, parts and journal."""
    return results.with_name(results.name + ".overnight")


def finish_write(results: Path, errors: Path | None) -> dict | None:
    """A committed write of this pair completed (its staged files renamed into place, which
    a kill may have cut short); its journal, or None when no write of this pair was
    committed, so a file already at these paths is not this work directory's. ``errors``
    None: a Message Batches file's, whose one file holds every result."""
    journal = work_dir(results) / WRITTEN
    try:
        record = json.loads(journal.read_text())
    except (OSError, ValueError):
        return None
    if (record.get("results"), record.get("errors")) != (str(results),
                                                         errors and str(errors)):
        return None
    for staged, target in zip(record["staged"], (results, errors)):
        if target is not None and os.path.exists(staged):
            os.replace(staged, target)
    done = results.exists() and (errors is None or errors.exists())
    return record if done else None


def _staged(path: Path, token: str) -> Path:
    return path.with_name(f".{path.name}.{token}.staged")


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_results(job_output: Path, rejected: Path, results: Path, errors: Path | None,
                  model: str, tokenizer: str | None = None,
                  adapters: tuple[str, ...] = (), fmt: str = "openai",
                  unfinished: str | None = None) -> tuple[int, int]:
    """The job's parts -> result lines (in input order); failed rows and rejected lines ->
    error lines (in line order), both committed at once (see WRITTEN). Returns (results,
    errors). A result on a LoRA adapter (one of ``adapters``) names it as its model. ``fmt``
    "anthropic": one file (``errors`` None) of every line's result, in line order. With
    ``unfinished`` ("canceled", "expired" or "errored": a batch stopped before its end), a
    request the job did not reach has a result of that type (Anthropic's), or an error line
    with the hosted Batch API's code for it (``UNFINISHED_CODES``): every request is in one
    of the files, whatever the batch's end."""
    finish_write(results, errors)  # an earlier commit first: its staged files are not leftovers
    for path in (results, errors):  # staged files of writes killed before their commit
        for leftover in path.parent.glob(f".{path.name}.*.staged") if path else ():
            leftover.unlink(missing_ok=True)
    token = uuid.uuid4().hex[:8]
    if fmt == anthropic.FORMAT:
        return _write_anthropic(job_output, rejected, results, token, model, adapters,
                                unfinished)
    staged_ok, staged_errors = _staged(results, token), _staged(errors, token)
    failures = job_output.with_name(job_output.name + ".failed.jsonl")
    ok = failed = 0
    created = int(time.time())
    token_bytes = token_bytes_of(tokenizer)  # a token's bytes, for the logprobs' byte fields
    parts = _parts(job_output)
    with open(staged_ok, "w", encoding="utf-8") as out, \
            open(failures, "w", encoding="utf-8") as fail:
        for part in parts:  # in input order
            for request in _requests(pq.read_table(job_output / part.name)):
                adapter = request[0].get(MODEL)
                line = _result_line(request, adapter if adapter in adapters else model,
                                    created, token_bytes)
                target = out if line["error"] is None else fail
                target.write(jsonl(line))
                ok += line["error"] is None
    unreached = (jsonl(unfinished_error(custom_id, unfinished, line)) for line, custom_id
                 in _unreached(job_output, parts)) if unfinished else iter(())
    with open(staged_errors, "w", encoding="utf-8") as out, \
            open(rejected, encoding="utf-8") as a, open(failures, encoding="utf-8") as b:
        for line in heapq.merge(a, b, unreached,
                                key=lambda text: json.loads(text)["error"]["line"]):
            out.write(line)
            failed += 1  # every error line: rejected, failed in the run, or not reached
    _commit(results, errors, (staged_ok, staged_errors), [ok, failed], unfinished)
    failures.unlink()
    return ok, failed


# The hosted Batch API's error codes for the requests a batch did not reach before it ended
# (cancelled, expired; failed: the job could not go on), with its words
UNFINISHED_CODES = {
    "canceled": ("batch_cancelled", "This request was not executed because the batch was "
                 "cancelled."),
    "expired": ("batch_expired", "This request could not be executed before the completion "
                "window expired."),
    "errored": ("batch_failed", "This request was not executed because the batch failed "
                "before reaching it."),
}


def unfinished_error(custom_id, kind: str, line: int) -> dict:
    """The error line of a request a stopped batch did not reach (``kind``: canceled,
    expired, errored), in the hosted API's shape, with its line as every error line has."""
    code, message = UNFINISHED_CODES[kind]
    return _error_line(line, custom_id, code, message)


def _parts(job_output: Path) -> list:
    """The job's committed parts in input order; none where it wrote none yet."""
    return list_parts(Location.of(job_output))[0] if job_output.is_dir() else []


def _unreached(job_output: Path, parts: list):
    """(line, custom_id) of each prepared request no committed part holds, in line order."""
    done = set()
    for part in parts:
        done.update(pq.read_table(job_output / part.name, columns=[LINE])
                    .column(LINE).to_pylist())
    prepared = pq.ParquetFile(job_output.parent / "requests.parquet")
    for group in range(prepared.num_row_groups):
        table = prepared.read_row_group(group, columns=[CUSTOM_ID, LINE])
        for custom_id, line in zip(table.column(CUSTOM_ID).to_pylist(),
                                   table.column(LINE).to_pylist()):
            if line not in done:
                yield line, custom_id


def write_unstarted(requests: Path, results: Path, errors: Path | None, unfinished: str) \
        -> tuple[int, int]:
    """A batch stopped before its job prepared anything (cancelled or expired in the queue,
    failed before its start): every line of its file is a request not reached, its error
    line (``errors`` None: a Message Batches file, a result of that type), committed as a
    run's files are. Returns (results, errors): (0, lines)."""
    token = uuid.uuid4().hex[:8]
    staged = (_staged(results, token), errors and _staged(errors, token))
    count = 0
    with open(staged[0], "w", encoding="utf-8") as out, \
            open(staged[1] or os.devnull, "w", encoding="utf-8") as bad, \
            open(requests, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            try:
                custom_id = load_line(raw).get("custom_id")
            except (_Reject, AttributeError):  # not an object: no custom_id to give
                custom_id = None
            custom_id = custom_id if isinstance(custom_id, str) else None
            if errors is None:
                out.write(jsonl(anthropic.unfinished(custom_id, unfinished, number)))
            else:
                bad.write(jsonl(unfinished_error(custom_id, unfinished, number)))
            count += 1
    work_dir(results).mkdir(parents=True, exist_ok=True)
    _commit(results, errors, staged, [0, count], unfinished)
    return 0, count


def _commit(results: Path, errors: Path | None, staged: tuple, counts: list[int],
            unfinished: str | None = None) -> None:
    """The staged files synced, the journal naming them written (the commit point), each
    renamed into place (see WRITTEN). ``errors`` None: one file, ``staged`` (file, None).
    ``unfinished``: the files of a batch stopped before its end, which the journal says."""
    for path in staged:
        if path is not None:
            _fsync(path)
    record = {"results": str(results), "errors": errors and str(errors), "counts": counts,
              "staged": [path and str(path) for path in staged], "unfinished": unfinished}
    write_atomically(work_dir(results) / WRITTEN, lambda tmp: tmp.write_text(json.dumps(record)))
    finish_write(results, errors)


def _write_anthropic(job_output: Path, rejected: Path, results: Path, token: str, model: str,
                     adapters: tuple[str, ...], unfinished: str | None) -> tuple[int, int]:
    """A Message Batches file's results: the job's rows and the rejected lines merged in line
    order into one file, committed as the pair is (see WRITTEN); and with ``unfinished``,
    the requests not reached."""
    staged = _staged(results, token)
    counts = [0, 0]  # succeeded, errored
    parts = _parts(job_output)

    def unreached():
        for line, custom_id in _unreached(job_output, parts):
            yield line, anthropic.unfinished(custom_id, unfinished, line)

    def ran():
        for part in parts:  # in input order
            for (row,) in _requests(pq.read_table(job_output / part.name)):  # n is always 1
                if row[columns.ERROR] is not None \
                        and row[columns.ERROR_KIND] != columns.ErrorKind.NO_ANSWER:
                    yield row[LINE], anthropic.errored(row[CUSTOM_ID], row[columns.ERROR_KIND],
                                                       row[columns.ERROR], row[LINE])
                else:
                    adapter = row.get(MODEL)
                    yield row[LINE], anthropic.succeeded(
                        row, adapter if adapter in adapters else model,
                        thinking=columns.REASONING_TOKENS in row)

    def refused():
        with open(rejected, encoding="utf-8") as lines:
            for text in lines:
                error = json.loads(text)
                yield error["error"]["line"], anthropic.errored(
                    error["custom_id"], error["error"]["code"], error["error"]["message"],
                    error["error"]["line"])

    with open(staged, "w", encoding="utf-8") as out:
        streams = (ran(), refused(), *((unreached(),) if unfinished else ()))
        for _, line in heapq.merge(*streams, key=lambda item: item[0]):
            out.write(jsonl(line))
            counts[line["result"]["type"] != "succeeded"] += 1
    _commit(results, None, (staged, None), counts, unfinished)
    return counts[0], counts[1]


def _requests(part: pa.Table):
    """A part's rows grouped by request (a request with n > 1 has n rows, its samples)."""
    rows = part.to_pylist()
    group: list[dict] = []
    for row in rows:
        if group and row[CUSTOM_ID] != group[0][CUSTOM_ID]:
            yield group
            group = []
        group.append(row)
    if group:
        yield group


def served_name(model: str) -> str:
    """The model name a result says it came from, when none is given: the model
    directory's own name (a result never shows the server's filesystem), as
    ``vllm serve --served-model-name`` defaults to the model's name."""
    return Path(model.rstrip("/")).name or model


def _result_line(samples: list[dict], model: str, created: int, token_bytes) -> dict:
    first = samples[0]
    custom_id, line = first[CUSTOM_ID], first[LINE]
    # (a thinking model's request without an answer is answered, content null, as vLLM's
    # server answers it: its finish_reason says why)
    failed = next((s for s in samples if s[columns.ERROR] is not None
                   and s[columns.ERROR_KIND] != columns.ErrorKind.NO_ANSWER), None)
    if failed is not None:
        return _error_line(line, custom_id, failed[columns.ERROR_KIND], failed[columns.ERROR])
    if first[KIND] == embeddings.KIND:
        body = {"id": _id("embd", custom_id, line), "created": created,
                **embeddings.result_body(samples, model, sum(s[columns.PROMPT_TOKENS] or 0
                                                             for s in samples))}
        return {"id": _id("batch_req", custom_id, line), "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": _id("req", custom_id, line),
                             "body": body}, "error": None}
    if first[KIND] == responses.KIND:  # n is always 1
        return {"id": _id("batch_req", custom_id, line), "custom_id": custom_id,
                "response": {"status_code": 200, "request_id": _id("req", custom_id, line),
                             "body": responses.result_body(first, model, created)},
                "error": None}
    chat = first[KIND] == "chat"
    # a thinking model (model.reasoning_parser): the thinking beside the answer, as vLLM's
    # server names it (message.reasoning), and its tokens in the usage
    thinking = columns.REASONING_TOKENS in first
    choices = [
        {"index": i, "finish_reason": s[columns.FINISH_REASON],
         "logprobs": _openai_logprobs(s.get(LOGPROBS), chat, token_bytes),
         **({"message": {"role": "assistant", "content": s["text"],
                         **({"reasoning": s[REASONING]} if thinking else {})}} if chat
            else {"text": s["text"]})}
        for i, s in enumerate(samples)]
    prompt_tokens = first[columns.PROMPT_TOKENS] or 0
    completion = sum(s[columns.COMPLETION_TOKENS] or 0 for s in samples)
    usage = {"prompt_tokens": prompt_tokens, "completion_tokens": completion,
             "total_tokens": prompt_tokens + completion}
    if thinking:
        usage["completion_tokens_details"] = {"reasoning_tokens": sum(
            s[columns.REASONING_TOKENS] or 0 for s in samples)}
    body = {"id": _id("chatcmpl" if chat else "cmpl", custom_id, line),
            "object": "chat.completion" if chat else "text_completion",
            "created": created, "model": model, "choices": choices, "usage": usage}
    return {"id": _id("batch_req", custom_id, line), "custom_id": custom_id,
            "response": {"status_code": 200, "request_id": _id("req", custom_id, line),
                         "body": body},
            "error": None}


LOGPROBS = "logprobs"  # the job's logprobs column (output.logprobs_column's default)
REASONING = "reasoning"  # and its thinking's (output.reasoning_column's default)


def _openai_logprobs(entries: list[dict] | None, chat: bool, token_bytes) -> dict | None:
    """A sample's logprobs column in the OpenAI shape of its endpoint. -inf (a token the
    grammar forbids) is -9999.0, as vLLM's server writes it: JSON has no infinity. A
    token's ``bytes`` and ``text_offset`` come from the bytes it stands for
    (``token_bytes``, udfs/rows/logprobs.py), not from its decoded text: a token that holds part
    of a UTF-8 character decodes to U+FFFD alone."""
    if entries is None:
        return None

    def floor(logprob: float) -> float:
        return -9999.0 if logprob is None or math.isnan(logprob) else max(logprob, -9999.0)

    if chat:
        def item(entry: dict) -> dict:
            token = entry["token"] or ""
            return {"token": token, "logprob": floor(entry["logprob"]),
                    "bytes": list(token_bytes(entry.get("token_id"), token))}

        return {"content": [{**item(e), "top_logprobs": [item(t) for t in e["top"] or ()]}
                            for e in entries], "refusal": None}
    offsets = text_offsets([token_bytes(e.get("token_id"), e["token"]) for e in entries])
    return {"tokens": [e["token"] or "" for e in entries],
            "token_logprobs": [floor(e["logprob"]) for e in entries],
            "top_logprobs": [{t["token"] or "": floor(t["logprob"]) for t in e["top"] or ()}
                             for e in entries],
            "text_offset": offsets}


def run_batch_file(requests: str | Path, results: str | Path, *, model: str,
                   errors: str | Path | None = None, config: dict | str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False,
                   progress=None, served_model_name: str | None = None,
                   format: str | None = None) -> dict:
    """Run an OpenAI Batch input file; write the result and error files. Returns counts.
    ``served_model_name``: the ``model`` of every result body (default: the model
    directory's name, ``served_name``). ``format`` "openai" or "anthropic" (default: the
    file's shape, ``file_format``): an Anthropic Message Batches file has one result file
    of succeeded and errored results, and no error file."""
    import yaml

    from pipelines.job.pipeline import run_job
    from pipelines.plan.model import resolve_max_model_len
    from pipelines.write import OutputStore

    requests, results = Path(requests), Path(results)
    if not requests.is_file():
        raise InputError(f"{requests}: no such request file")
    if format not in (None, "openai", anthropic.FORMAT):
        raise ConfigError(f"batch: format {format!r} is not one of openai, anthropic")
    fmt = format or file_format(requests)
    if fmt == anthropic.FORMAT:
        if errors:
            raise ConfigError("batch: a Message Batches file's results hold its errored "
                              "requests too; it has no error file (drop -e/--errors)")
    else:
        errors = Path(errors) if errors else results.with_name(results.stem + ".errors.jsonl")
    committed = finish_write(results, errors)  # a kill between the two renames: complete it
    if isinstance(config, (str, Path)):
        try:
            config = read_yaml(config) or {}  # a key given twice refused, as a job's
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{config}: cannot read: {exc}") from None
    base = apply_overrides({k: dict(v) if isinstance(v, dict) else v
                            for k, v in (config or {}).items()}, list(overrides))
    model_section = base.get("model", {})
    max_model_len = resolve_max_model_len(model, model_section.get("max_model_len"),
                                          model_section.get("trust_remote_code", False))

    work = work_dir(results)
    # what the results depend on: the file, and the model and settings it runs with
    source = scrub_record({"path": str(requests.resolve()), "size": requests.stat().st_size,
                           "mtime": requests.stat().st_mtime, "max_model_len": max_model_len,
                           "model": model, "config": base, "format": fmt})
    manifest = work / "source.json"
    unchanged = manifest.exists() and json.loads(manifest.read_text()) == source \
        and (work / "requests.parquet").exists()
    # the files in place are this run's own (written from this work directory for the same
    # file and settings): a re-run completes them, as it resumes the job
    ours = committed is not None and unchanged
    for path in (results, errors):
        if path is not None and path.exists() and not overwrite and not ours:
            raise OutputError(f"{path} already exists; pass --overwrite to replace it")
    work.mkdir(parents=True, exist_ok=True)
    prepared_record = work / "prepared.json"
    if unchanged and prepared_record.exists():
        prepared = Prepared(**{**json.loads(prepared_record.read_text()),
                               "table": work / "requests.parquet",
                               "errors": work / "rejected.jsonl"})
    else:
        # a request without max_tokens: the operator's sampling.max_tokens, else the room its
        # prompt leaves in the context (the hosted API's default, and vLLM's run_batch's)
        adapters = model_section.get("adapters") or {}
        prepared = prepare(requests, work, base.get("sampling", {}).get("max_tokens"),
                           max_model_len, prompt_counter(
                               model, max_model_len, model_section.get("trust_remote_code",
                                                                       False)),
                           adapter_of=model_resolver(served_model_name or served_name(model),
                                                     model, adapters) if adapters else None,
                           fmt=fmt)
        write_atomically(prepared_record, lambda tmp: tmp.write_text(json.dumps(
            {k: v for k, v in prepared.__dict__.items() if k not in ("table", "errors")})))
        write_atomically(manifest, lambda tmp: tmp.write_text(json.dumps(source)))
    job_output = work / "output"
    summary = None
    if prepared.requests:
        record = OutputStore(str(job_output)).read_record() or {}
        # an edited request file (its results replaced with --overwrite): the lines whose
        # requests are unchanged are carried over from the earlier file's (pipelines/reuse/carry.py)
        reuse = (not unchanged and prepared.task != "embed"
                 and record.get("state") == "complete")
        job = (embeddings_config if prepared.task == "embed" else batch_config)(
            prepared, job_output, model, base, ["output.reuse=true"] if reuse else [])
        if overwrite or not unchanged:  # a new request file (or asked for): start over
            summary = run_job(job, overwrite=True, progress=progress)
        elif record.get("state") != "complete":  # the same file, interrupted: resume
            summary = run_job(job, progress=progress)
    else:  # nothing to run: no result may come from an earlier file's parts
        if not unchanged or overwrite:
            OutputStore(str(job_output)).discard()
        job_output.mkdir(exist_ok=True)
    if summary is None and ours and not overwrite:  # nothing ran: the files are up to date
        ok, failed = committed["counts"]
    else:
        ok, failed = write_results(job_output, prepared.errors, results, errors,
                                   served_model_name or served_name(model), tokenizer=model,
                                   adapters=tuple(model_section.get("adapters") or ()),
                                   fmt=fmt)
    return {"requests": prepared.requests + prepared.rejected, "results": ok, "errors": failed,
            "rejected_lines": prepared.rejected, "results_path": str(results),
            "errors_path": errors and str(errors), "summary": summary, "format": fmt}


def run_batch(requests: str | Path, results: str | Path, *, model: str,
              errors: str | Path | None = None, config: str | Path | None = None,
              overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False,
              served_model_name: str | None = None, format: str | None = None,
              quiet: bool = False) -> int:
    """What ``overnight batch`` does with its arguments: the file run (``run_batch_file``,
    with a progress line unless ``quiet``), then its counts and files printed. Returns the
    exit status, 0; a user's mistake is raised (a JobError), for the caller to end the run
    as the command line does (``pipelines.errors.exit_status``). The ``batch`` command runs
    this, and so do ``overnight serve``'s batch workers (serve/worker.py)."""
    from pipelines.job.progress import Progress

    counts = run_batch_file(requests, results, errors=errors, model=model, config=config,
                            overrides=overrides, overwrite=overwrite,
                            served_model_name=served_model_name,
                            progress=Progress(total=0, enabled=not quiet), format=format)
    if counts["format"] == "anthropic":
        print(f"requests: {counts['requests']} lines -> {counts['results']} succeeded, "
              f"{counts['errors']} errored ({counts['rejected_lines']} could not run)")
        print(f"results: {counts['results_path']}")
        return 0
    print(f"requests: {counts['requests']} lines -> {counts['results']} results, "
          f"{counts['errors']} errors ({counts['rejected_lines']} could not run)")
    print(f"results: {counts['results_path']}\nerrors: {counts['errors_path']}")
    return 0
