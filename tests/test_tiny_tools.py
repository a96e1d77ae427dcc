"""The tiny tool-calling model (``overnight tiny-model --tools``): its template renders tools,
calls and results through vLLM's chat path, its canned-call token is a call vLLM's ``hermes``
parser reads, and a logit bias on that token makes greedy decoding emit it."""

from __future__ import annotations

import json

import pytest

from conftest import KV_CACHE, cli, one_line_error
from pipelines.tools.tiny_model import CANNED_TOOL_CALL, TOOL_TOKENS

TOOLS = [{"type": "function", "function": {
    "name": "lookup", "description": "Find products.",
    "parameters": {"type": "object", "properties": {"q": {"type": "string"}},
                   "required": ["q"]}}}]
# a two-turn conversation as a Batch line holds it: the call's arguments a JSON string
CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Find a café lamp."},
    {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function",
         "function": {"name": "lookup", "arguments": json.dumps({"q": "café ☕", "n": 2})}}]},
    {"role": "tool", "tool_call_id": "call_1", "content": [{"type": "text", "text": "3 lamps"}]},
]


@pytest.fixture(scope="module")
def tools_model(tmp_path_factory) -> str:
    """Built as a user builds it: ``overnight tiny-model DIR --tools``."""
    out = tmp_path_factory.mktemp("tiny-tools") / "model"
    assert cli("tiny-model", out, "--tools")[0] == 0
    return str(out)


def test_reasoning_and_tools_do_not_combine(tmp_path, capsys):
    code, _, err = cli("tiny-model", tmp_path / "model", "--reasoning", "--tools",
                       capsys=capsys)
    assert code == 2
    one_line_error(err, "--reasoning and --tools do not combine")
    assert not (tmp_path / "model").exists()


@pytest.fixture(scope="module")
def tokenizer(tools_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(tools_model)


def _vllm_tools() -> list[dict]:
    """The tools as vLLM's chat path hands them to the template (its request model, dumped)."""
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return [tool.model_dump() for tool in request.tools]


def test_markers_and_the_canned_call_are_single_plain_added_tokens(tokenizer):
    for text in TOOL_TOKENS + [CANNED_TOOL_CALL]:
        ids = tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) == 1 and ids[0] not in tokenizer.all_special_ids, text
        # kept in the text whatever skip_special_tokens says
        assert tokenizer.decode(ids, skip_special_tokens=True) == text


def test_vllms_chat_path_renders_tools_calls_and_results(tools_model, tokenizer):
    from vllm.config import ModelConfig
    from vllm.renderers.chat_utils import parse_chat_messages
    from vllm.renderers.hf import resolve_chat_template_content_format, safe_apply_chat_template

    from udfs.stages.chat_tools import normalize_tool_messages

    model_config = ModelConfig(model=tools_model)
    tools = _vllm_tools()
    content_format = resolve_chat_template_content_format(None, tools, "auto", tokenizer,
                                                          model_config=model_config)
    assert content_format == "string"
    conversation = parse_chat_messages(json.loads(json.dumps(CONVERSATION)), model_config,
                                       content_format)[0]
    prompt = safe_apply_chat_template(model_config, tokenizer, conversation, tools=tools,
                                      tokenize=False, add_generation_prompt=True)

    # the leading system message and the tools in one system turn, each tool as JSON
    assert prompt.startswith("<s><|system|>\nBe brief.\n\n")
    assert prompt.count("<|system|>") == 1
    tools_block = prompt[prompt.index("<tools>\n") + 8:prompt.index("</tools>")]
    assert [json.loads(line) for line in tools_block.splitlines()] == tools
    # the call's JSON-string arguments rendered as the JSON object, hermes' markers around it
    call = prompt[prompt.index("<tool_call>\n") + 12:prompt.index("\n</tool_call>")]
    assert json.loads(call) == {"name": "lookup", "arguments": {"q": "café ☕", "n": 2}}
    assert "<|tool|>\n<tool_response>\n3 lamps\n</tool_response><|end|>\n" in prompt
    assert prompt.endswith("<|assistant|>\n")
    # the renderer's way (chat_tools, then the template) gives vLLM's prompt
    ours = tokenizer.apply_chat_template(normalize_tool_messages(CONVERSATION, content_format),
                                         tools=tools, tokenize=False, add_generation_prompt=True)
    assert ours == prompt


def test_without_tools_the_template_renders_as_the_plain_models(tokenizer):
    from pipelines.tools.tiny_model import CHAT_TEMPLATE

    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"},
                {"role": "assistant", "content": "Hello"}, {"role": "user", "content": "Bye"}]
    for chat in (messages, messages[1:]):
        assert tokenizer.apply_chat_template(chat, tokenize=False, add_generation_prompt=True) \
            == tokenizer.apply_chat_template(chat, chat_template=CHAT_TEMPLATE, tokenize=False,
                                             add_generation_prompt=True)


def _hermes(tokenizer):
    from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
    from vllm.tool_parsers import ToolParserManager

    parser = ToolParserManager.get_tool_parser("hermes")(tokenizer)
    request = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    return lambda text: parser.extract_tool_calls(text, request)


def test_hermes_reads_the_canned_call(tokenizer):
    read = _hermes(tokenizer)
    canned_id = tokenizer.convert_tokens_to_ids(CANNED_TOOL_CALL)
    extracted = read(tokenizer.decode([canned_id]) + " junk after it")
    assert extracted.tools_called and extracted.content is None
    [call] = extracted.tool_calls
    assert call.function.name == "lookup" and json.loads(call.function.arguments) == {"q": "x"}


def test_a_bias_on_the_canned_token_makes_greedy_decoding_call_the_tool(tools_model, tokenizer):
    import vllm

    llm = vllm.LLM(model=tools_model, dtype="float32", max_model_len=512,
                   kv_cache_memory_bytes=KV_CACHE, enforce_eager=True,
                   enable_chunked_prefill=False)
    canned_id = tokenizer.convert_tokens_to_ids(CANNED_TOOL_CALL)
    conversation = [{"role": "user", "content": "Find a lamp."}]
    biased, plain = (
        llm.chat(conversation, vllm.SamplingParams(temperature=0.0, max_tokens=3, **bias),
                 tools=TOOLS, use_tqdm=False)[0].outputs[0]
        for bias in ({"logit_bias": {canned_id: 100.0}}, {}))

    assert biased.token_ids[0] == canned_id and biased.text.startswith(CANNED_TOOL_CALL)
    assert canned_id not in plain.token_ids and "<tool_call>" not in plain.text
    extracted = _hermes(tokenizer)(biased.text)
    # the bias holds at every step: one call a token
    assert [(c.function.name, json.loads(c.function.arguments)) for c in extracted.tool_calls] \
        == [("lookup", {"q": "x"})] * biased.token_ids.count(canned_id)
