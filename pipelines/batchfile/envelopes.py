"""The result and error lines of an OpenAI Batch file, in the hosted Batch API's shapes:
a request's ``{"id", "custom_id", "response", "error"}`` line (``BatchOutput``, typed as
vLLM's run_batch types it), built from its rows."""

from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path
from typing import Any, TypedDict

from pipelines.batchfile import embeddings
from pipelines.batchfile import responses
from pipelines.batchfile.lines import CUSTOM_ID, KIND, LINE, TOOLS
from udfs import columns
from udfs.rows.logprobs import text_offsets
from udfs.rows.tool_calls import calls_expected, read_spec


# Typed dicts, not pydantic models: a line is a plain dict as it is built (keys in the order
# given), with no validation or copy of its body per line (a file may hold millions).
class BatchError(TypedDict):
    """An error line's ``error``: why the request has no result, and its input line."""

    code: str | None
    message: str
    line: int


class BatchResponse(TypedDict):
    """A result line's ``response``: the endpoint's answer (``body``) as the hosted API wraps it."""

    status_code: int
    request_id: str
    body: dict[str, Any]


class BatchOutput(TypedDict):
    """One line of a result file (``response``) or of an error file (``error``), as vLLM's
    run_batch's BatchRequestOutput; ``custom_id`` None where the line had none to read."""

    id: str
    custom_id: str | None
    response: BatchResponse | None
    error: BatchError | None


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


def error_line(line: int, custom_id, code: str, message: str) -> BatchOutput:
    """The error line of the request on input line ``line``."""
    return BatchOutput(id=_id("batch_req", custom_id, line), custom_id=custom_id, response=None,
                       error=BatchError(code=code, message=message, line=line))


def _answer(custom_id: str, line: int, body: dict) -> BatchOutput:
    """The result line of the request on input line ``line``: its endpoint's ``body``."""
    return BatchOutput(id=_id("batch_req", custom_id, line), custom_id=custom_id,
                       response=BatchResponse(status_code=200,
                                              request_id=_id("req", custom_id, line), body=body),
                       error=None)


def served_name(model: str) -> str:
    """The model name a result says it came from, when none is given: the model
    directory's own name (a result never shows the server's filesystem), as
    ``vllm serve --served-model-name`` defaults to the model's name."""
    return Path(model.rstrip("/")).name or model


def result_line(samples: list[dict], model: str, created: int, token_bytes) -> BatchOutput:
    first = samples[0]
    custom_id, line = first[CUSTOM_ID], first[LINE]
    # (a thinking model's request without an answer is answered, content null, as vLLM's
    # server answers it: its finish_reason says why)
    failed = next((s for s in samples if s[columns.ERROR] is not None
                   and s[columns.ERROR_KIND] != columns.ErrorKind.NO_ANSWER), None)
    if failed is not None:
        return error_line(line, custom_id, failed[columns.ERROR_KIND], failed[columns.ERROR])
    if first[KIND] == embeddings.KIND:
        body = {"id": _id("embd", custom_id, line), "created": created,
                **embeddings.result_body(samples, model, sum(s[columns.PROMPT_TOKENS] or 0
                                                             for s in samples))}
        return _answer(custom_id, line, body)
    if first[KIND] == responses.KIND:  # n is always 1
        return _answer(custom_id, line, responses.result_body(first, model, created,
                                                              chat_message(first)))
    chat = first[KIND] == "chat"
    # a thinking model (model.reasoning_parser): the thinking beside the answer, as vLLM's
    # server names it (message.reasoning), and its tokens in the usage
    thinking = columns.REASONING_TOKENS in first
    choices = [
        {"index": i, "finish_reason": s[columns.FINISH_REASON],
         "logprobs": _openai_logprobs(s.get(LOGPROBS), chat, token_bytes),
         **({"message": {"role": "assistant", **chat_message(s),
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
    return _answer(custom_id, line, body)


def chat_message(sample: dict) -> dict:
    """A chat result's content and tool calls, as vLLM's chat server answers: a named or
    required choice's calls with content "" (its output was the calls, or failed to be);
    auto's calls with the content the parser left (null for none); no ``tool_calls`` where
    none were made."""
    calls = sample.get(TOOL_CALLS)
    spec = read_spec(sample.get(TOOLS))
    content = sample["text"]
    if spec is None or spec["tool_choice"] == "none":
        return {"content": content}
    if calls_expected(spec):
        content = ""
    if not calls:
        return {"content": content}
    return {"content": content, "tool_calls": [
        {"id": call["id"], "type": "function",
         "function": {"name": call["name"], "arguments": call["arguments"]}}
        for call in calls]}


TOOL_CALLS = "tool_calls"  # the job's tool calls column (output.tool_calls_column's default)
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


def unfinished_error(custom_id, kind: str, line: int) -> BatchOutput:
    """The error line of a request a stopped batch did not reach (``kind``: canceled,
    expired, errored), in the hosted API's shape, with its line as every error line has."""
    code, message = UNFINISHED_CODES[kind]
    return error_line(line, custom_id, code, message)
