"""Tool calls in batch (model.tool_parser): an OpenAI Batch file mixing forced, required, auto
and none choices and a conversation with a tool result, against vLLM's own run_batch with the
same parser; and a table job whose forced function fills a struct column."""

from __future__ import annotations

import json
import os
import subprocess
import time
import sys

import jsonschema
import polars as pl
import pytest

from conftest import KV_CACHE, cli, job_config, one_line_error, write_jsonl
from pipelines.tools.tiny_model import CANNED_TOOL_CALL

# Short arguments whatever a random model writes: an enum and a boolean, nothing else
TAG_SCHEMA = {"type": "object", "properties": {
    "color": {"type": "string", "enum": ["red", "blue", "green"]},
    "in_stock": {"type": "boolean"}},
    "required": ["color", "in_stock"], "additionalProperties": False}
TAG = {"type": "function", "function": {"name": "tag_product", "description": "Tag a product.",
                                        "parameters": TAG_SCHEMA}}
LOOKUP = {"type": "function", "function": {
    "name": "lookup", "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                                     "required": ["q"]}}}
SIZE = {"type": "function", "function": {"name": "set_size", "parameters": {
    "type": "object", "properties": {"size": {"type": "string", "enum": ["S", "M", "L"]}},
    "required": ["size"], "additionalProperties": False}}}
USER = [{"role": "user", "content": "Tag this: a red desk lamp, in stock."}]
ENGINE = ["model.tool_parser=hermes", "model.dtype=float32", "model.max_model_len=512",
          f"engine.kv_cache_memory_bytes={KV_CACHE}", "resources.batch_size=8"]


def chat(custom_id: str, **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": "tiny", "temperature": 0, "max_tokens": 40, "messages": USER,
                     **body}}


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    out = tmp_path_factory.mktemp("tiny-tools") / "model"
    assert cli("tiny-model", out, "--tools")[0] == 0
    return str(out)


@pytest.fixture(scope="module")
def canned_id(tools_model) -> int:
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model).convert_tokens_to_ids(CANNED_TOOL_CALL)


@pytest.fixture(scope="module")
def lines(canned_id) -> dict[str, dict]:
    """The runnable lines, by custom_id: vLLM's run_batch gets these too."""
    conversation = [*USER, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"q": "desk lamp ☕"})}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 lamps: red, blue, green"}]
    out = [
        chat("forced", tools=[TAG], tool_choice={"type": "function",
                                                 "function": {"name": "tag_product"}}),
        # a random model writes no call of its own: the bias makes it write the canned one
        chat("auto", tools=[TAG, LOOKUP], tool_choice="auto", max_tokens=1,
             logit_bias={str(canned_id): 100}),
        chat("auto-text", tools=[TAG, LOOKUP], max_tokens=8),
        chat("none", tools=[TAG], tool_choice="none", max_tokens=8),
        chat("conversation", tools=[TAG, LOOKUP], messages=conversation, max_tokens=8),
    ]
    return {line["custom_id"]: line for line in out}


BAD = {  # custom_id -> (the body's tools part, what its error names)
    "bad-schema": ({"tools": [{"type": "function", "function": {
        "name": "f", "parameters": {"type": "objec"}}}]},
        "body.tools[0].function.parameters: not a valid JSON Schema"),
    "undeclared-choice": ({"tools": [TAG], "tool_choice": {
        "type": "function", "function": {"name": "nope"}}},
        "body.tool_choice: names 'nope', which is not one of the declared tools"),
    "orphan-result": ({"tools": [TAG], "messages": [*USER, {
        "role": "tool", "tool_call_id": "call_9", "content": "x"}]},
        "body.messages[1].tool_call_id: 'call_9' answers no earlier assistant tool call"),
}


@pytest.fixture(scope="module")
def ours(lines, tools_model, tmp_path_factory, ray_cluster):
    from pipelines.batchfile.run import run_batch_file

    root = tmp_path_factory.mktemp("tool-batch")
    bad = [chat(cid, **body) for cid, (body, _) in BAD.items()]
    write_jsonl(root / "in.jsonl", [*lines.values(), *bad])
    counts = run_batch_file(root / "in.jsonl", root / "out.jsonl", model=tools_model,
                            overrides=ENGINE, served_model_name="tiny")
    results = {r["custom_id"]: r for r in map(json.loads, open(root / "out.jsonl"))}
    errors = {r["custom_id"]: r for r in map(json.loads, open(root / "out.errors.jsonl"))}
    return counts, results, errors


