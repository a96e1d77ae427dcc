"""Anthropic's Message Batches API: ``/v1/messages/batches``, with its headers (``x-api-key``,
``anthropic-version``), object shapes, pagination, limits and error objects.

A message batch is a batch of the store like an OpenAI one (the same queue, runner, resume,
cancel, expiry, keys and isolation), with ``api: "anthropic"``: its requests, the JSON body
of the create call, are written as a Message Batches file (``{"custom_id", "params"}``
lines) and run as ``overnight batch --format anthropic`` runs it
(pipelines/batchfile/anthropic.py). It is shown in Anthropic's shape (``as_message_batch``):

- ``processing_status``: ``in_progress`` (validating, queued, running, finalizing),
  ``canceling``, ``ended`` (completed, cancelled, expired, failed);
- ``request_counts``: ``processing`` / ``succeeded`` / ``errored`` while it runs; once it
  ended, its results counted by type (``canceled`` and ``expired`` for the requests a cancel
  or the window stopped before they ran; ``errored`` for those of a batch whose job could
  not go on);
- RFC 3339 times; ``results_url`` once it ended, where ``GET`` streams the JSONL results.

A request overnight cannot run (a parameter it cannot honour, a prompt too long) is its
``errored`` result, never the batch's refusal: only a body that is not a list of
``{custom_id, params}`` requests, a repeated ``custom_id``, or a batch over the limits is
refused (400, 413), as Anthropic refuses them.
"""

from __future__ import annotations

import json
import re
import time
from datetime import datetime, timezone

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse
from starlette.concurrency import run_in_threadpool

from pipelines.batchfile.envelopes import jsonl
from serve.store import INPUT, RESULTS, Store, new_id

PREFIX = "/v1/messages/batches"
ENDPOINT = "/v1/messages"  # a message batch's endpoint, as the store records it
MAX_REQUESTS, MAX_BYTES = 100_000, 256 << 20  # Anthropic's limits for one batch
# matched whole (fullmatch): "$" would also match before a trailing newline
CUSTOM_ID = re.compile(r"[a-zA-Z0-9_-]{1,64}")


class AnthropicError(Exception):
    def __init__(self, status: int, kind: str, message: str):
        super().__init__(message)
        self.status, self.kind, self.message = status, kind, message


def error_response(status: int, kind: str, message: str) -> JSONResponse:
    return JSONResponse({"type": "error", "error": {"type": kind, "message": message}}, status)


def is_anthropic_path(path: str) -> bool:
    return path == PREFIX or path.startswith(PREFIX + "/")


def add_routes(app: FastAPI, store: Store, runner, *, window_s: float,
               max_requests: int = MAX_REQUESTS, max_bytes: int = MAX_BYTES) -> None:
    """The Message Batches endpoints on ``app`` (whose middleware has set
    ``request.state.owner`` from the ``x-api-key`` header)."""
    routes = MessageBatchRoutes(store, runner, window_s=window_s, max_requests=max_requests,
                                max_bytes=max_bytes)
    app.add_exception_handler(AnthropicError, _error)
    app.post(PREFIX)(routes.create)
    app.get(PREFIX)(routes.list_batches)
    app.get(PREFIX + "/{batch_id}")(routes.retrieve)
    app.post(PREFIX + "/{batch_id}/cancel")(routes.cancel)
    app.delete(PREFIX + "/{batch_id}")(routes.delete)
    app.get(PREFIX + "/{batch_id}/results")(routes.results)


async def _error(request: Request, exc: AnthropicError):
    return error_response(exc.status, exc.kind, exc.message)


