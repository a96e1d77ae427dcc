"""The Batch-file line parsers fuzzed (issue #56 A2): every line is either a row of the prepared
table or that line's rejection (its code and a one-line message naming the field), never an
exception. One bad value once raised out of ``prepare`` and failed the whole file.

Each parser (OpenAI chat, completions, embeddings, responses; Anthropic's Message Batches)
gets lines drawn from a JSON Schema of its valid shape (``shapes``), then changed at
random depths: a value replaced by another type (strings where objects go, lists where
strings go, numbers, nulls, huge integers, NaN, lone surrogates, deep nesting), a key dropped
or added. Beside them, ``overnight serve``'s own checks of what it is given: an uploaded file
(serve/validate.py) and a message batch's body and custom_ids (serve/anthropic.py). No
engine: the real run of bad lines is tests/test_batch.py's ``batch`` fixture.
"""

from __future__ import annotations

import json

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from hypothesis import HealthCheck, example, given, settings
from hypothesis import strategies as st

from pipelines.batchfile.envelopes import error_line as _error_line
from pipelines.batchfile.envelopes import jsonl
from pipelines.batchfile.lines import LINE, OVERRIDES, PROMPT, SCHEMA, parse_request
from pipelines.batchfile.lines import Reject as _Reject
from pipelines.batchfile.prepare import prepare
from serve.validate import check_input_file

EXAMPLES = 500  # per parser: a few seconds each, deadline off
CODES = {"invalid_json", "invalid_request", "invalid_body", "invalid_url"}
MAX_MODEL_LEN = 512

# -- the valid shapes, as JSON Schemas ---------------------------------------------------------

TEXT = {"type": "string", "maxLength": 12}
WORD = {"type": "string", "minLength": 1, "maxLength": 12}
PART = {"anyOf": [
    {"type": "object", "properties": {"type": {"const": "text"}, "text": TEXT},
     "required": ["type", "text"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "image_url"}, "image_url": {
        "type": "object", "properties": {"url": {"enum": [
            "data:image/png;base64,iVBORw0KGgo=", "https://example.com/a.png"]}},
        "required": ["url"], "additionalProperties": False}},
     "required": ["type", "image_url"], "additionalProperties": False}]}
MESSAGE = {"type": "object", "properties": {
    "role": {"enum": ["system", "user", "assistant", "developer"]},
    "content": {"anyOf": [TEXT, {"type": "array", "items": PART, "minItems": 1,
                                 "maxItems": 2}]}},
    "required": ["role", "content"], "additionalProperties": False}
SCHEMA_OBJECT = {"type": "object", "properties": {"type": {"const": "object"}, "properties": {
    "type": "object", "properties": {"a": {"type": "object", "properties": {
        "type": {"enum": ["string", "integer"]}}, "required": ["type"],
        "additionalProperties": False}}, "additionalProperties": False}},
    "required": ["type"], "additionalProperties": False}
RESPONSE_FORMAT = {"anyOf": [
    {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
     "required": ["type"], "additionalProperties": False},
    {"type": "object", "properties": {"type": {"const": "json_schema"}, "json_schema": {
        "type": "object", "properties": {"name": TEXT, "schema": SCHEMA_OBJECT},
        "required": ["schema"], "additionalProperties": False}},
     "required": ["type", "json_schema"], "additionalProperties": False}]}
SAMPLING = {
    "model": TEXT, "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
    "n": {"type": "integer", "minimum": 1, "maximum": 3},
    "seed": {"type": "integer", "minimum": -(2 ** 63), "maximum": 2 ** 63 - 1},
    "stop": {"anyOf": [TEXT, {"type": "array", "items": TEXT, "maxItems": 2}]},
    "presence_penalty": {"type": "number", "minimum": -2, "maximum": 2},
    "logit_bias": {"type": "object", "propertyNames": {"pattern": "^[0-9]{1,3}$"},
                   "additionalProperties": {"type": "number", "minimum": -100,
                                            "maximum": 100}, "maxProperties": 2},
    "top_k": {"type": "integer", "minimum": -1, "maximum": 50},
    "min_tokens": {"type": "integer", "minimum": 0, "maximum": 4},
    "repetition_penalty": {"type": "number", "exclusiveMinimum": 0, "maximum": 2},
    "stop_token_ids": {"type": "array", "items": {"type": "integer", "minimum": 0},
                       "maxItems": 2},
    "ignore_eos": {"type": "boolean"}, "user": TEXT, "metadata": {"type": "object"}}


