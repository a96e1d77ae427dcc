"""Tools on Anthropic Message Batches lines and /v1/responses lines (issue #60, items 2 and 3):
each mapped to the chat path's tools, choice and tool turns as vLLM's servers map them, each
refusal that line's error, and results the official clients parse; then one small run of both
beside their OpenAI chat twins on the tiny tool-calling model."""

from __future__ import annotations

import json

import jsonschema
import pytest

from pipelines.batchfile import anthropic, responses
from pipelines.batchfile.lines import PROMPT, TOOLS, parse_request
from pipelines.batchfile.lines import Reject as _Reject

SCHEMA = {"type": "object", "properties": {"color": {"enum": ["red", "blue"]},
                                           "in_stock": {"type": "boolean"}},
          "required": ["color", "in_stock"], "additionalProperties": False}
LOOKUP = {"type": "object", "properties": {"q": {"type": "string"}}, "required": ["q"]}
# the same two tools in each API's shape
ANTHROPIC_TOOLS = [{"name": "tag", "description": "Tag a product.", "input_schema": SCHEMA,
                    "cache_control": {"type": "ephemeral"}},
                   {"name": "lookup", "input_schema": LOOKUP, "strict": True}]
CHAT_TOOLS = [{"type": "function", "function": {"name": "tag", "description": "Tag a product.",
                                                "parameters": SCHEMA}},
              {"type": "function", "function": {"name": "lookup", "parameters": LOOKUP}}]
RESPONSES_TOOLS = [{"type": "function", "name": "tag", "description": "Tag a product.",
                    "parameters": SCHEMA, "strict": True},
                   {"type": "function", "name": "lookup", "parameters": LOOKUP}]
ARGS = {"q": "café lamp"}


def message_line(custom_id="a", **params) -> dict:
    return {"custom_id": custom_id, "params": {
        "model": "claude-sonnet-4-5", "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "Tag this lamp."}], **params}}


def chat_line(custom_id="a", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions", "body": {
        "model": "m", "max_tokens": 40, "temperature": 0,
        "messages": [{"role": "user", "content": "Tag this lamp."}], **body}}


def responses_line(custom_id="a", **body) -> dict:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/responses", "body": {
        "model": "m", "max_output_tokens": 40, "temperature": 0, "input": "Tag this lamp.",
        **body}}


def parsed(line: dict, tool_parser: str | None = "hermes") -> dict:
    fmt = anthropic.FORMAT if "params" in line else "openai"
    return parse_request(json.dumps(line), 16, 512, fmt, tool_parser)


def refusal(line: dict, tool_parser: str | None = "hermes") -> str:
    with pytest.raises(_Reject) as caught:
        parsed(line, tool_parser)
    assert caught.value.code in ("invalid_request", "invalid_body")
    return caught.value.message


# -- Anthropic: tools and tool_choice ----------------------------------------------------------

@pytest.mark.parametrize("choice, expected, parallel", [
    (None, "auto", True),
    ({"type": "auto"}, "auto", True),
    ({"type": "any"}, "required", True),
    ({"type": "none"}, "none", True),
    ({"type": "tool", "name": "tag"}, {"type": "function", "function": {"name": "tag"}}, True),
    ({"type": "any", "disable_parallel_tool_use": True}, "required", False),
])
def test_anthropic_tools_and_choices_are_the_chat_twins(choice, expected, parallel):
    params = {"tools": ANTHROPIC_TOOLS, **({"tool_choice": choice} if choice else {})}
    row = parsed(message_line(**params))
    twin = parsed(chat_line(tools=CHAT_TOOLS, tool_choice=expected,
                            parallel_tool_calls=parallel))
    assert json.loads(row[TOOLS]) == json.loads(twin[TOOLS])
    assert json.loads(row[TOOLS])["parallel_tool_calls"] is parallel


