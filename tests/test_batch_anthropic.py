"""Anthropic Message Batches files through the real engine: the same greedy requests as an
OpenAI Batch file and as a Message Batches file give the same text and tokens, request for
request; every result line is Anthropic's shape (the ``anthropic`` client's own models parse
it); a parameter overnight cannot honour is that request's ``errored`` result naming it."""

from __future__ import annotations

import json

import pytest
from anthropic.types.messages import MessageBatchIndividualResponse

from pipelines.batchfile.run import run_batch_file
from pipelines.errors import ConfigError

from conftest import KV_CACHE

SETTINGS = [f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
            "model.max_model_len=512", "resources.batch_size=4"]
PROBE = [{"role": "user", "content": "Describe the sea in a few words."}]


def requests(stop: str) -> list[dict]:
    """(custom_id, system, messages, max_tokens, stop sequences): Anthropic's shapes, which
    ``openai_line`` writes as the same chat request."""
    return [
        {"custom_id": "plain", "max_tokens": 8,
         "messages": [{"role": "user", "content": "Name a colour."}]},
        {"custom_id": "system", "max_tokens": 6, "system": "You answer briefly.",
         "messages": [{"role": "user", "content": "Name a city."}]},
        {"custom_id": "blocks", "max_tokens": 5,
         "system": [{"type": "text", "text": "Be terse. "},
                    {"type": "text", "text": "No lists.", "cache_control": {"type": "ephemeral"}}],
         "messages": [{"role": "user", "content": [{"type": "text", "text": "Two "},
                                                   {"type": "text", "text": "animals?"}]}]},
        {"custom_id": "turns", "max_tokens": 7,
         "messages": [{"role": "user", "content": "Hi."},
                      {"role": "assistant", "content": "Hello."},
                      {"role": "user", "content": "Say more."}]},
        {"custom_id": "stop", "max_tokens": 16, "messages": PROBE,
         "stop_sequences": ["never-generated-##", stop]},
    ]


def anthropic_line(request: dict, **params) -> dict:
    body = {k: v for k, v in request.items() if k != "custom_id"}
    return {"custom_id": request["custom_id"],
            "params": {"model": "claude-sonnet-4-5", "temperature": 0, **body, **params}}


def openai_line(request: dict) -> dict:
    def text(content):
        return content if isinstance(content, str) else "".join(b["text"] for b in content)

    def parts(content):  # a turn's several text blocks: several text parts, as vLLM's server
        if isinstance(content, str) or len(content) == 1:
            return text(content)
        return [{"type": "text", "text": b["text"]} for b in content]

    messages = ([{"role": "system", "content": text(request["system"])}]
                if "system" in request else [])
    messages += [{"role": m["role"], "content": parts(m["content"])}
                 for m in request["messages"]]
    body = {"model": "gpt-4o-mini", "messages": messages, "max_tokens": request["max_tokens"],
            "temperature": 0}
    if "stop_sequences" in request:
        body["stop"] = request["stop_sequences"]
    return {"custom_id": request["custom_id"], "method": "POST",
            "url": "/v1/chat/completions", "body": body}