@pytest.fixture(scope="module")
def theirs(lines, tools_model, tmp_path_factory) -> dict:
    """vLLM 0.32's run_batch with the same parser, settings and structured-output backend,
    and its JSON-Schema tool path (VLLM_ENFORCE_STRICT_TOOL_CALLING=0, as the engine's)."""
    root = tmp_path_factory.mktemp("vllm-tool-batch")
    write_jsonl(root / "in.jsonl", list(lines.values()))
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
         "-i", str(root / "in.jsonl"), "-o", str(root / "out.jsonl"), "--model", tools_model,
         "--served-model-name", "tiny", "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(KV_CACHE), "--enforce-eager",
         "--no-enable-chunked-prefill", "--enable-auto-tool-choice",
         "--tool-call-parser", "hermes", "--structured-outputs-config",
         json.dumps({"backend": "guidance", "disable_any_whitespace": True})],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
             "VLLM_ENFORCE_STRICT_TOOL_CALLING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    return {r["custom_id"]: r["response"]["body"]
            for r in map(json.loads, (root / "out.jsonl").read_text().splitlines())}


def _message(body: dict) -> tuple:
    """A result's message as compared: content, calls (ids aside: vLLM's are random), finish
    reason, usage."""
    choice = body["choices"][0]
    calls = [(c["type"], c["function"]["name"], c["function"]["arguments"])
             for c in choice["message"].get("tool_calls") or ()]
    usage = {k: body["usage"][k] for k in ("prompt_tokens", "completion_tokens")}
    return choice["message"]["content"], calls, choice["finish_reason"], usage


def test_auto_none_and_a_conversation_equal_vllms_run_batch(ours, theirs):
    _, results, _ = ours
    for cid in ("auto", "auto-text", "none", "conversation"):
        assert _message(results[cid]["response"]["body"]) == _message(theirs[cid]), cid
    # the bias made the auto line call, and both parsed the call alike
    content, calls, finish, _ = _message(results["auto"]["response"]["body"])
    assert calls == [("function", "lookup", json.dumps({"q": "x"}))]
    assert finish == "tool_calls"


def test_a_forced_call_validates_and_equals_vllms(ours, theirs):
    _, results, _ = ours
    body = results["forced"]["response"]["body"]
    content, calls, finish, _ = _message(body)
    assert content == "" and finish == "tool_calls" and len(calls) == 1, body
    assert calls[0][1] == "tag_product"
    jsonschema.validate(json.loads(calls[0][2]), TAG_SCHEMA)
    # vLLM's server, on the same JSON-Schema path, made the same call (its finish_reason for
    # a named call is "stop", OpenAI's; overnight says "tool_calls" for every call made)
    assert _message(theirs["forced"])[1] == calls
    assert body["choices"][0]["message"]["tool_calls"][0]["id"].startswith("call_")


def test_a_real_model_answers_required_and_forced_lines_with_valid_calls(tmp_path, smollm2,
                                                                         ray_cluster):
    """vLLM's schema for required (an array of {name, parameters}) leaves an item's other
    keys open, which a random model fills until max_tokens: the real demo model shows it."""
    from pipelines.batchfile.run import run_batch_file

    lines = [chat("required", tools=[TAG, SIZE], tool_choice="required",
                  parallel_tool_calls=False, max_tokens=60),
             chat("forced", tools=[TAG, SIZE], max_tokens=60,
                  tool_choice={"type": "function", "function": {"name": "set_size"}},
                  messages=[{"role": "user", "content": "The lamp is small. Set its size."}])]
    write_jsonl(tmp_path / "in.jsonl", lines)
    run_batch_file(tmp_path / "in.jsonl", tmp_path / "out.jsonl", model=smollm2,
                   overrides=[*ENGINE[:2], "model.max_model_len=1024",
                              f"engine.kv_cache_memory_bytes={KV_CACHE}"])
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (TAG, SIZE)}
    results = {r["custom_id"]: r for r in map(json.loads, open(tmp_path / "out.jsonl"))}
    for cid in ("required", "forced"):
        content, calls, finish, _ = _message(results[cid]["response"]["body"])
        assert content == "" and finish == "tool_calls" and len(calls) == 1, results[cid]
        _, name, arguments = calls[0]
        assert name == "set_size" or cid == "required"
        jsonschema.validate(json.loads(arguments), schemas[name])