class MessageBatchRoutes:
    """The handlers of the Message Batches endpoints, one method each, over one store."""

    def __init__(self, store: Store, runner, *, window_s: float, max_requests: int,
                 max_bytes: int):
        self.store, self.runner, self.window_s = store, runner, window_s
        self.max_requests, self.max_bytes = max_requests, max_bytes

    async def create(self, request: Request):
        declared = int(request.headers.get("content-length") or 0)
        if declared > self.max_bytes:
            raise _too_large(self.max_bytes)
        body = await request.body()
        if len(body) > self.max_bytes:
            raise _too_large(self.max_bytes)
        try:
            params = json.loads(body)
        except (ValueError, RecursionError):  # a nesting too deep for json.loads too
            raise AnthropicError(400, "invalid_request_error",
                                 "The request body is not valid JSON.") from None
        requests = params.get("requests") if isinstance(params, dict) else None
        _check_requests(requests, self.max_requests)
        extra = sorted(set(params) - {"requests"})
        if extra:
            raise AnthropicError(400, "invalid_request_error",
                                 f"{extra[0]}: Extra inputs are not permitted")
        batch = _new_message_batch(len(requests), self.runner.served_model, self.window_s)
        await run_in_threadpool(_stage, self.store, batch["id"], requests)
        self.store.add_batch(request.state.owner, batch)
        self.runner.wake()
        return as_message_batch(batch, request)

    def list_batches(self, request: Request, limit: int = 20, before_id: str | None = None,
                     after_id: str | None = None):
        if not 1 <= limit <= 1000:
            raise AnthropicError(400, "invalid_request_error",
                                 "limit: must be between 1 and 1000")
        if before_id and after_id:
            raise AnthropicError(400, "invalid_request_error",
                                 "give before_id or after_id, not both")
        data, more = self.store.list_batches(request.state.owner, after=after_id,
                                             before=before_id, limit=limit, api="anthropic")
        shown = [as_message_batch(b, request) for b in data]
        return {"data": shown, "has_more": more,
                "first_id": shown[0]["id"] if shown else None,
                "last_id": shown[-1]["id"] if shown else None}

    def retrieve(self, request: Request, batch_id: str):
        return as_message_batch(_batch(self.store, request, batch_id), request)

    def cancel(self, request: Request, batch_id: str):
        batch = _batch(self.store, request, batch_id)
        if batch["status"] not in ("validating", "in_progress", "cancelling"):
            return as_message_batch(batch, request)  # ended: Anthropic answers with it
        moved = self.store.update_batch(batch_id, only_if=("validating", "in_progress"),
                                        status="cancelling", cancelling_at=int(time.time()))
        self.runner.wake()
        return as_message_batch(moved or _batch(self.store, request, batch_id), request)

    def delete(self, request: Request, batch_id: str):
        batch = _batch(self.store, request, batch_id)
        if as_message_batch(batch, request)["processing_status"] != "ended":
            raise AnthropicError(400, "invalid_request_error",
                                 f"Batch {batch_id} is still processing; cancel it, and "
                                 "delete it once it has ended.")
        self.store.delete_batch(request.state.owner, batch_id)
        return {"id": batch_id, "type": "message_batch_deleted"}

    def results(self, request: Request, batch_id: str):
        batch = _batch(self.store, request, batch_id)
        path = self.store.batch_dir(batch_id) / RESULTS
        if as_message_batch(batch, request)["processing_status"] != "ended":
            raise AnthropicError(400, "invalid_request_error",
                                 f"Batch {batch_id} has not ended; its results are not ready.")
        if not path.exists():
            raise AnthropicError(404, "not_found_error",
                                 f"Batch {batch_id} has no results.")
        return FileResponse(path, media_type="application/binary")


def _new_message_batch(total: int, model: str, window_s: float) -> dict:
    """A message batch as the store records it, queued (in_progress), not yet validated."""
    now = int(time.time())
    return {
        "id": new_id("msgbatch_"), "object": "batch", "api": "anthropic",
        "endpoint": ENDPOINT, "errors": None, "input_file_id": None,
        "completion_window": "24h", "status": "in_progress",  # checked: queued
        "output_file_id": None, "error_file_id": None, "created_at": now,
        "in_progress_at": None, "expires_at": now + max(1, int(window_s)),
        "finalizing_at": None, "completed_at": None, "failed_at": None,
        "expired_at": None, "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": total, "completed": 0, "failed": 0},
        "metadata": None, "model": model, "usage": None}