def line(url: str, body: dict) -> dict:
    return {"type": "object", "properties": {
        "custom_id": {"type": "string", "minLength": 1, "maxLength": 8},
        "method": {"const": "POST"}, "url": {"const": url},
        "body": {"type": "object", "additionalProperties": False, **body}},
        "required": ["custom_id", "method", "url", "body"], "additionalProperties": False}


CHAT = line("/v1/chat/completions", {"properties": {
    **SAMPLING, "messages": {"type": "array", "items": MESSAGE, "minItems": 1, "maxItems": 3},
    "logprobs": {"type": "boolean"}, "top_logprobs": {"type": "integer", "minimum": 0,
                                                      "maximum": 3},
    "response_format": RESPONSE_FORMAT}, "required": ["messages"]})
COMPLETIONS = line("/v1/completions", {"properties": {
    **SAMPLING, "prompt": {"anyOf": [TEXT, {"type": "array", "items": TEXT, "minItems": 1,
                                            "maxItems": 1}]},
    "logprobs": {"type": "integer", "minimum": 0, "maximum": 3}}, "required": ["prompt"]})
EMBEDDINGS = line("/v1/embeddings", {"properties": {
    "model": TEXT, "input": {"anyOf": [WORD, {"type": "array", "items": WORD, "minItems": 1,
                                              "maxItems": 3}]},
    "encoding_format": {"enum": ["float", "base64"]},
    "dimensions": {"type": "integer", "minimum": 1, "maximum": 64}, "user": TEXT},
    "required": ["input"]})
RESPONSES = line("/v1/responses", {"properties": {
    "model": TEXT, "instructions": TEXT,
    "input": {"anyOf": [TEXT, {"type": "array", "minItems": 1, "maxItems": 2, "items": {
        "type": "object", "properties": {
            "type": {"const": "message"}, "role": {"enum": ["user", "assistant", "developer"]},
            "content": {"anyOf": [TEXT, {"type": "array", "minItems": 1, "maxItems": 2,
                                         "items": {"type": "object", "properties": {
                                             "type": {"const": "input_text"}, "text": TEXT},
                                             "required": ["type", "text"],
                                             "additionalProperties": False}}]}},
        "required": ["role", "content"], "additionalProperties": False}}]},
    "max_output_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
    "temperature": {"type": "number", "minimum": 0, "maximum": 2},
    "text": {"type": "object", "properties": {"format": {"anyOf": [
        {"type": "object", "properties": {"type": {"enum": ["text", "json_object"]}},
         "required": ["type"], "additionalProperties": False},
        {"type": "object", "properties": {"type": {"const": "json_schema"}, "name": TEXT,
                                          "schema": SCHEMA_OBJECT},
         "required": ["type", "schema"], "additionalProperties": False}]}},
        "additionalProperties": False}},
    "required": ["input"]})
BLOCK = {"type": "object", "properties": {"type": {"const": "text"}, "text": TEXT},
         "required": ["type", "text"], "additionalProperties": False}
