"""A batch's input file checked the way the hosted Batch API checks it before running anything.

The hosted API fails the whole batch (status ``failed``) when the file itself is malformed, with
one ``errors.data`` entry per bad line: ``{code, message, param, line}``, using its documented
codes ``empty_file``, ``invalid_json_line``, ``duplicate_custom_id``, ``url_mismatch``,
``model_mismatch``, ``too_many_tasks`` (and ``missing_required_parameter`` /
``invalid_request`` for a line without the envelope's keys). What is wrong *inside* a request's
body (a bad ``max_tokens``, a prompt too long) is not a file error: that request fails alone,
in the error file, which is what ``overnight batch`` already does.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path

MAX_REQUESTS = 50_000  # the hosted API's limit per batch
MAX_REPORTED = 100  # errors.data entries kept; the count of the rest is said in the last one


@dataclass
class Checked:
    requests: int = 0
    errors: list[dict] = field(default_factory=list)
    more: int = 0  # errors found beyond MAX_REPORTED

    def add(self, code: str, message: str, line: int | None, param: str | None = None) -> None:
        if len(self.errors) < MAX_REPORTED:
            self.errors.append({"code": code, "message": message, "param": param,
                                "line": line})
        else:
            self.more += 1

    def as_errors(self) -> dict | None:
        if not self.errors:
            return None
        data = list(self.errors)
        if self.more:
            data.append({"code": "too_many_errors", "param": None, "line": None,
                         "message": f"{self.more} more errors not listed"})
        return {"object": "list", "data": data}


def check_input_file(path: Path, endpoint: str) -> Checked:
    """Every line of the file, streamed: the requests counted, the file-level errors listed."""
    checked = Checked()
    seen: set[str] = set()
    model: str | None = None
    with open(path, "rb") as source:
        for number, raw in enumerate(source, start=1):
            if not raw.strip():
                continue
            checked.requests += 1
            try:
                line = json.loads(raw.decode("utf-8"))
            except (UnicodeDecodeError, ValueError, RecursionError):  # deep nesting too
                checked.add("invalid_json_line", "This line is not parseable as valid JSON.",
                            number)
                continue
            if not isinstance(line, dict):
                checked.add("invalid_request", "A line must be a JSON object with custom_id, "
                            "method, url and body.", number)
                continue
            missing = [key for key in ("custom_id", "method", "url", "body") if key not in line]
            if missing:
                checked.add("missing_required_parameter",
                            f"Missing required parameter: '{missing[0]}'.", number, missing[0])
                continue
            custom_id, body = line["custom_id"], line["body"]
            if not isinstance(custom_id, str) or not custom_id:
                checked.add("invalid_request", "custom_id must be a non-empty string.", number,
                            "custom_id")
            elif custom_id in seen:
                checked.add("duplicate_custom_id", "The custom_id for this request is a "
                            "duplicate of another request. The custom_id parameter must be "
                            "unique for each request in a batch.", number, "custom_id")
            else:
                seen.add(custom_id)
            if line["method"] != "POST":
                checked.add("invalid_request", "method must be POST.", number, "method")
            if line["url"] != endpoint:
                checked.add("url_mismatch", "The provided URL does not match the batch "
                            f"endpoint ({endpoint}).", number, "url")
            if not isinstance(body, dict):
                checked.add("invalid_request", "body must be a JSON object.", number, "body")
            elif isinstance(body.get("model"), str):
                if model is None:
                    model = body["model"]
                elif body["model"] != model:
                    checked.add("model_mismatch", "The provided model does not match the "
                                f"model of the other requests in this batch ({model!r}).",
                                number, "body.model")
    if checked.requests == 0:
        checked.add("empty_file", "The batch input file is empty.", None)
    elif checked.requests > MAX_REQUESTS:
        checked.add("too_many_tasks", f"The batch has {checked.requests} requests; the limit "
                    f"is {MAX_REQUESTS}.", None)
    return checked
