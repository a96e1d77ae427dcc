"""``/v1/batches``: a key's batches created (their input staged, then queued), listed, read
and cancelled, with the OpenAI API's shapes; and ``/metrics``, behind the same keys."""

from __future__ import annotations

import json
import os
import shutil
import time

from fastapi import FastAPI, Request
from fastapi.responses import Response
from starlette.concurrency import run_in_threadpool

from serve.answers import APIError, check_page, page
from serve.store import INPUT, Store, new_id

# what ``overnight batch`` runs (embeddings as a task: embed job, pipelines/batchfile/embeddings.py)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
WINDOW = 24 * 3600  # the hosted API's only completion_window, "24h"


def add_routes(app: FastAPI, store: Store, runner, window_s: float) -> None:
    """The batch endpoints on ``app`` (whose key check has set ``request.state.owner``)."""

    @app.post("/v1/batches")
    async def create_batch(request: Request):
        try:
            params = json.loads(await request.body())  # (its size: BodyLimit)
        except (ValueError, RecursionError):  # (RecursionError: nested thousands deep)
            raise APIError(400, "We could not parse the JSON body of your request.") from None
        if not isinstance(params, dict):
            raise APIError(400, "The request body must be a JSON object.")
        batch = _new_batch(store, request.state.owner, params, runner.served_model, window_s)
        await run_in_threadpool(_stage_input, store, batch)
        store.add_batch(request.state.owner, batch)
        runner.wake()
        return batch

    @app.get("/metrics")
    def metrics():
        """Prometheus metrics (serve/metrics.py), behind the same keys as the API."""
        from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

        from serve.metrics import registry_of

        return Response(generate_latest(registry_of(store)), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/batches")
    def list_batches(request: Request, limit: int = 20, after: str | None = None):
        check_page(limit, 100, "desc")
        data, more = store.list_batches(request.state.owner, after=after, limit=limit)
        return page(data, more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(request: Request, batch_id: str):
        return batch_of(store, request, batch_id)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(request: Request, batch_id: str):
        batch = batch_of(store, request, batch_id)
        if batch["status"] == "cancelling":
            return batch
        moved = store.update_batch(batch_id, only_if=("validating", "in_progress"),
                                   status="cancelling", cancelling_at=int(time.time()))
        if moved is None:
            raise APIError(400, "Cannot cancel a batch with status "
                           f"'{batch_of(store, request, batch_id)['status']}'.",
                           code="invalid_state")
        runner.wake()
        return moved


def batch_of(store: Store, request: Request, batch_id: str) -> dict:
    """The caller's OpenAI batch; another key's, or a message batch, is a 404."""
    found = store.get_batch(request.state.owner, batch_id)
    if found is None or found.get("api") is not None:  # a message batch is Anthropic's
        raise APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return found


def _new_batch(store: Store, owner: str, params: dict, model: str,
               window_s: float = WINDOW) -> dict:
    for key in ("input_file_id", "endpoint", "completion_window"):
        if params.get(key) in (None, ""):
            raise APIError(400, f"Missing required parameter: '{key}'.", param=key,
                           code="missing_required_parameter")
        if not isinstance(params[key], str):  # a list or an object reached SQLite: a 500
            raise APIError(400, f"Invalid type for '{key}': expected a string, but got "
                           f"{_json_type(params[key])} instead.", param=key,
                           code="invalid_type")
    if params["endpoint"] not in ENDPOINTS:
        raise APIError(400, f"Invalid value for 'endpoint': {params['endpoint']!r}. overnight "
                       "serve runs " + ", ".join(ENDPOINTS) + ".", param="endpoint",
                       code="invalid_value")
    if params["completion_window"] != "24h":
        raise APIError(400, "Invalid value for 'completion_window': only '24h' is supported.",
                       param="completion_window", code="invalid_value")
    metadata = params.get("metadata")
    if metadata is not None and not (
            isinstance(metadata, dict) and len(metadata) <= 16 and all(
                isinstance(k, str) and len(k) <= 64 and isinstance(v, str) and len(v) <= 512
                for k, v in metadata.items())):
        raise APIError(400, "Invalid 'metadata': at most 16 string keys (up to 64 characters) "
                       "with string values (up to 512 characters).", param="metadata",
                       code="invalid_value")
    input_file = store.get_file(owner, params["input_file_id"])
    if input_file is None:
        raise APIError(404, f"No such File object: {params['input_file_id']}",
                       param="input_file_id")
    if input_file["purpose"] != "batch":
        raise APIError(400, f"Invalid 'input_file_id': {input_file['id']} has purpose "
                       f"{input_file['purpose']!r}, not 'batch'.", param="input_file_id")
    now = int(time.time())
    return {
        "id": new_id("batch_"), "object": "batch", "endpoint": params["endpoint"],
        "errors": None, "input_file_id": input_file["id"], "completion_window": "24h",
        "status": "validating", "output_file_id": None, "error_file_id": None,
        "created_at": now, "in_progress_at": None, "expires_at": now + max(1, int(window_s)),
        "finalizing_at": None, "completed_at": None, "failed_at": None, "expired_at": None,
        "cancelling_at": None, "cancelled_at": None,
        "request_counts": {"total": 0, "completed": 0, "failed": 0},
        "metadata": metadata, "model": model, "usage": None}


def _stage_input(store: Store, batch: dict) -> None:
    """The batch's own copy of its input (a hard link where possible): deleting the file
    later, or a restart, cannot take it from a batch that still needs it."""
    folder = store.batch_dir(batch["id"])
    folder.mkdir(parents=True, exist_ok=True)
    source = store.file_path(batch["input_file_id"])
    try:
        os.link(source, folder / INPUT)
    except OSError:
        shutil.copyfile(source, folder / INPUT)


def _json_type(value) -> str:
    """A JSON value's type as OpenAI's messages name it."""
    for kinds, name in ((bool, "a boolean"), ((int, float), "a number"), (list, "an array"),
                        (dict, "an object"), (str, "a string")):
        if isinstance(value, kinds):
            return name
    return "null"
