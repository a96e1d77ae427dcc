"""OpenAI Batch files through the real engine: a mixed request file (chat and completions,
per-request parameters, a json_schema response_format, malformed lines, a duplicate custom_id,
an over-long prompt) in; every line of both output files checked against the Batch format;
greedy results equal to vLLM's own ``run_batch`` on the same requests."""

from __future__ import annotations

import json
import os
import subprocess
import sys

from pathlib import Path

import jsonschema
import pytest

from pipelines.batchfile.envelopes import _openai_logprobs
from pipelines.batchfile.run import run_batch_file
from udfs.rows.logprobs import token_bytes_of

from conftest import KV_CACHE, cli

MODEL_NAME = "gpt-4o-mini"  # what the file was written for; --model maps it to the tiny one
SCHEMA = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12},
                                           "size": {"type": "integer"}},
          "required": ["name", "size"], "additionalProperties": False}


def chat(custom_id, content, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL_NAME, "messages": [
                {"role": "system", "content": "You answer briefly."},
                {"role": "user", "content": content}], **body}}


def completion(custom_id, prompt, **body):
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/completions",
            "body": {"model": "gpt-3.5-turbo-instruct", "prompt": prompt, **body}}


GREEDY_CHAT = [chat(f"chat-{i}", f"Name a colour, number {i}.", max_tokens=4 + 3 * i,
                    temperature=0) for i in range(6)]
# several text parts: vLLM's chat path joins them with a newline for a string-format template
GREEDY_CHAT[5]["body"]["messages"][1]["content"] = [
    {"type": "text", "text": "Name a colour,"}, {"type": "text", "text": "number 5."}]
LINES = [
    json.dumps(GREEDY_CHAT[0]),
    json.dumps(completion("comp-0", "Once upon a time", max_tokens=10, temperature=0)),
    "{this is not json",
    json.dumps(GREEDY_CHAT[1]),
    json.dumps(chat("chat-0", "the same custom_id again", max_tokens=5)),  # duplicate
    json.dumps(chat("sampled", "Three ideas", max_completion_tokens=6, temperature=0.9,
                    top_p=0.9, n=3, seed=11)),
    json.dumps({"custom_id": "embed", "method": "POST", "url": "/v1/embeddings",
                "body": {"model": "x", "input": "hi"}}),
    json.dumps(GREEDY_CHAT[2]),
    json.dumps(chat("too-long", "word " * 3000, max_tokens=8, temperature=0)),
    json.dumps(chat("schema", "Describe a box as JSON.", max_tokens=60, temperature=0,
                    response_format={"type": "json_schema",
                                     "json_schema": {"name": "box", "schema": SCHEMA}})),
    json.dumps({"method": "POST", "url": "/v1/chat/completions", "body": {}}),  # no custom_id
    json.dumps(chat("bad-body", "hi", max_tokens=-1)),
    json.dumps({"custom_id": "get", "method": "GET", "url": "/v1/chat/completions",
                "body": {}}),
    "[1, 2, 3]",
    json.dumps(GREEDY_CHAT[3]),
    json.dumps(completion("comp-1", "The harbour at dawn", max_tokens=7, temperature=0,
                          stop=["\n\n"])),
    json.dumps(GREEDY_CHAT[4]),
    json.dumps(GREEDY_CHAT[5]),
    # a value of the wrong kind inside a body (issue #56 A2): each once failed the whole file
    json.dumps(chat("schema-text", "hi", max_tokens=4, response_format={
        "type": "json_schema", "json_schema": "{}"})),
    json.dumps(chat("schema-list", "hi", max_tokens=4, response_format={
        "type": "json_schema", "json_schema": {"schema": {"$schema": ["x"]}}})),
    json.dumps({**chat("role-list", "hi"), "body": {"messages": [
        {"role": ["user"], "content": "hi"}], "max_tokens": 4}}),
    json.dumps({"custom_id": "input-role-list", "method": "POST", "url": "/v1/responses",
                "body": {"input": [{"role": ["user"], "content": "hi"}]}}),
    json.dumps(chat("tool-numbers", "hi", max_tokens=4, tools=[1, 2])),
    "[" * 100_000,
    json.dumps(chat("surrogate", "\ud800", max_tokens=4)),
    '{ "custom_id": "digits", "method": "POST", "url": "/v1/completions", "body": '
    '{"prompt": "x", "max_tokens": ' + "9" * 5000 + "}}",
    # parsed, then refused by the engine's grammar as it takes the request: that row's error
    json.dumps(chat("no-grammar", "A box.", max_tokens=8, temperature=0, response_format={
        "type": "json_schema", "json_schema": {"name": "x", "schema": {"$ref": "#/nope"}}})),
    json.dumps(chat("after-bad", "Name a colour.", max_tokens=5, temperature=0)),
]
REJECTED = {3: "invalid_json", 5: "duplicate_custom_id", 7: "invalid_url", 11: "invalid_request",
            12: "invalid_body", 13: "invalid_request", 14: "invalid_request",
            19: "invalid_body", 20: "invalid_body", 21: "invalid_body", 22: "invalid_body",
            23: "invalid_body", 24: "invalid_json", 25: "invalid_body", 26: "invalid_json"}