def test_each_bad_tools_line_is_its_own_error_and_the_rest_complete(ours):
    counts, results, errors = ours
    assert counts["results"] == 5 and counts["errors"] == 3
    for cid, (_, needle) in BAD.items():
        error = errors[cid]["error"]
        assert error["code"] == "invalid_body" and needle in error["message"], error


def test_results_parse_with_the_openai_client(ours):
    from openai.types.chat import ChatCompletion

    _, results, _ = ours
    for cid in ("forced", "auto"):
        message = ChatCompletion.model_validate(
            results[cid]["response"]["body"]).choices[0].message
        assert message.tool_calls and json.loads(message.tool_calls[0].function.arguments)


# --- a table job -----------------------------------------------------------------------------

TABLE_ROWS = 400


@pytest.fixture(scope="module")
def tool_job(tools_model, tmp_path_factory, ray_cluster):
    import yaml

    root = tmp_path_factory.mktemp("tool-job")
    write_jsonl(root / "in.jsonl", [{"title": f"Lamp {i}", "description": f"lamp number {i}"}
                                    for i in range(TABLE_ROWS)])
    config = job_config(tools_model, root / "in.jsonl", root / "out",
                        model={"tool_parser": "hermes"},
                        prompt={"tools": [TAG], "tool_choice": "tag_product"},
                        sampling={"max_tokens": 24}, resources={"batch_size": 100})
    (root / "job.yaml").write_text(yaml.safe_dump(config))
    code = cli("run", root / "job.yaml")[0]
    return code, root


def test_a_forced_function_fills_a_struct_column_typed_by_its_schema(tool_job):
    code, root = tool_job
    assert code == 0
    out = pl.read_parquet(root / "out")
    assert out.height == TABLE_ROWS
    assert out.schema["parsed"] == pl.Struct({"color": pl.String, "in_stock": pl.Boolean})
    assert out.schema["tool_calls"] == pl.List(pl.Struct(
        {"id": pl.String, "name": pl.String, "arguments": pl.String}))
    done = out.filter(pl.col("error").is_null())
    assert done.height > 0
    for row in done.iter_rows(named=True):
        arguments = json.loads(row["tool_calls"][0]["arguments"])
        jsonschema.validate(arguments, TAG_SCHEMA)
        assert row["parsed"] == arguments
        assert row["rewritten"] == row["tool_calls"][0]["arguments"]
        assert row["finish_reason"] == "tool_calls"
    for row in out.filter(pl.col("error").is_not_null()).iter_rows(named=True):
        assert row["error_kind"] == "parse_error" and row["rewritten"] is not None


def test_a_tool_job_is_refused_before_any_engine_in_one_line(tmp_path, tools_model, capsys):
    import yaml

    write_jsonl(tmp_path / "in.jsonl", [{"title": "a", "description": "b"}])
    cases = {
        "no parser": ({"prompt": {"tools": [TAG], "tool_choice": "required"}},
                      "prompt.tool_choice 'required' needs model.tool_parser"),
        "wrong parser": ({"model": {"tool_parser": "hermse"}, "prompt": {"tools": [TAG]}},
                         "did you mean 'hermes'"),
        "undeclared": ({"prompt": {"tools": [TAG], "tool_choice": "nope"}},
                       "tool_choice: names 'nope'"),
        "bad schema": ({"prompt": {"tools": [{"type": "function", "function": {
            "name": "f", "parameters": {"type": 3}}}]}}, "parameters: not a valid JSON Schema"),
    }
    for name, (sections, needle) in cases.items():
        config = job_config(tools_model, tmp_path / "in.jsonl", tmp_path / "out", **sections)
        (tmp_path / "job.yaml").write_text(yaml.safe_dump(config))
        code, _, err = cli("validate", tmp_path / "job.yaml", capsys=capsys)
        assert code == 2, name
        one_line_error(err, needle)