USER = [{"role": "user", "content": "hi"}]
# line -> (custom_id, a piece of its errored result's message); each a cause of its own
BAD = {
    # client tools run (tests/test_batch_tools.py); a server tool cannot
    "tools": ({"custom_id": "tools", "params": {"model": "m", "max_tokens": 4, "messages": USER,
                                                "tools": [{"type": "web_search_20250305",
                                                           "name": "web_search"}]}},
              "params.tools[0].type: 'web_search_20250305' is a server tool"),
    "document": ({"custom_id": "document", "params": {"model": "m", "max_tokens": 4,
                                                      "messages": [
        {"role": "user", "content": [{"type": "document", "source": {
            "type": "text", "media_type": "text/plain", "data": "a page"}}]}]}},
              "params.messages[0].content[0]: document blocks are not supported yet"),
    "prefill": ({"custom_id": "prefill", "params": {"model": "m", "max_tokens": 4, "messages": [
        *USER, {"role": "assistant", "content": "{"}]}},
                "a last assistant turn (a prefill to continue) is not supported yet"),
    "no-max": ({"custom_id": "no-max", "params": {"model": "m", "messages": USER}},
               "params.max_tokens: Field required"),
    "hot": ({"custom_id": "hot", "params": {"model": "m", "max_tokens": 4, "messages": USER,
                                            "temperature": 1.5}},
            "params.temperature: Input should be less than or equal to 1"),
    "thinking": ({"custom_id": "thinking", "params": {
        "model": "m", "max_tokens": 4, "messages": USER,
        "thinking": {"type": "enabled", "budget_tokens": 1024}}},
                 "params.thinking: not supported by overnight"),
    "role": ({"custom_id": "role", "params": {"model": "m", "max_tokens": 4, "messages": [
        {"role": "system", "content": "x"}, *USER]}},
             "params.messages[0].role: must be 'user' or 'assistant'"),
    "openai": ({"custom_id": "openai", "method": "POST", "url": "/v1/chat/completions",
                "body": {"messages": USER}}, "an OpenAI Batch line (url, body)"),
    "plain": (None, "custom_id 'plain' was used by an earlier line"),  # a duplicate
    "long": ({"custom_id": "long", "params": {"model": "m", "max_tokens": 4, "messages": [
        {"role": "user", "content": "word " * 2000}]}}, "prompt_too_long"),
    # values of the wrong kind (issue #56 A2); a max_tokens past the context once became the
    # job's cap, which the job refused: every request of the file failed
    "role-list": ({"custom_id": "role-list", "params": {
        "model": "m", "max_tokens": 4, "messages": [{"role": ["user"], "content": "hi"}]}},
                  "params.messages[0].role: must be 'user' or 'assistant'"),
    "text-list": ({"custom_id": "text-list", "params": {
        "model": "m", "max_tokens": 4,
        "messages": [{"role": "user", "content": [{"type": "text", "text": ["x"]}]}]}},
                  "params.messages[0].content[0].text: must be a string"),
    "huge-max": ({"custom_id": "huge-max", "params": {"model": "m", "max_tokens": 10 ** 30,
                                                      "messages": USER}},
                 "leaves no room for a prompt in max_model_len 512"),
}


@pytest.fixture(scope="module")
def pair(tiny_model, ray_cluster, llm, tmp_path_factory):
    """One OpenAI Batch file and one Message Batches file of the same requests, run."""
    from vllm import SamplingParams

    # a stop sequence the greedy text surely holds: two ASCII letters past its start
    probe = llm.chat(PROBE, SamplingParams(temperature=0, max_tokens=16))[0].outputs[0].text
    stop = next((probe[i:i + 2] for i in range(2, len(probe) - 1)
                 if (probe[i:i + 2]).isascii() and probe[i:i + 2].isalpha()), None)
    assert stop, f"the probe's text has no two letters to stop on: {probe!r}"
    root = tmp_path_factory.mktemp("anthropic")
    greedy = requests(stop)
    (root / "openai.jsonl").write_text(
        "".join(json.dumps(openai_line(r)) + "\n" for r in greedy))
    metadata = {"metadata": {"user_id": "u-1"}, "service_tier": "auto"}  # accepted, no effect
    lines = [json.dumps(anthropic_line(r, **metadata)) for r in greedy]
    lines.insert(2, "{not json")
    lines += [json.dumps(line if line else anthropic_line(greedy[0]))
              for line, _ in BAD.values()]
    (root / "anthropic.jsonl").write_text("\n".join(lines) + "\n")
    reference = run_batch_file(root / "openai.jsonl", root / "openai-results.jsonl",
                               model=tiny_model, overrides=SETTINGS)
    counts = run_batch_file(root / "anthropic.jsonl", root / "results.jsonl", model=tiny_model,
                            overrides=SETTINGS)
    openai = {r["custom_id"]: r["response"]["body"] for r in map(
        json.loads, (root / "openai-results.jsonl").read_text().splitlines())}
    results = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    return root, greedy, stop, lines, reference, counts, openai, results