RUN_FAILED = {9: "prompt_too_long", 27: "engine_error"}
# the bad values inside bodies, each named in its line's error
INSIDE = {19: "body.response_format.json_schema: must be an object",
          20: "body.response_format.json_schema.schema.$schema: must be a string",
          21: "body.messages[0].role: must be a string", 22: "body.input[0].role: one of",
          23: "body.tools[0]: only tools of type", 24: "nested too deeply",
          25: "a lone surrogate", 26: "Exceeds the limit (4300 digits)",
          27: "Pointer '/nope' does not exist"}
SETTINGS = [f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
            "model.max_model_len=512", "resources.batch_size=4"]


@pytest.fixture(scope="session")
def batch(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("batch")
    (root / "requests.jsonl").write_text("\n".join(LINES) + "\n")
    counts = run_batch_file(root / "requests.jsonl", root / "results.jsonl", model=tiny_model,
                            overrides=SETTINGS)
    results = [json.loads(line) for line in (root / "results.jsonl").read_text().splitlines()]
    errors = [json.loads(line) for line in
              (root / "results.errors.jsonl").read_text().splitlines()]
    return root, counts, results, errors


def test_every_readable_custom_id_is_in_exactly_one_file(batch):
    _, counts, results, errors = batch
    readable = [json.loads(line).get("custom_id") for line in LINES
                if line.startswith("{") and line[1] == '"']
    out = [r["custom_id"] for r in results] + [e["custom_id"] for e in errors]
    assert sorted(c for c in out if c is not None) == sorted(c for c in readable if c)
    assert len(results) + len(errors) == len(LINES)
    assert counts["results"] == len(results) == len(LINES) - len(REJECTED) - len(RUN_FAILED)


def test_results_in_input_order_and_in_the_batch_output_format(batch, tiny_model):
    _, _, results, _ = batch
    requests = {json.loads(line)["custom_id"]: json.loads(line) for line in reversed(LINES)
                if line.startswith('{"custom_id"')}
    expected = [json.loads(LINES[i])["custom_id"] for i in range(len(LINES))
                if i + 1 not in REJECTED and i + 1 not in RUN_FAILED]
    assert [r["custom_id"] for r in results] == expected
    for line in results:
        assert set(line) == {"id", "custom_id", "response", "error"} and line["error"] is None
        response = line["response"]
        assert response["status_code"] == 200 and response["request_id"].startswith("req_")
        body, request = response["body"], requests[line["custom_id"]]
        chat_request = request["url"] == "/v1/chat/completions"
        assert body["object"] == ("chat.completion" if chat_request else "text_completion")
        # the served name (the model directory's), never the server's filesystem path
        assert body["model"] == Path(tiny_model).name and isinstance(body["created"], int)
        n = request["body"].get("n", 1)
        assert [c["index"] for c in body["choices"]] == list(range(n))
        for choice in body["choices"]:
            assert choice["finish_reason"] in ("stop", "length")
            text = choice["message"]["content"] if chat_request else choice["text"]
            assert isinstance(text, str)
            if chat_request:
                assert choice["message"]["role"] == "assistant"
        usage = body["usage"]
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]
        cap = request["body"].get("max_tokens") or request["body"]["max_completion_tokens"]
        assert 0 < usage["completion_tokens"] <= cap * n