def test_anthropic_tool_turns_are_the_chat_twins_messages():
    conversation = [
        {"role": "user", "content": "Find a lamp."},
        {"role": "assistant", "content": [
            {"type": "text", "text": "Looking."},
            {"type": "tool_use", "id": "toolu_1", "name": "lookup", "input": ARGS},
            {"type": "tool_use", "id": "toolu_2", "name": "tag",
             "input": {"color": "red", "in_stock": True}}]},
        # results before the turn's text, whatever their order (vLLM's order)
        {"role": "user", "content": [
            {"type": "text", "text": "Here."},
            {"type": "tool_result", "tool_use_id": "toolu_1", "is_error": False,
             "content": [{"type": "text", "text": "3 lamps"}, {"type": "text", "text": "1 red"}]},
            {"type": "tool_result", "tool_use_id": "toolu_2", "content": "tagged"}]},
        {"role": "assistant", "content": [
            {"type": "tool_use", "id": "toolu_3", "name": "lookup", "input": {"q": "x"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_3"}]},
    ]
    calls = [{"id": "toolu_1", "type": "function",
              "function": {"name": "lookup", "arguments": json.dumps(ARGS)}},
             {"id": "toolu_2", "type": "function", "function": {
                 "name": "tag", "arguments": json.dumps({"color": "red", "in_stock": True})}}]
    chat = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Find a lamp."},
        {"role": "assistant", "content": "Looking.", "tool_calls": calls},
        {"role": "tool", "tool_call_id": "toolu_1", "content": "3 lamps\n1 red"},
        {"role": "tool", "tool_call_id": "toolu_2", "content": "tagged"},
        {"role": "user", "content": "Here."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "toolu_3", "type": "function",
             "function": {"name": "lookup", "arguments": '{"q": "x"}'}}]},
        {"role": "tool", "tool_call_id": "toolu_3", "content": ""},
    ]
    row = parsed(message_line(system="Be brief.", messages=conversation, tools=ANTHROPIC_TOOLS))
    twin = parsed(chat_line(messages=chat, tools=CHAT_TOOLS))
    assert json.loads(row[PROMPT]) == json.loads(twin[PROMPT]) == chat


@pytest.mark.parametrize("params, needle", [
    ({"tools": [{"type": "web_search_20250305", "name": "web_search", "max_uses": 2}]},
     "params.tools[0].type: 'web_search_20250305' is a server tool, which overnight cannot run"),
    ({"tools": [{"name": "t", "input_schema": {"type": "objekt"}}]},
     "params.tools[0].input_schema: not a valid JSON Schema"),
    ({"tools": [{"name": "t"}]}, "params.tools[0].input_schema: a tool needs"),
    ({"tools": [{"name": "t", "input_schema": LOOKUP, "defer_loading": True}]},
     "params.tools[0].defer_loading: not supported by overnight"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "tool", "name": "nope"}},
     "params.tool_choice: names 'nope', which is not one of the declared tools (tag, lookup)"),
    ({"tools": ANTHROPIC_TOOLS, "tool_choice": {"type": "function"}},
     "params.tool_choice: must be"),
    ({"tool_choice": {"type": "any"}}, "params.tool_choice: needs params.tools"),
    ({"tools": [*ANTHROPIC_TOOLS, ANTHROPIC_TOOLS[1]]},
     "params.tools[2].name: 'lookup' is declared twice"),
    ({"tools": ANTHROPIC_TOOLS, "messages": [
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_9"}]}]},
     "params.messages[0].content[0].tool_use_id: 'toolu_9' answers no earlier tool_use block"),
    ({"messages": [{"role": "user", "content": [
        {"type": "tool_use", "id": "t", "name": "lookup", "input": {}}]}]},
     "params.messages[0].content[0]: tool_use blocks go in an assistant turn"),
    ({"messages": [{"role": "user", "content": "hi"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "lookup", "input": "q"}]},
        {"role": "user", "content": "ok"}]},
     "params.messages[1].content[0].input: must be an object"),
])
def test_anthropic_tool_refusals_are_that_lines_error(params, needle):
    assert needle in refusal(message_line(**params))


def test_anthropic_tools_need_a_parser_unless_the_choice_is_none():
    assert "auto (the default with tools) needs a tool-call parser" in refusal(
        message_line(tools=ANTHROPIC_TOOLS), tool_parser=None)
    row = parsed(message_line(tools=ANTHROPIC_TOOLS, tool_choice={"type": "none"}), None)
    assert json.loads(row[TOOLS])["tool_choice"] == "none"


# -- Anthropic: results ------------------------------------------------------------------------

def _sample(**row) -> dict:
    return {"custom_id": "a", "line": 3, "text": "", "finish_reason": "stop",
            "overrides": json.dumps({"logprobs": None, "n": 1}), "prompt_tokens": 20,
            "completion_tokens": 9, **row}


def _call(i: int, name: str, arguments: str) -> dict:
    return {"id": f"chatcmpl-tool-{i}", "type": "function",
            "function": {"name": name, "arguments": arguments}}