ANTHROPIC = {"type": "object", "properties": {
    "custom_id": {"type": "string", "pattern": "^[a-z0-9_-]{1,8}$"},
    "params": {"type": "object", "properties": {
        "model": {"type": "string", "minLength": 1, "maxLength": 8},
        "max_tokens": {"type": "integer", "minimum": 1, "maximum": 64},
        "messages": {"type": "array", "minItems": 1, "maxItems": 2, "items": {
            "type": "object", "properties": {
                "role": {"const": "user"},
                "content": {"anyOf": [TEXT, {"type": "array", "items": {"anyOf": [BLOCK, {
                    "type": "object", "properties": {"type": {"const": "image"}, "source": {
                        "type": "object", "properties": {
                            "type": {"const": "base64"}, "media_type": {"const": "image/png"},
                            "data": {"const": "iVBORw0KGgo="}},
                        "required": ["type", "media_type", "data"],
                        "additionalProperties": False}},
                    "required": ["type", "source"], "additionalProperties": False}]},
                    "minItems": 1, "maxItems": 2}]}},
            "required": ["role", "content"], "additionalProperties": False}},
        "system": {"anyOf": [TEXT, {"type": "array", "items": BLOCK, "minItems": 1,
                                    "maxItems": 2}]},
        "temperature": {"type": "number", "minimum": 0, "maximum": 1},
        "top_p": {"type": "number", "exclusiveMinimum": 0, "maximum": 1},
        "top_k": {"type": "integer", "minimum": 0, "maximum": 50},
        "stop_sequences": {"type": "array", "items": TEXT, "maxItems": 2},
        "metadata": {"type": "object"}},
        "required": ["model", "max_tokens", "messages"], "additionalProperties": False}},
    "required": ["custom_id", "params"], "additionalProperties": False}

# -- the changes -------------------------------------------------------------------------------

# keys a body may hold: an added key is often one the parser reads (a type it does not expect)
KEYS = ["role", "content", "type", "text", "schema", "$schema", "json_schema", "messages",
        "input", "tools", "image_url", "url", "source", "format", "max_tokens", "system",
        "response_format", "logit_bias", "custom_id", "params", "body", "prompt", "n"]
ODD = ["\ud800", "a\udfffb", "\x00", "é", "\U0001f600", "\u2028", "", " ", "user\n",
       "¹²", "٣", "data:", "NaN"]


def _nested(depth: int, kind: str):
    value: object = "x"
    for _ in range(depth):
        value = [value] if kind == "list" else {"a": value}
    return value


LEAVES = st.one_of(
    st.none(), st.booleans(), st.integers(),
    st.sampled_from([10 ** 30, -(10 ** 30), 2 ** 63, 2 ** 31, -1, 0, 1]),
    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=8), st.sampled_from(ODD))
VALUES = st.one_of(
    LEAVES,
    st.recursive(LEAVES, lambda kids: st.lists(kids, max_size=3) | st.dictionaries(
        st.sampled_from(KEYS) | st.text(max_size=4), kids, max_size=3), max_leaves=6),
    st.builds(_nested, st.integers(1, 300), st.sampled_from(["list", "dict"])))


def _paths(value, path=()):
    """Every place in a JSON value, its root first."""
    yield path
    if isinstance(value, dict):
        for key, item in value.items():
            yield from _paths(item, (*path, key))
    elif isinstance(value, list):
        for index, item in enumerate(value):
            yield from _paths(item, (*path, index))


def _change(doc, draw):
    """One change at a random place: its value replaced by one of another type (itself in
    a list or an object, as JSON text, or any value), or a key dropped or added."""
    paths = list(_paths(doc))
    deep = [p for p in paths if len(p) >= 3]  # inside messages, parts, formats: most often
    path = draw(st.sampled_from(deep if deep and draw(st.integers(0, 2)) else paths))
    parent, key = None, None
    value = doc
    for step in path:
        parent, key, value = value, step, value[step]
    what = draw(st.sampled_from(["any", "in a list", "in an object", "as text", "drop",
                                 "add"]))
    new = {"any": lambda: draw(VALUES), "in a list": lambda: [value],
           "in an object": lambda: {draw(st.sampled_from(KEYS)): value},
           "as text": lambda: json.dumps(value, allow_nan=True)}.get(what, lambda: None)
    if what == "drop" and isinstance(parent, dict):
        del parent[key]
    elif what == "add" and isinstance(value, dict):
        value[draw(st.sampled_from(KEYS))] = draw(VALUES)
    elif parent is None:
        return new() if what not in ("drop", "add") else doc
    elif what not in ("drop", "add"):
        parent[key] = new()
    return doc