def as_message_batch(batch: dict, request: Request) -> dict:
    """A store batch in Anthropic's shape."""
    status = batch["status"]
    ended = status in ("completed", "failed", "cancelled", "expired")
    counts = batch.get("request_counts") or {}
    total = counts.get("total") or 0
    if ended:
        found = batch.get("result_counts") or {}
        request_counts = {k: found.get(k, 0) for k in ("succeeded", "errored", "canceled",
                                                        "expired")}
        request_counts["processing"] = 0
    else:
        done, failed = counts.get("completed") or 0, counts.get("failed") or 0
        request_counts = {"processing": max(0, total - done - failed), "succeeded": done,
                          "errored": failed, "canceled": 0, "expired": 0}
    url = str(request.base_url).rstrip("/") + f"{PREFIX}/{batch['id']}/results"
    return {"id": batch["id"], "type": "message_batch",
            "processing_status": "ended" if ended else
            "canceling" if status == "cancelling" else "in_progress",
            "request_counts": request_counts,
            "ended_at": _time(batch.get(f"{status}_at")) if ended else None,
            "created_at": _time(batch["created_at"]),
            "expires_at": _time(batch["expires_at"]),
            "archived_at": None, "cancel_initiated_at": _time(batch.get("cancelling_at")),
            "results_url": url if ended else None}


def _check_requests(requests, most: int) -> None:
    def bad(message: str):
        return AnthropicError(400, "invalid_request_error", message)

    if not isinstance(requests, list) or not requests:
        raise bad("requests: a non-empty list of {custom_id, params} is required")
    if len(requests) > most:
        raise bad(f"requests: at most {most} requests a batch; this one has {len(requests)}")
    seen = set()
    for i, item in enumerate(requests):
        if not isinstance(item, dict):
            raise bad(f"requests.{i}: must be an object with custom_id and params")
        extra = sorted(set(item) - {"custom_id", "params"})
        if extra:
            raise bad(f"requests.{i}.{extra[0]}: Extra inputs are not permitted")
        custom_id = item.get("custom_id")
        if not isinstance(custom_id, str) or not CUSTOM_ID.fullmatch(custom_id):
            raise bad(f"requests.{i}.custom_id: 1 to 64 letters, digits, '-' or '_'")
        if custom_id in seen:
            raise bad(f"requests.{i}.custom_id: {custom_id!r} is used by an earlier request; "
                      "each custom_id must be unique within the batch")
        seen.add(custom_id)
        if not isinstance(item.get("params"), dict):
            raise bad(f"requests.{i}.params: Field required (an object)")


def _stage(store: Store, batch_id: str, requests: list[dict]) -> None:
    folder = store.batch_dir(batch_id)
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{INPUT}.tmp"
    with open(tmp, "w", encoding="utf-8") as out:
        for item in requests:
            out.write(jsonl(item))  # a lone surrogate in a request escaped, not a 500
    tmp.replace(folder / INPUT)


def _batch(store: Store, request: Request, batch_id: str) -> dict:
    found = store.get_batch(request.state.owner, batch_id)
    if found is None or found.get("api") != "anthropic":
        raise AnthropicError(404, "not_found_error", f"No message batch with id '{batch_id}'.")
    return found


def _too_large(limit: int) -> AnthropicError:
    return AnthropicError(413, "request_too_large",
                          f"Request exceeds the maximum size of {limit} bytes for a batch.")


def _time(stamp) -> str | None:
    if stamp is None:
        return None
    return datetime.fromtimestamp(stamp, timezone.utc).isoformat().replace("+00:00", "Z")