def test_per_request_parameters_are_honoured(batch):
    _, _, results, _ = batch
    by_id = {r["custom_id"]: r["response"]["body"] for r in results}
    sampled = by_id["sampled"]["choices"]
    assert len(sampled) == 3 and len({c["message"]["content"] for c in sampled}) > 1
    for i, request in enumerate(GREEDY_CHAT):
        assert by_id[request["custom_id"]]["usage"]["completion_tokens"] == 4 + 3 * i
    box = json.loads(by_id["schema"]["choices"][0]["message"]["content"])
    jsonschema.validate(box, SCHEMA)


def test_error_lines_name_the_line_the_id_and_the_problem(batch):
    _, counts, _, errors = batch
    expected = {**REJECTED, **RUN_FAILED}
    assert [e["error"]["line"] for e in errors] == sorted(expected)
    for e in errors:
        assert set(e) == {"id", "custom_id", "response", "error"} and e["response"] is None
        assert e["error"]["code"] == expected[e["error"]["line"]] and e["error"]["message"]
    by_line = {e["error"]["line"]: e for e in errors}
    assert by_line[3]["custom_id"] is None and by_line[11]["custom_id"] is None
    assert by_line[5]["custom_id"] == "chat-0"
    assert by_line[9]["custom_id"] == "too-long" and "tokens" in by_line[9]["error"]["message"]
    assert "body.max_tokens" in by_line[12]["error"]["message"]
    assert counts["rejected_lines"] == len(REJECTED)


def test_a_bad_value_inside_a_body_is_that_lines_error_and_the_rest_complete(batch):
    """Each kind of bad line (issue #56 A2) is its own error line naming the field; the good
    lines around them, the one after them all too, complete."""
    _, _, results, errors = batch
    by_line = {e["error"]["line"]: e["error"] for e in errors}
    for line, needle in INSIDE.items():
        assert needle in by_line[line]["message"], (line, by_line[line])
        assert "\n" not in by_line[line]["message"]
    assert by_line[25]["code"] == "invalid_body"
    assert [r["custom_id"] for r in results][-1] == "after-bad"