def shapes(schema: dict) -> st.SearchStrategy:
    """Values valid under one of the schemas above (the subset of JSON Schema they use):
    hypothesis-jsonschema's from_schema draws the same, at a tenth of the speed."""
    if "anyOf" in schema:
        return st.one_of([shapes(option) for option in schema["anyOf"]])
    if "const" in schema:
        return st.just(schema["const"])
    if "enum" in schema:
        return st.sampled_from(schema["enum"])
    kind = schema.get("type")
    if kind == "object":
        properties = schema.get("properties")
        if "propertyNames" in schema:  # a map: keys of a pattern to values of a schema
            return st.dictionaries(shapes({"type": "string", **schema["propertyNames"]}),
                                   shapes(schema["additionalProperties"]),
                                   max_size=schema.get("maxProperties", 3))
        if properties is None:  # a free-form object
            return st.dictionaries(st.text(max_size=4), st.text(max_size=4), max_size=2)
        required = set(schema.get("required", ()))
        return st.fixed_dictionaries(
            {k: shapes(v) for k, v in properties.items() if k in required},
            optional={k: shapes(v) for k, v in properties.items() if k not in required})
    if kind == "array":
        return st.lists(shapes(schema["items"]), min_size=schema.get("minItems", 0),
                        max_size=schema.get("maxItems", 3))
    if kind == "string":
        if "pattern" in schema:
            return st.from_regex(schema["pattern"], fullmatch=True)
        return st.text(min_size=schema.get("minLength", 0),
                       max_size=schema.get("maxLength", 12))
    if kind == "integer":
        return st.integers(schema.get("minimum"), schema.get("maximum"))
    if kind == "number":
        low = schema.get("minimum", schema.get("exclusiveMinimum"))
        return st.floats(low, schema.get("maximum"), allow_nan=False,
                         exclude_min="exclusiveMinimum" in schema)
    assert kind == "boolean", schema
    return st.booleans()


def _changed(schema):
    valid = shapes(schema)

    @st.composite
    def build(draw):
        doc = draw(valid)
        for _ in range(draw(st.integers(1, 3))):
            doc = _change(doc, draw)
        return json.dumps(doc, allow_nan=True)  # \\ud800 escaped: json.loads restores it
    return build()


# -- the check ---------------------------------------------------------------------------------

def _parses_or_rejects(raw: str, fmt: str = "openai") -> str:
    """The line's row, which the prepared table takes, or its rejection as an error line
    can hold it; anything else fails the test."""
    try:
        row = parse_request(raw, 16, MAX_MODEL_LEN, fmt)
    except _Reject as reject:
        assert reject.code in CODES, reject.code
        message = reject.message
        assert message and "\n" not in message and len(message) <= 400, message
        # the catch-all did not have to step in: a type check named the field first
        assert "cannot be read" not in message, message
        jsonl(_error_line(1, reject.custom_id, reject.code, message)).encode("utf-8")
        return "rejected"
    pa.Table.from_pylist([{**row, LINE: 1}], SCHEMA)  # the prepared table takes it
    prompt = json.loads(row[PROMPT])
    if isinstance(prompt, list) and row["kind"] != "embeddings":  # chat messages
        for message in prompt:
            assert isinstance(message["role"], str) and message["role"]
            assert isinstance(message["content"], (str, list))
    if row["kind"] != "embeddings":
        from udfs.stages.row_overrides import RowOverrides

        RowOverrides.of(row[OVERRIDES])  # the job's own check of a row's sampling passes
    assert row["max_tokens"] is None or 0 <= row["max_tokens"] < MAX_MODEL_LEN
    return "parsed"


FUZZ = settings(max_examples=EXAMPLES, deadline=None,
                suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large,
                                       HealthCheck.filter_too_much])


