"""Credentials out of every line: URLs as they may be shown in a message, a record, a report
or a row's error. (Here, not in pipelines/, so the engines' row errors use it too.)"""

from __future__ import annotations

import re


def redact(uri: str) -> str:
    """A URI without its credentials (``user:password@``, however the password is spelled,
    ``/`` and ``@`` included), query and fragment, for messages, records and reports."""
    text = str(uri)
    if "://" not in text:
        return text
    scheme, rest = text.split("://", 1)
    rest = rest.split("?", 1)[0].split("#", 1)[0]
    if "@" in rest:
        head = rest.split("@", 1)[0]
        # "user:secret@host", "token@host": credentials. "bucket/key@v2": a path, kept.
        if ":" in head or "/" not in head:
            rest = rest.rsplit("@", 1)[1]
    return f"{scheme}://{rest}"


_URL = re.compile(r"[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"]+")


def scrub(text: str) -> str:
    """Every URL in a message, redacted: the last guard before a line is printed."""
    return _URL.sub(lambda m: redact(m.group(0)), str(text))


def scrub_record(value):
    """A record or report (dicts, lists, strings) with every URL in it redacted."""
    if isinstance(value, dict):
        return {k: scrub_record(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [scrub_record(v) for v in value]
    return scrub(value) if isinstance(value, str) and "://" in value else value