def test_greedy_results_equal_vllms_own_run_batch(batch, tiny_model, llm):
    """vLLM 0.32's run_batch takes chat requests only (and stops at a bad line), so it gets the
    file's greedy chat requests; the completions are checked against LLM.generate."""
    import vllm

    root, _, results, _ = batch
    (root / "vllm_in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GREEDY_CHAT))
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch",
         "-i", str(root / "vllm_in.jsonl"), "-o", str(root / "vllm_out.jsonl"),
         "--model", tiny_model, "--served-model-name", MODEL_NAME, "--dtype", "float32",
         "--max-model-len", "512", "--kv-cache-memory-bytes", str(KV_CACHE),
         "--enforce-eager", "--no-enable-chunked-prefill"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    theirs = {}
    for line in (root / "vllm_out.jsonl").read_text().splitlines():
        line = json.loads(line)
        theirs[line["custom_id"]] = line["response"]["body"]
    ours = {r["custom_id"]: r["response"]["body"] for r in results}
    for request in GREEDY_CHAT:
        cid = request["custom_id"]
        assert ours[cid]["choices"][0]["message"]["content"] == \
            theirs[cid]["choices"][0]["message"]["content"]
        assert ours[cid]["usage"] == {k: theirs[cid]["usage"][k] for k in
                                      ("prompt_tokens", "completion_tokens", "total_tokens")}

    for cid, prompt, max_tokens in (("comp-0", "Once upon a time", 10),
                                    ("comp-1", "The harbour at dawn", 7)):
        reference = llm.generate([prompt], vllm.SamplingParams(
            temperature=0.0, max_tokens=max_tokens, stop=["\n\n"] if cid == "comp-1" else None),
            use_tqdm=False)[0].outputs[0].text
        assert ours[cid]["choices"][0]["text"] == reference


def test_the_cli_runs_a_file_and_refuses_to_overwrite(batch, tiny_model, capsys):
    root, _, _, _ = batch
    code, _, err = cli("batch", root / "requests.jsonl", "-o", root / "results.jsonl",
                       "--model", tiny_model, capsys=capsys)
    assert code == 2  # (refused before any engine, in this process)
    assert err.strip() == (f"overnight: error: {root / 'results.jsonl'} already exists; "
                           "pass --overwrite to replace it")


PYDANTIC_SCHEMA = {  # what pydantic's model_json_schema() writes: $defs, $ref, anyOf
    "$defs": {"Size": {"type": "object", "properties": {"cm": {"type": "integer"}},
                       "required": ["cm"]}},
    "type": "object",
    "properties": {"name": {"type": "string", "maxLength": 8},
                   "note": {"anyOf": [{"type": "string"}, {"type": "null"}]},
                   "size": {"$ref": "#/$defs/Size"}, "extra": {"type": "object"}},
    "required": ["name", "note", "size", "extra"]}


def test_a_file_is_run_again_for_another_model_and_never_answered_from_old_parts(
        tiny_model, ray_cluster, tmp_path):
    """Results depend on the file, the model and the settings: another --model runs again;
    a new file with no runnable line gives no result from the previous file's parts. A
    pydantic-shaped response_format schema runs."""
    other = tmp_path / "other-model"
    other.symlink_to(tiny_model)  # the same weights under another name
    requests, results = tmp_path / "req.jsonl", tmp_path / "out.jsonl"
    requests.write_text("\n".join(json.dumps(line) for line in [
        chat("a", "Name a colour.", max_tokens=4, temperature=0),
        chat("typed", "Describe a box.", max_tokens=60, temperature=0,
             response_format={"type": "json_schema",
                              "json_schema": {"name": "box", "schema": PYDANTIC_SCHEMA}})]))
    first = run_batch_file(requests, results, model=tiny_model, overrides=SETTINGS)
    assert first["results"] == 2 and first["errors"] == 0
    again = run_batch_file(requests, results, model=str(other), overrides=SETTINGS,
                           overwrite=True)
    assert again["summary"] is not None  # generated again, not read from the old parts
    lines = [json.loads(line) for line in results.read_text().splitlines()]
    assert {line["response"]["body"]["model"] for line in lines} == {"other-model"}
    typed = next(line for line in lines if line["custom_id"] == "typed")["response"]["body"]
    choice = typed["choices"][0]  # ran (it was refused as invalid_body)
    if choice["finish_reason"] == "stop":  # the random model may run out of tokens first
        jsonschema.validate(json.loads(choice["message"]["content"]), PYDANTIC_SCHEMA)

    requests.write_text('{"custom_id": "x", "method": "POST", "url": "/v1/nope", "body": {}}\n')
    counts = run_batch_file(requests, results, model=tiny_model, overrides=SETTINGS,
                            overwrite=True)
    assert (counts["results"], counts["errors"]) == (0, 1)
    assert results.read_text() == ""


# Logprobs and vLLM's extra sampling parameters (issue #20): honoured, or the request's error
MESSAGES = chat("x", "Name a colour.")["body"]["messages"]
PENALTIES = {"repetition_penalty": 2.0, "presence_penalty": 1.5, "frequency_penalty": 1.5,
             "top_k": 5, "min_tokens": 2}
UNSUPPORTED = {
    # logit_bias is honoured (tests/test_reasoning.py); a bias out of OpenAI's range is not
    "logit-bias": (chat("logit-bias", "hi", max_tokens=4, logit_bias={"50": 101}),
                   "body.logit_bias: Value error, token 50: the bias must be a number from "
                   "-100 to 100"),
    "chat-int-logprobs": (chat("chat-int-logprobs", "hi", max_tokens=4, logprobs=2),
                          "body.logprobs must be true or false"),
    "comp-top-logprobs": (completion("comp-top-logprobs", "hi", max_tokens=4,
                                     top_logprobs=2), "body.top_logprobs is for"),
    "top-without-logprobs": (chat("top-without-logprobs", "hi", max_tokens=4,
                                  top_logprobs=2), "needs body.logprobs: true"),
    "tools": (chat("tools", "hi", max_tokens=4, tools=[{"type": "function"}]),
              "body.tools[0].function: must be an object"),
    # a message field no template would see is refused, as an unknown body field is
    "named": ({**chat("named", "hi", max_tokens=4), "body": {"messages": [
        {"role": "user", "content": "hi", "name": "ann"}], "max_tokens": 4}},
              "body.messages[0].name: not supported"),
}
BOX = {"type": "json_schema", "json_schema": {"name": "k", "schema": {
    "type": "object", "properties": {"k": {"enum": ["x"]}}, "required": ["k"],
    "additionalProperties": False}}}


def responses_twin(request: dict, **extra) -> dict:
    """A chat request of GREEDY_CHAT as a /v1/responses line: its system message as
    instructions, its user message as input_text parts."""
    system, user = request["body"]["messages"]
    return {"custom_id": "resp-" + request["custom_id"], "method": "POST",
            "url": "/v1/responses",
            "body": {"model": MODEL_NAME, "instructions": system["content"],
                     "input": [{"role": "user", "content": [
                         {"type": "input_text", "text": user["content"]}]}],
                     "max_output_tokens": request["body"]["max_tokens"], "temperature": 0,
                     **extra}}


# /v1/responses lines beside their chat twins, in scored_batch's file
# (test_responses_lines_equal_the_same_requests_as_chat_completions)
RESPONSES_CHATS = [*GREEDY_CHAT[:3], chat("schema", "Describe a box as JSON.", max_tokens=60,
                                          temperature=0, response_format={
                                              "type": "json_schema",
                                              "json_schema": {"name": "box", "schema": SCHEMA}})]
RESPONSES_TWINS = [responses_twin(r) for r in RESPONSES_CHATS[:3]] + [responses_twin(
    RESPONSES_CHATS[3], text={"format": {"type": "json_schema", "name": "box", "schema": SCHEMA,
                                         "strict": True}})]
WEB_SEARCH = {**responses_twin(RESPONSES_CHATS[0]), "custom_id": "web-search"}
WEB_SEARCH["body"]["tools"] = [{"type": "web_search"}]


@pytest.fixture(scope="session")
def scored_batch(tiny_model, ray_cluster, tmp_path_factory, llm):
    """One file: logprobs on both endpoints, the extra parameters, bodies overnight cannot
    honour, and /v1/responses lines beside their chat twins. stop_token_ids names the third
    token greedy decoding gives the prompt."""
    import vllm

    greedy = llm.chat(MESSAGES, vllm.SamplingParams(temperature=0.0, max_tokens=8),
                      use_tqdm=False)[0].outputs[0]
    stop_id = greedy.token_ids[2]
    lines = [chat("lp-chat", "Name a colour.", max_tokens=6, temperature=0, logprobs=True,
                  top_logprobs=2, user="someone", metadata={"k": "v"}),
             completion("lp-comp", "Once upon a time", max_tokens=6, temperature=0, logprobs=2),
             chat("penalised", "Name a colour.", max_tokens=8, temperature=0, **PENALTIES),
             chat("stopped", "Name a colour.", max_tokens=8, temperature=0,
                  stop_token_ids=[stop_id]),
             chat("json-eos", "A box.", max_tokens=24, temperature=0, response_format=BOX),
             chat("json-ignore-eos", "A box.", max_tokens=24, temperature=0,
                  response_format=BOX, ignore_eos=True),
             chat("room", "Name a colour.", temperature=0),  # no max_tokens
             *(line for line, _ in UNSUPPORTED.values()),
             *RESPONSES_CHATS, *RESPONSES_TWINS, WEB_SEARCH]
    root = tmp_path_factory.mktemp("scored")
    (root / "requests.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    counts = run_batch_file(root / "requests.jsonl", root / "results.jsonl", model=tiny_model,
                            overrides=SETTINGS)
    results = {r["custom_id"]: r["response"]["body"] for r in
               map(json.loads, (root / "results.jsonl").read_text().splitlines())}
    errors = {e["custom_id"]: e["error"] for e in
              map(json.loads, (root / "results.errors.jsonl").read_text().splitlines())}
    return results, errors, greedy, stop_id, counts, lines


def test_logprobs_in_the_openai_shapes_equal_vllms(scored_batch, llm):
    import vllm
    from openai.types.chat import ChatCompletion
    from openai.types.completion import Completion

    results, *_ = scored_batch
    chat_body = ChatCompletion.model_validate(results["lp-chat"])  # the official shapes
    comp_body = Completion.model_validate(results["lp-comp"])
    theirs = llm.chat(MESSAGES, vllm.SamplingParams(temperature=0.0, max_tokens=6, logprobs=2),
                      use_tqdm=False)[0].outputs[0]
    content = chat_body.choices[0].logprobs.content
    text = chat_body.choices[0].message.content
    assert b"".join(bytes(t.bytes) for t in content).decode() == text  # bytes rebuild it
    assert len(content) == len(theirs.token_ids)
    for ours, token_id, position in zip(content, theirs.token_ids, theirs.logprobs):
        assert ours.token == position[token_id].decoded_token
        assert ours.logprob == pytest.approx(position[token_id].logprob, abs=1e-5)
        best = sorted(position.values(), key=lambda lp: lp.rank)[:2]
        assert [t.token for t in ours.top_logprobs] == [lp.decoded_token for lp in best]
        assert [t.logprob for t in ours.top_logprobs] == pytest.approx(
            [lp.logprob for lp in best], abs=1e-5)
    theirs = llm.generate(["Once upon a time"], vllm.SamplingParams(
        temperature=0.0, max_tokens=6, logprobs=2), use_tqdm=False)[0].outputs[0]
    lp = comp_body.choices[0].logprobs
    assert lp.tokens == [p[t].decoded_token for t, p in zip(theirs.token_ids, theirs.logprobs)]
    assert lp.token_logprobs == pytest.approx(
        [p[t].logprob for t, p in zip(theirs.token_ids, theirs.logprobs)], abs=1e-5)
    assert all(len(top) == 2 for top in lp.top_logprobs)
    # each token's offset is where it is in the text, a token that decodes alone to nothing
    # or to U+FFFD (part of a character) included: the tokens' lengths would put "ull" of
    # "@\ufffdull" at 1, not 2 (vLLM's own server does)
    text = comp_body.choices[0].text
    assert lp.text_offset == sorted(lp.text_offset) and lp.text_offset[-1] <= len(text)
    for token, offset in zip(lp.tokens, lp.text_offset):
        if token and "\ufffd" not in token:
            assert text[offset:].startswith(token), (text, lp.tokens, lp.text_offset)
    assert results["penalised"]["choices"][0]["logprobs"] is None  # not asked for


def test_vllms_extra_sampling_parameters_are_honoured(scored_batch, llm):
    import vllm

    results, _, greedy, stop_id, *_ = scored_batch
    penalised = llm.chat(MESSAGES, vllm.SamplingParams(temperature=0.0, max_tokens=8,
                                                       **PENALTIES), use_tqdm=False)
    text = results["penalised"]["choices"][0]["message"]["content"]
    assert text == penalised[0].outputs[0].text != greedy.text  # they changed the output
    stopped = results["stopped"]
    assert stopped["usage"]["completion_tokens"] == 3  # the stop token is the third
    assert stopped["choices"][0]["finish_reason"] == "stop"
    # the grammar ends the JSON with EOS; ignore_eos runs on to max_tokens
    ended, ignored = results["json-eos"], results["json-ignore-eos"]
    assert ended["choices"][0]["finish_reason"] == "stop"
    assert ended["usage"]["completion_tokens"] < 24
    assert ignored["usage"]["completion_tokens"] == 24
    assert ignored["choices"][0]["finish_reason"] == "length"


def test_a_parameter_overnight_cannot_honour_is_that_requests_error(scored_batch):
    results, errors, *_ = scored_batch
    assert set(errors) == {*UNSUPPORTED, WEB_SEARCH["custom_id"]}  # (the Responses test's)
    for custom_id, (_, message) in UNSUPPORTED.items():
        assert errors[custom_id]["code"] == "invalid_body"
        assert message in errors[custom_id]["message"], errors[custom_id]
    assert "lp-chat" in results  # user and metadata change nothing: accepted


# A kill between the two renames of a write (issue #46 item 2): this sitecustomize, on the
# PYTHONPATH of an `overnight batch`, SIGKILLs the process right after a file is renamed to
# the path OVERNIGHT_TEST_KILL_AFTER names, the moment a kill -9 of the server can strike
KILL_AFTER_RENAME = """
import os, signal
_target = os.environ.get("OVERNIGHT_TEST_KILL_AFTER")
if _target:
    _replace = os.replace
    def _replace_then_die(src, dst, *args, **kwargs):
        _replace(src, dst, *args, **kwargs)
        if os.path.abspath(dst) == _target:
            os.kill(os.getpid(), signal.SIGKILL)
    os.replace = _replace_then_die
"""


def test_a_write_killed_between_the_two_files_is_completed_by_the_rerun(tiny_model, tmp_path,
                                                                       capsys):
    """The result and error files are one commit: killed after the first is in place, the
    same command run again completes the pair (it once refused: "already exists"); run
    once more it changes nothing; for another request file it still refuses. No engine: a
    file whose lines all fail to parse."""
    from conftest import REPO

    (tmp_path / "faults").mkdir()
    (tmp_path / "faults" / "sitecustomize.py").write_text(KILL_AFTER_RENAME)
    requests, results = tmp_path / "requests.jsonl", tmp_path / "results.jsonl"
    errors = tmp_path / "results.errors.jsonl"
    requests.write_text('{not json\n{"custom_id": "x", "method": "POST", "url": "/v1/nope", '
                        '"body": {}}\n')

    args = ["batch", requests, "-o", results, "--model", tiny_model,
            *[a for s in SETTINGS for a in ("--set", s)]]
    killed = subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)],
                            capture_output=True, text=True, cwd=REPO, timeout=300,
                            env={**os.environ, "PYTHONPATH": str(tmp_path / "faults"),
                                 "OVERNIGHT_TEST_KILL_AFTER": str(results)})
    assert killed.returncode == -9, killed.stderr
    assert results.exists()  # the first of the two in place
    code, out, err = cli(*args, capsys=capsys)  # the same command again, in this process
    assert code == 0, err
    assert "2 errors" in out and results.read_text() == ""
    lines = [json.loads(line) for line in errors.read_text().splitlines()]
    assert [(e["error"]["line"], e["error"]["code"]) for e in lines] == [
        (1, "invalid_json"), (2, "invalid_url")]
    written = errors.read_bytes()
    code, out, err = cli(*args, capsys=capsys)
    assert code == 0 and "2 errors" in out, err
    assert errors.read_bytes() == written and not list(tmp_path.glob(".*.staged"))
    requests.write_text("{not json either\n")  # another file: the files in place are not its
    code, _, err = cli(*args, capsys=capsys)
    assert code == 2
    assert err.strip() == (f"overnight: error: {results} already exists; "
                           "pass --overwrite to replace it")