@FUZZ
@given(_changed(CHAT))
def test_chat_lines_parse_or_are_rejected(raw):
    _parses_or_rejects(raw)


@FUZZ
@given(_changed(COMPLETIONS))
def test_completions_lines_parse_or_are_rejected(raw):
    _parses_or_rejects(raw)


@FUZZ
@given(_changed(EMBEDDINGS))
def test_embeddings_lines_parse_or_are_rejected(raw):
    _parses_or_rejects(raw)


@FUZZ
@given(_changed(RESPONSES))
def test_responses_lines_parse_or_are_rejected(raw):
    _parses_or_rejects(raw)


@FUZZ
@given(_changed(ANTHROPIC))
@example(json.dumps({"custom_id": "a", "params": {"model": "m", "max_tokens": 10 ** 30,
                                                  "messages": [{"role": "user",
                                                                "content": "hi"}]}}))
def test_anthropic_lines_parse_or_are_rejected(raw):
    _parses_or_rejects(raw, "anthropic")


def _chat(**body) -> str:
    return json.dumps({"custom_id": "x", "method": "POST", "url": "/v1/chat/completions",
                       "body": {"messages": [{"role": "user", "content": "hi"}], **body}})


# the issue's own examples, and their kind: each once raised out of the parser
NAMED = {
    "json_schema a string": (_chat(response_format={"type": "json_schema",
                                                    "json_schema": "{}"}),
                             "body.response_format.json_schema: must be an object"),
    "$schema a list": (_chat(response_format={"type": "json_schema", "json_schema": {
        "schema": {"$schema": ["x"], "type": "object"}}}),
                       "json_schema.schema.$schema: must be a string"),
    "role a list": (_chat(messages=[{"role": ["user"], "content": "hi"}]),
                    "body.messages[0].role: must be a string"),
    "part type a list": (_chat(messages=[{"role": "user", "content": [{"type": ["text"]}]}]),
                         "body.messages[0].content[0]: parts of type"),
    "responses role a list": (json.dumps({
        "custom_id": "r", "method": "POST", "url": "/v1/responses",
        "body": {"input": [{"role": ["user"], "content": "hi"}]}}),
                              "body.input[0].role: one of user"),
    "tools numbers": (_chat(tools=[1, 2]), "body.tools[0]: only tools of type 'function'"),
    "nested too deep": ("[" * 100_000, "nested too deeply"),
    "an integer of 5,000 digits": (_chat().replace('"hi"', "9" * 5000),
                                   "Exceeds the limit (4300 digits)"),
    "a lone surrogate": (_chat().replace('"hi"', '"\\ud800"'), "a lone surrogate"),
    "seed past int64": (_chat(seed=10 ** 30), "body.seed"),
    "a superscript token id": (_chat(logit_bias={"²": 1}), "'²' is not a token id"),
}


@pytest.mark.parametrize("raw,needle", NAMED.values(), ids=NAMED.keys())
def test_the_issues_bad_lines_are_each_that_lines_error(raw, needle):
    with pytest.raises(_Reject) as caught:
        parse_request(raw, 16, MAX_MODEL_LEN)
    assert needle in caught.value.message, caught.value.message
    assert _parses_or_rejects(raw) == "rejected"


def test_a_file_of_bad_lines_prepares_its_good_ones(tmp_path):
    """``prepare`` over a file of every kind of bad line and good lines between them: the
    good ones are the table's rows, each bad one its own error line (a custom_id with a
    lone surrogate written escaped)."""
    good = [_chat(max_tokens=4).replace('"x"', f'"good-{i}"') for i in range(3)]
    bad = [raw for raw, _ in NAMED.values()]
    bad.append(json.dumps({"custom_id": "\ud800", "method": "POST", "url": "/v1/nope",
                           "body": {}}))
    lines = [good[0], *bad[:6], good[1], *bad[6:], good[2]]
    (tmp_path / "in.jsonl").write_text("\n".join(lines) + "\n", encoding="utf-8")
    prepared = prepare(tmp_path / "in.jsonl", tmp_path, 16, MAX_MODEL_LEN)
    assert (prepared.requests, prepared.rejected) == (3, len(bad))
    table = pq.read_table(prepared.table)
    assert table.column("custom_id").to_pylist() == ["good-0", "good-1", "good-2"]
    errors = [json.loads(text) for text in prepared.errors.read_text("utf-8").splitlines()]
    assert [e["error"]["line"] for e in errors] == [
        i for i, raw in enumerate(lines, 1) if raw in bad]
    assert errors[-1]["custom_id"] == "\ud800" and "custom_id" in errors[-1]["error"]["message"]