def test_a_forced_tool_through_overnight_serve_with_both_official_clients(tools_model,
                                                                          tmp_path):
    """The same forced call as a Message Batch (the anthropic client) and as an OpenAI batch
    (the openai client), on `overnight serve --engine per-batch` with model.tool_parser: a
    tool_use block whose input validates and equals the chat call's arguments."""
    import anthropic

    from servers import KEY, Server, lines_of, wait

    server = Server(tmp_path, tools_model, "--engine", "per-batch")
    config = json.loads((tmp_path / "job.yaml").read_text())
    config["model"]["tool_parser"] = "hermes"
    (tmp_path / "job.yaml").write_text(json.dumps(config))
    server.start()
    try:
        client = anthropic.Anthropic(base_url=f"http://127.0.0.1:{server.port}", api_key=KEY,
                                     max_retries=0)
        tool = {"name": "tag_product", "description": "Tag a product.",
                "input_schema": TAG_SCHEMA}
        created = client.messages.batches.create(requests=[{"custom_id": "forced", "params": {
            "model": "tiny", "max_tokens": 40, "temperature": 0, "messages": USER,
            "tools": [tool], "tool_choice": {"type": "tool", "name": "tag_product"}}}])
        openai_client = server.client()
        (tmp_path / "twin.jsonl").write_text(json.dumps(chat("forced", tools=[TAG], tool_choice={
            "type": "function", "function": {"name": "tag_product"}})) + "\n")
        uploaded = openai_client.files.create(file=tmp_path / "twin.jsonl", purpose="batch")
        twin = openai_client.batches.create(input_file_id=uploaded.id, completion_window="24h",
                                            endpoint="/v1/chat/completions")
        chat_call = lines_of(openai_client, wait(openai_client, twin.id)[-1].output_file_id)[0][
            "response"]["body"]["choices"][0]["message"]["tool_calls"][0]["function"]
        while client.messages.batches.retrieve(created.id).processing_status != "ended":
            time.sleep(0.5)
        result = next(iter(client.messages.batches.results(created.id))).result
        assert result.type == "succeeded", (result, server.log())
        message = result.message
        assert message.stop_reason == "tool_use"
        block = next(b for b in message.content if b.type == "tool_use")
        assert block.name == "tag_product"
        jsonschema.validate(block.input, TAG_SCHEMA)
        assert block.input == json.loads(chat_call["arguments"])
    finally:
        server.stop()


# --- a tools value, checked (no engine) -------------------------------------------------------

def test_a_schema_reference_outside_the_schema_is_refused_and_never_fetched(tmp_path):
    from pipelines.batchfile.lines import Reject, parse_request
    from udfs.rows.parsers import SchemaError, StructuredSpec
    from udfs.rows.tool_calls import call_problem, read_spec, tool_spec

    secret = tmp_path / "secret.json"
    secret.write_text('{"enum": ["TOPSECRET"]}')
    for ref in (secret.as_uri(), "http://127.0.0.1:9/schema"):
        schema = {"type": "object", "properties": {"a": {"$ref": ref}}}
        tool = {"type": "function", "function": {"name": "f", "parameters": schema}}
        with pytest.raises(Reject) as caught:
            parse_request(json.dumps(chat("x", tools=[tool])), 16, 512, tool_parser="hermes")
        assert "points outside the schema" in caught.value.message
        with pytest.raises(SchemaError, match="points outside the schema"):
            StructuredSpec(json_schema=schema).check()
    # a schema's own places are followed; checking a call reads nothing else
    local = {"type": "object", "$defs": {"c": {"enum": ["red"]}},
             "properties": {"color": {"$ref": "#/$defs/c"}}}
    spec = read_spec(tool_spec([{"type": "function", "function": {
        "name": "f", "parameters": local}}], "f"))
    assert call_problem(spec, [{"name": "f", "arguments": '{"color": "red"}'}]) is None
    assert "do not match" in call_problem(spec, [{"name": "f",
                                                    "arguments": '{"color": "blue"}'}])


def test_a_rows_tools_value_is_checked_as_a_lines_tools_are():
    from udfs.rows.tool_calls import ToolError, read_spec, row_spec

    tools = [{"type": "function", "function": {"name": "f", "strict": True}}]
    assert read_spec(row_spec(json.dumps({"tools": tools})))["tool_choice"] == "auto"
    for value, needle in (("not json", "not JSON"), ('{"tools": []}', "non-empty list"),
                          ('{"tools": [], "extra": 1}', "must be a JSON object of"),
                          (json.dumps({"tools": [{"type": "function", "function": {
                              "name": "f", "extra": 1}}]}), "function.extra: not supported")):
        with pytest.raises(ToolError, match=needle):
            row_spec(value)


def test_an_earlier_calls_unreadable_arguments_are_an_empty_object():
    from udfs.stages.chat_tools import normalize_tool_messages

    for arguments in ("[" * 100_000, "1" * 5000, "{not json"):
        messages = [{"role": "assistant", "content": None, "tool_calls": [{
            "id": "c", "type": "function", "function": {"name": "f", "arguments": arguments}}]}]
        out = normalize_tool_messages(messages, "string")
        assert out[0]["tool_calls"][0]["function"]["arguments"] == {}