def test_a_request_without_max_tokens_may_use_the_room_its_prompt_leaves(scored_batch):
    """As the hosted API and vLLM's run_batch default it: max_model_len - prompt tokens (it
    was min(1024, max_model_len // 2)); the random model never ends on its own."""
    room = scored_batch[0]["room"]
    assert room["usage"]["prompt_tokens"] + room["usage"]["completion_tokens"] == 512
    assert room["choices"][0]["finish_reason"] == "length"


def test_logprobs_byte_fields_follow_the_tokens_bytes(tiny_model):
    """A token that holds part of a UTF-8 character decodes alone to U+FFFD: its ``bytes``
    are its own bytes, so the tokens' bytes rebuild the text, and its ``text_offset`` is
    where its first byte falls (vLLM 0.32's server derives both from the decoded text)."""
    from tokenizers import Tokenizer

    tokenizer = Tokenizer.from_file(str(Path(tiny_model) / "tokenizer.json"))
    text = "Nöull café 日本"
    ids = tokenizer.encode(text).ids
    entries = [{"token": tokenizer.decode([i]), "token_id": i, "logprob": -0.5, "top": []}
               for i in ids]
    assert "\ufffd" in "".join(e["token"] for e in entries)  # some tokens split a character
    token_bytes = token_bytes_of(tiny_model)
    chat_lp = _openai_logprobs(entries, True, token_bytes)
    assert b"".join(bytes(t["bytes"]) for t in chat_lp["content"]).decode() == text
    completion = _openai_logprobs(entries, False, token_bytes)
    offsets = completion["text_offset"]
    assert len(offsets) == len(ids) and offsets == sorted(offsets)
    for entry, offset in zip(entries, offsets):  # a whole-character token is where it says
        if "\ufffd" not in entry["token"]:
            assert text[offset:].startswith(entry["token"])
    tokens = [e["token"] for e in entries]
    assert offsets[tokens.index("ull")] == text.index("ull") == 2  # after "N" and "ö"


