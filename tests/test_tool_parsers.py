"""model.tool_parser's pre-flight check: vLLM's tool parser names read from its source, without
importing it, and a wrong name refused in one line with the close match."""

from __future__ import annotations

import pytest

from pipelines.errors import ConfigError
from pipelines.plan.vllm_args import check_tool_parser, vllm_tool_parsers


def test_the_names_read_from_source_are_vllms_registered_tool_parsers():
    from vllm.tool_parsers import ToolParserManager

    assert vllm_tool_parsers() == frozenset(ToolParserManager.list_registered())


def test_a_known_tool_parser_passes():
    for name in ("hermes", "llama3_json", "qwen3_xml"):
        assert name in vllm_tool_parsers()
        check_tool_parser(name)


def test_a_misspelt_tool_parser_is_one_line_with_the_close_match_and_the_list():
    with pytest.raises(ConfigError) as err:
        check_tool_parser("hermse")
    message = str(err.value)
    assert "\n" not in message
    assert message.startswith("model.tool_parser 'hermse' is not one of vLLM's tool parsers")
    assert "did you mean 'hermes'?" in message
    assert "vLLM has: " in message and "llama3_json" in message and "pythonic" in message


def test_a_name_far_from_any_gets_the_list_without_a_guess():
    with pytest.raises(ConfigError) as err:
        check_tool_parser("zzzzzzzz")
    assert "did you mean" not in str(err.value)
    assert "hermes" in str(err.value)
