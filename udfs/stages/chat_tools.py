"""A conversation's tool turns as vLLM's chat path hands them to a chat template: a port of
``vllm/renderers/chat_utils.py``'s ``_postprocess_messages`` and the tool branch of
``_parse_chat_message_content`` (vLLM 0.32), so the renderer does it without importing vLLM.

The renderer runs it on the messages as the template reads them (each content already in the
template's content format, udfs/stages/prompts.py ``for_template``); tests/test_chat_tools.py
checks it against vLLM's own ``parse_chat_messages``.
"""

from __future__ import annotations

import json


def normalize_tool_messages(messages: list[dict], content_format: str) -> list[dict]:
    """New messages (the input left as it is), each as vLLM's chat path shapes it:

    - an assistant keeps its ``tool_calls`` (an empty list dropped, as a template then takes
      the plain assistant path) and its ``reasoning`` (also as ``reasoning_content``);
      each call's ``function.arguments`` becomes a dict: a JSON string parsed, JSON that is
      not an object, invalid JSON, None or "" all ``{}``;
    - a tool message keeps ``tool_call_id``; its content, a list of text parts, becomes the
      texts joined by a newline (a list holding any other part is kept as it is);
    - a ``name`` that is a string is kept on any message;
    - a content of None becomes "" ("string" format; a tool message's always) or [] ("openai").

    ValueError (the row's error, worded as vLLM's) for a call that is not an object or not
    of type function."""
    return [_message(message, content_format) for message in messages]


def _message(message: dict, content_format: str) -> dict:
    role = message["role"]
    content = message.get("content")
    if content is None:
        content = [] if content_format == "openai" else ""
    out = {"role": role, "content": content}
    if role == "assistant":
        if message.get("tool_calls") is not None:
            calls = [_call(call) for call in message["tool_calls"]]
            if calls:
                out["tool_calls"] = calls
        if message.get("reasoning") is not None:
            out["reasoning"] = out["reasoning_content"] = message["reasoning"]
    elif role == "tool":
        if "tool_call_id" in message:
            out["tool_call_id"] = message["tool_call_id"]
        # most templates read a tool's result as one string, whatever the client sent
        if isinstance(content, list) and not any(
                isinstance(part, dict) and part.get("type") != "text" for part in content):
            texts = [part.get("text", "") for part in content if isinstance(part, dict)]
            out["content"] = "\n".join(texts)
    if isinstance(message.get("name"), str):
        out["name"] = message["name"]
    return out


def _call(call) -> dict:
    """One assistant tool call, its function's arguments a dict."""
    if not isinstance(call, dict):
        raise ValueError("assistant tool_calls entries must be objects.")
    function = call.get("function")
    if call.get("type", "function") != "function" or not isinstance(function, dict):
        raise ValueError("chat completions only support assistant tool_calls of type "
                         "'function'.")
    return {**call, "function": {**function, "arguments": _arguments(function.get("arguments"))}}


def _arguments(value) -> dict:
    """A call's arguments as the dict templates expect (transformers' convention): what
    does not make one becomes {}, as vLLM has it, so an old turn never fails a conversation."""
    if not value:
        return {}
    if isinstance(value, str):
        try:
            value = json.loads(value)
        except (ValueError, RecursionError):
            return {}
    return dict(value) if isinstance(value, dict) else {}