def test_responses_lines_equal_the_same_requests_as_chat_completions(scored_batch,
                                                                     tiny_model):
    """/v1/responses lines beside their chat twins in one file (scored_batch's): the same
    greedy text, in the Responses API's shape (the openai client's Response model parses each
    body), an incomplete status where max_output_tokens ran out, a json_schema text.format
    honoured, and a field overnight cannot honour (a web_search tool) the request's error
    naming it."""
    from openai.types.responses import Response

    results, errors, _, _, counts, lines = scored_batch
    # every line runs but the UNSUPPORTED ones and the web_search one
    assert (counts["results"], counts["errors"]) == (len(lines) - len(UNSUPPORTED) - 1,
                                                     len(UNSUPPORTED) + 1)
    for request in RESPONSES_CHATS:
        chat_body = results[request["custom_id"]]
        body = results["resp-" + request["custom_id"]]
        Response.model_validate(body)
        assert body["object"] == "response" and body["model"] == Path(tiny_model).name
        [message] = body["output"]
        assert message["type"] == "message" and message["role"] == "assistant"
        [part] = message["content"]
        assert part["type"] == "output_text"
        assert part["text"] == chat_body["choices"][0]["message"]["content"]
        assert body["usage"]["input_tokens"] == chat_body["usage"]["prompt_tokens"]
        assert body["usage"]["output_tokens"] == chat_body["usage"]["completion_tokens"]
        cut = chat_body["choices"][0]["finish_reason"] == "length"
        assert body["status"] == ("incomplete" if cut else "completed")
        assert body["incomplete_details"] == ({"reason": "max_output_tokens"} if cut else None)
    jsonschema.validate(json.loads(results["resp-schema"]["output"][0]["content"][0]["text"]),
                        SCHEMA)
    error = errors[WEB_SEARCH["custom_id"]]
    assert error["code"] == "invalid_body" and "body.tools" in error["message"]
    assert error["line"] == len(lines)  # the file's last