def test_anthropic_results_hold_tool_use_blocks_the_client_parses():
    from anthropic.types import Message

    calls = [_call(0, "tag", '{"color": "blue", "in_stock": false}'),
             _call(1, "lookup", json.dumps(ARGS, ensure_ascii=False))]
    forced = anthropic.succeeded(_sample(), "m", False, {"content": "", "tool_calls": calls})
    message = Message.model_validate(forced["result"]["message"])
    assert message.stop_reason == "tool_use" and message.stop_sequence is None
    assert [(b.type, b.id, b.name, b.input) for b in message.content] == [
        ("tool_use", "chatcmpl-tool-0", "tag", {"color": "blue", "in_stock": False}),
        ("tool_use", "chatcmpl-tool-1", "lookup", ARGS)]

    auto = anthropic.succeeded(_sample(text="Sure. <tool_call>"), "m", False,
                               {"content": "Sure. ", "tool_calls": calls[:1]})
    message = Message.model_validate(auto["result"]["message"])
    assert [b.type for b in message.content] == ["text", "tool_use"]
    assert message.content[0].text == "Sure. "

    cut = anthropic.succeeded(_sample(finish_reason="length"), "m", False,
                              {"content": "", "tool_calls": calls[:1]})
    assert Message.model_validate(cut["result"]["message"]).stop_reason == "max_tokens"

    plain = anthropic.succeeded(_sample(text="Hi."), "m", False, {"content": "Hi."})
    message = Message.model_validate(plain["result"]["message"])
    assert message.stop_reason == "end_turn" and message.content[0].text == "Hi."


def test_anthropic_arguments_cut_at_max_tokens_are_text_and_no_object_otherwise_an_error():
    """A call cut at max_tokens is answered as the budget running out (what it wrote, as
    text); arguments that are JSON but no object, with the model stopped, are the request's
    errored result: no tool_use block can hold them."""
    from anthropic.types.messages import MessageBatchIndividualResponse

    line = anthropic.succeeded(_sample(finish_reason="length"), "m", False, {
        "content": "", "tool_calls": [_call(0, "tag", '{"color": "bl')]})
    result = MessageBatchIndividualResponse.model_validate(line).result
    assert result.type == "succeeded" and result.message.stop_reason == "max_tokens"
    assert [b.text for b in result.message.content] == ['{"color": "bl']
    line = anthropic.succeeded(_sample(), "m", False, {
        "content": "", "tool_calls": [_call(0, "tag", "[1, 2]")]})
    result = MessageBatchIndividualResponse.model_validate(line).result
    assert result.type == "errored" and result.error.error.type == "api_error"
    assert "tool call 0 (tag): its arguments are not a JSON object (finish_reason stop)" \
        in result.error.error.message


# -- Responses: tools, choices and input items -------------------------------------------------

@pytest.mark.parametrize("choice, expected", [
    (None, "auto"), ("none", "none"), ("required", "required"),
    ({"type": "function", "name": "tag"}, {"type": "function", "function": {"name": "tag"}}),
])
def test_responses_tools_and_choices_are_the_chat_twins(choice, expected):
    body = {"tools": RESPONSES_TOOLS, "parallel_tool_calls": False,
            **({"tool_choice": choice} if choice else {})}
    row = parsed(responses_line(**body))
    twin = parsed(chat_line(tools=CHAT_TOOLS, tool_choice=expected, parallel_tool_calls=False))
    assert json.loads(row[TOOLS]) == json.loads(twin[TOOLS])