def test_anthropic_results_equal_the_openai_results_request_for_request(pair):
    _, greedy, stop, _, reference, _, openai, results = pair
    assert reference["errors"] == 0 and len(openai) == len(greedy)
    by_id = {r["custom_id"]: r["result"] for r in results if r["result"]["type"] == "succeeded"}
    assert sorted(by_id) == sorted(r["custom_id"] for r in greedy)
    for custom_id, body in openai.items():
        message, choice = by_id[custom_id]["message"], body["choices"][0]
        assert message["content"] == [{"type": "text", "text": choice["message"]["content"]}]
        assert message["usage"] == {"input_tokens": body["usage"]["prompt_tokens"],
                                    "output_tokens": body["usage"]["completion_tokens"]}
        expected = {"length": "max_tokens", "stop": "end_turn"}[choice["finish_reason"]]
        if custom_id == "stop":
            expected = "stop_sequence"
        assert (message["stop_reason"], message["stop_sequence"]) == \
            (expected, stop if custom_id == "stop" else None), custom_id
        assert message["model"] == "tiny-model" and message["role"] == "assistant"
    # the stop sequence cut the text where it first appears, and is not part of it
    assert stop not in by_id["stop"]["message"]["content"][0]["text"]


def test_one_result_line_per_request_line_in_order_in_anthropics_shape(pair):
    root, greedy, _, lines, _, counts, _, results = pair
    assert len(results) == len(lines)
    assert [r["custom_id"] for r in results] == [
        json.loads(line).get("custom_id") if line.startswith('{"') else None for line in lines]
    # the anthropic client's own model parses each line; a line whose custom_id could not be
    # read (not JSON) is answered with a null one, which that model (a str) does not take
    for line in results:
        if line["custom_id"] is not None:
            MessageBatchIndividualResponse.model_validate(line)
    assert counts["format"] == "anthropic" and counts["errors_path"] is None
    assert (counts["results"], counts["errors"]) == (len(greedy), len(BAD) + 1)
    assert not (root / "results.errors.jsonl").exists()


def test_what_overnight_cannot_honour_is_that_requests_errored_result(pair):
    _, greedy, _, lines, _, _, _, results = pair
    errored = [r for r in results if r["result"]["type"] == "errored"]
    assert errored[0]["custom_id"] is None and "not valid JSON" in \
        errored[0]["result"]["error"]["error"]["message"]
    for (custom_id, (_, cause)), result in zip(BAD.items(), errored[1:]):
        assert result["custom_id"] == custom_id
        error = result["result"]["error"]
        assert error["type"] == "error" and error["error"]["type"] == "invalid_request_error"
        assert cause in error["error"]["message"], (custom_id, error)
        assert f"(line {lines.index(_line_of(lines, custom_id, result)) + 1}," in \
            error["error"]["message"]


def _line_of(lines: list[str], custom_id: str, result: dict) -> str:
    """The input line a result answers: the last line of its custom_id (a duplicate's)."""
    return [line for line in lines if line.startswith('{"')
            and json.loads(line).get("custom_id") == custom_id][-1]


def test_a_rerun_writes_nothing_and_an_error_file_is_refused(pair, tiny_model):
    root, *_ = pair
    before = (root / "results.jsonl").read_bytes()
    again = run_batch_file(root / "anthropic.jsonl", root / "results.jsonl", model=tiny_model,
                           overrides=SETTINGS)
    assert again["summary"] is None and (root / "results.jsonl").read_bytes() == before
    with pytest.raises(ConfigError, match="has no error file"):
        run_batch_file(root / "anthropic.jsonl", root / "other.jsonl", model=tiny_model,
                       errors=root / "e.jsonl", overrides=SETTINGS)
