"""A row's chat messages: its messages column read as messages and image sources, and the
user message a template's text and images become."""

from __future__ import annotations

import json


def decoded(value):
    """A messages-column value: a list of messages, or a string holding JSON (a list of
    messages, or a string: a raw prompt), or any other string: a raw prompt."""
    if isinstance(value, str):
        try:
            parsed = json.loads(value)
        except ValueError:
            return value
        return parsed if isinstance(parsed, (list, str)) else value
    return value


def messages(value) -> tuple[list[dict], list[dict]]:
    """A row's messages column as chat messages, and the image sources its ``image_url`` parts
    hold, in order; ValueError (a row error) if it is not. A content that is a list of parts
    keeps its text parts and has ``{"type": "image"}`` where an image stands: the parts a chat
    template reads, as vLLM's chat path gives them."""
    value = decoded(value)
    if not isinstance(value, list) or not value:
        raise ValueError("the messages column must hold a non-empty list of {role, content}")
    out, found = [], []
    for item in value:
        content = item.get("content") if isinstance(item, dict) else None
        calls = item.get("tool_calls") if isinstance(item, dict) else None
        if not isinstance(item, dict) or not isinstance(item.get("role"), str) \
                or not (isinstance(content, (str, list)) or content is None and calls):
            raise ValueError(f"not a {{role, content}} message: {str(item)[:80]}")
        if isinstance(content, list):
            content = [_part(part, found) for part in content]
        message = {"role": item["role"], "content": content}
        # a conversation's tool turns, the fields vLLM's chat path keeps of them: an
        # assistant's calls, a tool message's tool_call_id
        key = TOOL_FIELDS.get(item["role"])
        if key is not None and item.get(key) is not None:
            message[key] = item[key]
        out.append(message)
    return out, found


TOOL_FIELDS = {"assistant": "tool_calls", "tool": "tool_call_id"}



def _part(part, found: list[dict]) -> dict:
    """One content part as a chat template reads it; an image's source added to ``found``."""
    kind = part.get("type") if isinstance(part, dict) else None
    if kind == "text" and isinstance(part.get("text"), str):
        return {"type": "text", "text": part["text"]}
    if kind == "image_url":
        url = part.get("image_url")
        url = url.get("url") if isinstance(url, dict) else url
        if not isinstance(url, str) or not url:
            raise ValueError("an image_url part without a url")
        # as OpenAI's API takes them: never a path, so a request cannot make a server read
        # one of its own files
        if not url.startswith(("data:", "http://", "https://")):
            raise ValueError(f"an image_url must be a data: URL or an http(s) URL, not "
                             f"{url[:60]!r}")
        found.append({"bytes": None, "path": url})
        return {"type": "image"}
    raise ValueError(f"a content part must be text or image_url: {str(part)[:80]}")


def user_content(text: str, count: int) -> str | list[dict]:
    """A user message's content: the text, after ``count`` images (the order most
    vision-language models are trained on)."""
    if not count:
        return text
    return [*({"type": "image"} for _ in range(count)), {"type": "text", "text": text}]