def test_responses_function_call_items_are_the_chat_twins_messages():
    items = [
        {"role": "user", "content": "Find a lamp."},
        {"type": "message", "role": "assistant",
         "content": [{"type": "output_text", "text": "Looking."}]},
        {"type": "function_call", "id": "fc_1", "call_id": "call_1", "name": "lookup",
         "arguments": json.dumps(ARGS), "status": "completed"},
        {"type": "function_call", "call_id": "call_2", "name": "tag", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "3 lamps"},
        {"type": "function_call_output", "call_id": "call_2", "output": "tagged"},
        # a call with no message before it makes one; an assistant's text then fills it
        {"type": "function_call", "call_id": "call_3", "name": "lookup", "arguments": "{}"},
        {"role": "assistant", "content": "Done looking."},
        {"type": "function_call_output", "call_id": "call_3", "output": "none"},
    ]
    chat = [
        {"role": "user", "content": "Find a lamp."},
        {"role": "assistant", "content": "Looking.", "tool_calls": [
            _call(0, "lookup", json.dumps(ARGS)) | {"id": "call_1"},
            _call(0, "tag", "{}") | {"id": "call_2"}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 lamps"},
        {"role": "tool", "tool_call_id": "call_2", "content": "tagged"},
        {"role": "assistant", "content": "Done looking.", "tool_calls": [
            _call(0, "lookup", "{}") | {"id": "call_3"}]},
        {"role": "tool", "tool_call_id": "call_3", "content": "none"},
    ]
    row = parsed(responses_line(input=items, tools=RESPONSES_TOOLS))
    twin = parsed(chat_line(messages=chat, tools=CHAT_TOOLS))
    assert json.loads(row[PROMPT]) == json.loads(twin[PROMPT]) == chat


@pytest.mark.parametrize("body, needle", [
    ({"tools": [{"type": "web_search"}]},
     "body.tools[0].type: 'web_search' tools are not supported by overnight"),
    ({"tools": [{"type": "function", "name": "t", "parameters": {"type": "objekt"}}]},
     "body.tools[0].parameters: not a valid JSON Schema"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "function", "name": "nope"}},
     "body.tool_choice: names 'nope', which is not one of the declared tools"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": {"type": "allowed_tools", "tools": []}},
     "body.tool_choice: must be none, auto, required or"),
    ({"tool_choice": "required"}, "body.tool_choice: needs body.tools"),
    ({"tools": RESPONSES_TOOLS, "input": [
        {"role": "user", "content": "hi"},
        {"type": "function_call_output", "call_id": "call_9", "output": "x"}]},
     "body.input[1].call_id: 'call_9' answers no earlier function_call item"),
    ({"input": [{"type": "function_call", "call_id": "c", "name": "t", "arguments": {}}]},
     "body.input[0].arguments: must be a string"),
    ({"tools": RESPONSES_TOOLS, "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}},
     "body.text.format does not go with a tool_choice other than none"),
])
def test_responses_tool_refusals_are_that_lines_error(body, needle):
    assert needle in refusal(responses_line(**body))


def test_responses_tools_need_a_parser_unless_the_choice_is_none():
    assert "body.tool_choice: auto needs a tool-call parser" in refusal(
        responses_line(tools=RESPONSES_TOOLS), tool_parser=None)
    assert parsed(responses_line(tools=RESPONSES_TOOLS, tool_choice="none"), None)[TOOLS]


def test_responses_results_hold_function_call_items_the_client_parses():
    from openai.types.responses import Response

    row = parsed(responses_line(tools=RESPONSES_TOOLS, tool_choice="required",
                                parallel_tool_calls=False))
    calls = [_call(0, "lookup", json.dumps(ARGS))]
    body = responses.result_body(_sample(tools=row[TOOLS], max_tokens=40), "m", 0,
                                 {"content": "", "tool_calls": calls})
    response = Response.model_validate(body)
    [item] = response.output
    assert (item.type, item.call_id, item.name, item.arguments, item.status) == (
        "function_call", "chatcmpl-tool-0", "lookup", json.dumps(ARGS), "completed")
    assert item.id.startswith("fc_")
    assert response.tool_choice == "required" and response.parallel_tool_calls is False
    assert [t.name for t in response.tools] == ["tag", "lookup"]

    named = parsed(responses_line(tools=RESPONSES_TOOLS,
                                  tool_choice={"type": "function", "name": "tag"}))
    body = responses.result_body(_sample(tools=named[TOOLS], max_tokens=40), "m", 0,
                                 {"content": "Sure.", "tool_calls": calls * 2})
    response = Response.model_validate(body)
    assert [i.type for i in response.output] == ["message", "function_call", "function_call"]
    assert response.output[0].content[0].text == "Sure."
    assert response.output[1].id != response.output[2].id
    assert response.tool_choice.name == "tag"

    plain = Response.model_validate(responses.result_body(
        _sample(text="Hi.", tools=None, max_tokens=40), "m", 0))
    assert [i.type for i in plain.output] == ["message"] and plain.tools == []


# -- one run of both, beside their chat twins, on the tiny tool-calling model ------------------

RUN_SETTINGS = ["model.tool_parser=hermes", "model.dtype=float32", "model.max_model_len=512",
                "engine.kv_cache_memory_bytes=134217728"]
TALK = [{"role": "user", "content": "Find a lamp."}]
TALK_CALL = {"id": "call_1", "name": "lookup", "input": ARGS}


@pytest.fixture(scope="module")
def tool_runs(ray_cluster, tmp_path_factory):
    """An OpenAI Batch file (chat lines and their /v1/responses twins) and a Message Batches
    file of the same requests: a forced tool and a conversation with a call and its
    result, run on the tiny tool-calling model with vLLM's hermes parser."""
    from pipelines.batchfile.run import run_batch_file
    from pipelines.tools.tiny_model import build_tiny_model

    root = tmp_path_factory.mktemp("tool-runs")
    model = str(build_tiny_model(root / "model", tools=True))
    tag_chat = [CHAT_TOOLS[0]]
    call = {"id": "call_1", "type": "function",
            "function": {"name": "lookup", "arguments": json.dumps(ARGS)}}
    chat = [
        chat_line("forced", tools=tag_chat,
                  tool_choice={"type": "function", "function": {"name": "tag"}}),
        chat_line("talk", max_tokens=6, tools=CHAT_TOOLS, messages=[
            *TALK, {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "3 lamps"}]),
    ]
    twins = [
        responses_line("r-forced", tools=[RESPONSES_TOOLS[0] | {"strict": False}],
                       tool_choice={"type": "function", "name": "tag"}),
        responses_line("r-talk", max_output_tokens=6, tools=RESPONSES_TOOLS, input=[
            *TALK, {"type": "function_call", "call_id": "call_1", "name": "lookup",
                    "arguments": json.dumps(ARGS)},
            {"type": "function_call_output", "call_id": "call_1", "output": "3 lamps"}]),
    ]
    messages = [
        message_line("forced", tools=[ANTHROPIC_TOOLS[0]],
                     tool_choice={"type": "tool", "name": "tag"}),
        message_line("talk", max_tokens=6, tools=ANTHROPIC_TOOLS, messages=[
            *TALK, {"role": "assistant", "content": [{"type": "tool_use", **TALK_CALL}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "call_1",
                                          "content": "3 lamps"}]}]),
    ]
    out = {}
    for name, lines in (("openai", chat + twins), ("anthropic", messages)):
        (root / f"{name}.jsonl").write_text("".join(json.dumps(x) + "\n" for x in lines))
        counts = run_batch_file(root / f"{name}.jsonl", root / f"{name}-results.jsonl",
                                model=model, overrides=RUN_SETTINGS)
        assert counts["errors"] == 0 and counts["results"] == len(lines), counts
        out[name] = {r["custom_id"]: r for r in map(
            json.loads, (root / f"{name}-results.jsonl").read_text().splitlines())}
    return out


