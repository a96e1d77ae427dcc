"""udfs/stages/chat_tools.py against vLLM's own chat path: a conversation's tool turns, normalized
without vLLM, equal what ``vllm.renderers.chat_utils.parse_chat_messages`` hands a template."""

from __future__ import annotations

import copy
import json

import pytest

from udfs.stages.chat_tools import normalize_tool_messages

FORMATS = ("string", "openai")


def _text(text: str, content_format: str):
    """A content as the renderer hands it over in ``content_format`` (prompts.for_template)."""
    return text if content_format == "string" else [{"type": "text", "text": text}]


def _call(call_id: str, name: str, arguments) -> dict:
    return {"id": call_id, "type": "function", "function": {"name": name, "arguments": arguments}}


def _conversations(content_format: str) -> dict[str, list[dict]]:
    t = lambda s: _text(s, content_format)  # noqa: E731 - short, read many times below
    return {
        "arguments of every kind": [
            {"role": "system", "content": t("Use the tools.")},
            {"role": "user", "content": t("Look up lamps.")},
            {"role": "assistant", "content": None, "tool_calls": [
                _call("c1", "lookup", json.dumps({"q": "lamp", "n": 2})),
                _call("c2", "lookup", {"q": "chair"}),
                _call("c3", "lookup", '{"q": "cut'),
                _call("c4", "lookup", "[1, 2]"),
                _call("c5", "lookup", None),
                _call("c6", "lookup", ""),
                _call("c7", "lookup", "42"),
            ]},
            {"role": "tool", "tool_call_id": "c1", "content": "3 lamps"},
            {"role": "tool", "tool_call_id": "c2", "name": "lookup",
             "content": [{"type": "text", "text": "2 chairs"}, {"type": "text", "text": "red"}]},
            {"role": "tool", "tool_call_id": "c3", "content": None},
            {"role": "tool", "tool_call_id": "c4", "content": []},
            {"role": "assistant", "content": t("Found them.")},
        ],
        "an empty call list, reasoning, a name": [
            {"role": "user", "content": t("Hi"), "name": "ann"},
            {"role": "assistant", "content": t("Hello"), "tool_calls": [],
             "reasoning": "greet back"},
            {"role": "user", "content": t("Again")},
            {"role": "assistant", "content": None, "tool_calls": None},
            {"role": "user", "content": None},
        ],
        "a tool message without an id, a call without a type": [
            {"role": "user", "content": t("Go")},
            {"role": "assistant", "content": t("Calling."),
             "tool_calls": [{"id": "c9", "function": {"name": "f", "arguments": '{"a": [1]}'}}]},
            {"role": "tool", "content": [{"type": "text", "text": "ok"}]},
        ],
    }


@pytest.fixture(scope="module")
def vllm_parse(tiny_model):
    """vLLM's chat path on the tiny model's config (text only: no weights load)."""
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages

    model_config = ModelConfig(model=tiny_model)

    def parse(messages, content_format):
        # vLLM writes the parsed arguments into the caller's dicts: give it its own copy
        return parse_chat_messages(copy.deepcopy(messages), model_config, content_format)[0]

    return parse


@pytest.mark.parametrize("content_format", FORMATS)
def test_tool_turns_equal_vllms_chat_path(vllm_parse, content_format):
    for name, messages in _conversations(content_format).items():
        ours = normalize_tool_messages(messages, content_format)
        assert ours == vllm_parse(messages, content_format), name


def test_arguments_become_dicts_and_the_input_is_left_as_it_was():
    messages = _conversations("string")["arguments of every kind"]
    before = copy.deepcopy(messages)
    ours = normalize_tool_messages(messages, "string")
    assert messages == before
    assert [c["function"]["arguments"] for c in ours[2]["tool_calls"]] == [
        {"q": "lamp", "n": 2}, {"q": "chair"}, {}, {}, {}, {}, {}]
    assert ours[4]["content"] == "2 chairs\nred" and ours[5]["content"] == ""
    ours[2]["tool_calls"][1]["function"]["arguments"]["q"] = "changed"
    assert messages[2]["tool_calls"][1]["function"]["arguments"] == {"q": "chair"}


@pytest.mark.parametrize("call", ["not a call", {"type": "code", "function": {"name": "f"}},
                                  {"type": "function", "function": "f"}])
def test_a_call_that_is_not_a_function_is_refused_as_vllm_refuses_it(vllm_parse, call):
    from vllm.exceptions import VLLMValidationError

    messages = [{"role": "user", "content": "x"},
                {"role": "assistant", "content": None, "tool_calls": [call]}]
    with pytest.raises(VLLMValidationError) as theirs:
        vllm_parse(messages, "string")
    with pytest.raises(ValueError) as ours:
        normalize_tool_messages(messages, "string")
    assert str(ours.value) in str(theirs.value)