@settings(max_examples=200, deadline=None,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(st.lists(_changed(CHAT) | _changed(EMBEDDINGS) | st.sampled_from(
    ["[" * 5000, "{", "", "1" * 5000]), min_size=1, max_size=4))
def test_serves_file_check_never_raises(tmp_path_factory, lines):
    """``overnight serve``'s check of an uploaded file (serve/validate.py): file errors,
    never an exception (a nesting too deep for json.loads is an invalid_json_line)."""
    path = tmp_path_factory.mktemp("check") / "in.jsonl"
    path.write_text("\n".join(lines) + "\n", encoding="utf-8")
    checked = check_input_file(path, "/v1/chat/completions")
    assert checked.requests == sum(1 for text in lines if text.strip())
    if "[" * 5000 in lines:
        assert "invalid_json_line" in {e["code"] for e in checked.errors}


def test_a_line_nested_too_deep_is_skipped_when_a_files_format_is_read(tmp_path):
    """``overnight batch`` reads a file's format from its first JSON object: a first line
    nested too deep for json.loads is not one (it raised RecursionError, a traceback)."""
    from pipelines.batchfile.lines import file_format

    path = tmp_path / "in.jsonl"
    path.write_text("[" * 100_000 + "\n" + json.dumps({"custom_id": "a", "params": {}}) + "\n")
    assert file_format(path) == "anthropic"


def test_message_batches_refuse_a_custom_id_with_a_newline_and_a_body_too_deep(tmp_path):
    """``POST /v1/messages/batches``: a custom_id is matched whole (``$`` let "a\\n" through),
    and a body nested too deep for json.loads is a 400 in Anthropic's error object (it was a
    500)."""
    from fastapi import FastAPI, Request
    from fastapi.testclient import TestClient

    from serve.anthropic import add_routes
    from serve.store import Store

    app = FastAPI()

    @app.middleware("http")
    async def owner(request: Request, call_next):
        request.state.owner = "owner"
        return await call_next(request)

    class Runner:
        served_model = "m"

        def wake(self):
            pass

    add_routes(app, Store(tmp_path / "data"), Runner(), window_s=60)
    client = TestClient(app)
    params = {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}
    for custom_id in ("a\n", "a\r\n", "é", "a" * 65, ""):
        answer = client.post("/v1/messages/batches",
                             json={"requests": [{"custom_id": custom_id, "params": params}]})
        assert answer.status_code == 400, custom_id
        assert "custom_id" in answer.json()["error"]["message"]
    deep = client.post("/v1/messages/batches", content=b"[" * 100_000,
                       headers={"content-type": "application/json"})
    assert deep.status_code == 400
    assert deep.json() == {"type": "error", "error": {
        "type": "invalid_request_error", "message": "The request body is not valid JSON."}}
    made = client.post("/v1/messages/batches", content=json.dumps({"requests": [
        {"custom_id": "a-1", "params": {**params, "messages": [
            {"role": "user", "content": "\ud800"}]}}]}),  # escaped: the body is ASCII
        headers={"content-type": "application/json"})
    assert made.status_code == 200, made.text  # a lone surrogate: that request's error later
    staged = tmp_path / "data" / "batches" / made.json()["id"] / "input.jsonl"
    assert json.loads(staged.read_text("utf-8"))["params"]["messages"][0]["content"] == "\ud800"