def test_a_forced_tool_is_a_tool_use_block_equal_to_the_chat_twins_call(tool_runs):
    from anthropic.types.messages import MessageBatchIndividualResponse
    from openai.types.responses import Response

    chat = tool_runs["openai"]["forced"]["response"]["body"]["choices"][0]["message"]
    [chat_call] = chat["tool_calls"]
    arguments = json.loads(chat_call["function"]["arguments"])
    jsonschema.validate(arguments, SCHEMA)

    result = MessageBatchIndividualResponse.model_validate(tool_runs["anthropic"]["forced"])
    message = result.result.message
    assert message.stop_reason == "tool_use"
    [block] = message.content
    assert block.type == "tool_use" and block.name == "tag" and block.input == arguments

    response = Response.model_validate(tool_runs["openai"]["r-forced"]["response"]["body"])
    [item] = response.output
    assert item.type == "function_call" and item.name == "tag"
    assert json.loads(item.arguments) == arguments and response.status == "completed"


def test_a_conversation_with_a_call_and_its_result_renders_as_the_chat_twins(tool_runs):
    from anthropic.types.messages import MessageBatchIndividualResponse
    from openai.types.responses import Response

    usage = tool_runs["openai"]["talk"]["response"]["body"]["usage"]
    message = MessageBatchIndividualResponse.model_validate(
        tool_runs["anthropic"]["talk"]).result.message
    response = Response.model_validate(tool_runs["openai"]["r-talk"]["response"]["body"])
    assert message.usage.input_tokens == response.usage.input_tokens \
        == usage["prompt_tokens"]
    assert message.usage.output_tokens == response.usage.output_tokens \
        == usage["completion_tokens"]
