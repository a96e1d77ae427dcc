"""The HTTP API: ``/v1/files`` and ``/v1/batches`` with the OpenAI API's shapes, status codes and
error objects (``{"error": {"message", "type", "param", "code"}}``), behind bearer keys;
Anthropic's ``/v1/messages/batches`` (serve/anthropic.py) behind the same keys as
``x-api-key``; and the
pages (``/ui``): a key's batches, and each batch's job as ``overnight view`` shows it
(pipelines/report/view.py), its data behind the same keys at ``/v1/batches/{id}/view/...``.

A key's objects are invisible to every other key: a lookup by another key is a 404, the same
answer as for an id that never existed.

Every answer is the API's own: a body past its route's limit is a 413 as soon as the limit is
passed (``BodyLimit``: chunked or not, nothing more is read), a body or field of the wrong
shape a 400, and a server bug a 500 in the API's error object, its text in the log only.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import shutil
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from pipelines.report import view
from serve import anthropic
from serve.runner import Runner
from serve.store import INPUT, RESULTS, Store, new_id

# what ``overnight batch`` runs (embeddings as a task: embed job, pipelines/batchfile/embeddings.py)
ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses", "/v1/embeddings")
WINDOW = 24 * 3600  # the hosted API's only completion_window, "24h"
JSON_LIMIT = 1 << 20  # a body other than an upload or a message batch (a create call: ~10 kB)
UPLOAD_SLACK = 64 * 1024  # the multipart envelope around an uploaded file
VIEWS_KEPT = 4  # batches whose page data (and prompt tokenizer) stay loaded, most recent first
log = logging.getLogger("overnight.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def problem(path: str, status: int, message: str, *, param: str | None = None,
            code: str | None = None, kind: str = "invalid_request_error",
            anthropic_kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the error object of the API ``path`` belongs to: Anthropic's on its
    routes, OpenAI's everywhere else."""
    if anthropic.is_anthropic_path(path):
        return anthropic.error_response(status, anthropic_kind, message)
    return JSONResponse(error_body(message, kind, param, code), status)


class BodyLimit:
    """ASGI middleware: each request's body counted as it arrives (Content-Length or
    chunked); past its route's limit (``limit_of(method, path)``) the app is told the client
    left, what it answers is dropped, and the request is answered 413 by
    ``refuse(path, limit)``: nothing more is read. A chunked 600 MiB body was read whole
    before its 413 (the server went from 218 to 1,418 MiB), and ``POST /v1/batches`` had no
    limit at all. (An exception raised from ``receive`` would reach the route wrapped in
    the key middleware's task group, as a 500.)"""

    def __init__(self, app, limit_of, refuse):
        self.app, self.limit_of, self.refuse = app, limit_of, refuse

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        limit = self.limit_of(scope["method"], scope["path"])
        declared = _content_length(scope)
        if declared is not None and declared > limit:
            return await self.refuse(scope["path"], limit)(scope, receive, send)
        received, over, started = 0, False, False

        async def limited():
            nonlocal received, over
            if over:
                return {"type": "http.disconnect"}
            message = await receive()
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > limit:
                    over = True
                    return {"type": "http.disconnect"}
            return message

        async def watched(message):
            nonlocal started
            if over and not started:
                return  # the app's answer to a "disconnect": ours goes instead
            started = started or message["type"] == "http.response.start"
            await send(message)

        try:
            await self.app(scope, limited, watched)
        except Exception:  # noqa: BLE001 - what the app raised once told the client left
            if not over or started:
                raise
        if over and not started:
            await self.refuse(scope["path"], limit)(scope, receive, send)


def _content_length(scope) -> int | None:
    for name, value in scope.get("headers") or ():
        if name == b"content-length":
            try:
                return int(value)
            except ValueError:
                return None
    return None


def create_app(store: Store, runner: Runner, *, owners: set[str],
               max_upload_bytes: int, window_s: float = WINDOW) -> FastAPI:
    """``owners``: the accepted keys as the store records them (``Store.owner_of``)."""
    app = FastAPI(title="overnight serve", docs_url=None, redoc_url=None, openapi_url=None)
    _add_error_handlers(app)

    @app.middleware("http")
    async def _authenticate(request: Request, call_next):
        if request.method == "GET" and _is_page(request.url.path):
            # the pages' own files hold no data: the page asks for a key and sends it
            return view.secure_headers(await call_next(request))
        header = request.headers.get("authorization", "")
        scheme, _, key = header.partition(" ")
        if anthropic.is_anthropic_path(request.url.path):  # Anthropic's header, and errors
            key = request.headers.get("x-api-key") or (key if scheme.lower() == "bearer"
                                                       else "")
            if not key.strip():
                return anthropic.error_response(401, "authentication_error",
                                                "x-api-key header is required")
            if store.owner_of(key.strip()) not in owners:
                return anthropic.error_response(401, "authentication_error",
                                                "invalid x-api-key")
        elif scheme.lower() != "bearer" or not key.strip():
            return JSONResponse(error_body(
                "You didn't provide an API key. Provide it in the Authorization header "
                "(Authorization: Bearer YOUR_KEY)."), 401)
        owner = store.owner_of(key.strip())
        if owner not in owners:
            return JSONResponse(error_body("Incorrect API key provided.",
                                           code="invalid_api_key"), 401)
        request.state.owner = owner
        return await call_next(request)

    # -- files -------------------------------------------------------------------------------

    @app.post("/v1/files")
    async def upload_file(request: Request):
        form = await request.form(max_files=1, max_fields=8)  # its size: BodyLimit
        upload, purpose = form.get("file"), form.get("purpose")
        if upload is None or isinstance(upload, str):
            raise APIError(400, "Missing required parameter: 'file'.", param="file",
                           code="missing_required_parameter")
        if not purpose:
            raise APIError(400, "Missing required parameter: 'purpose'.", param="purpose",
                           code="missing_required_parameter")
        if purpose != "batch":
            raise APIError(400, f"Invalid value for 'purpose': {purpose!r}; overnight serve "
                           "stores files for the Batch API only ('batch').", param="purpose",
                           code="invalid_value")
        filename = os.path.basename(upload.filename or "")
        if not filename.endswith(".jsonl"):
            raise APIError(400, "Invalid file format for Batch API. Must be .jsonl")
        tmp = store.temp_path()
        try:
            size = await run_in_threadpool(_copy, upload.file, tmp)
            if size > max_upload_bytes:
                raise _too_large(max_upload_bytes)
            return store.add_file(request.state.owner, tmp, filename, purpose)
        finally:
            tmp.unlink(missing_ok=True)

    @app.get("/v1/files")
    def list_files(request: Request, purpose: str | None = None, limit: int = 10000,
                   order: str = "desc", after: str | None = None):
        _check_page(limit, 10000, order)
        data, more = store.list_files(request.state.owner, purpose=purpose, after=after,
                                      limit=limit, order=order)
        return _page(data, more)

    @app.get("/v1/files/{file_id}")
    def get_file(request: Request, file_id: str):
        return _file(store, request, file_id)

    @app.get("/v1/files/{file_id}/content")
    def file_content(request: Request, file_id: str):
        _file(store, request, file_id)
        return FileResponse(store.file_path(file_id), media_type="application/octet-stream")

    @app.delete("/v1/files/{file_id}")
    def delete_file(request: Request, file_id: str):
        if not store.delete_file(request.state.owner, file_id):
            raise _no_file(file_id)
        return {"id": file_id, "object": "file", "deleted": True}

    # -- batches -----------------------------------------------------------------------------

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
        _check_page(limit, 100, "desc")
        data, more = store.list_batches(request.state.owner, after=after, limit=limit)
        return _page(data, more)

    @app.get("/v1/batches/{batch_id}")
    def get_batch(request: Request, batch_id: str):
        return _batch(store, request, batch_id)

    # -- pages: the key's batches, and each batch's job as `overnight view` shows it ------

    @app.get("/ui")
    def batches_page():
        return view.static_file("batches.html")

    @app.get("/ui/batches/{batch_id}")
    def batch_page(batch_id: str):
        return view.static_file("view.html")

    @app.get("/static/{name}")
    def static(name: str):
        return view.static_file(name)

    views = ViewCache(store)

    def batch_view(request: Request, batch_id: str) -> view.JobView:
        batch = _batch(store, request, batch_id)  # another key's batch: 404, as everywhere
        found = views.get(batch_id)
        if found is None:  # its job has not started
            raise APIError(404, f"Batch '{batch_id}' has no rows yet (status "
                           f"{batch['status']}).", param="batch_id", code="no_rows")
        return found

    def shown(status: dict, request: Request) -> dict:
        """The status as a key's user sees it: the batch, never the server's paths."""
        batch = _batch(store, request, request.path_params["batch_id"])
        work = str(store.batch_dir(batch["id"]) / f"{RESULTS}.overnight" / "output")
        status.update(output=batch["id"], model=batch["model"], batch=batch)
        if status.get("report"):
            status["report"] = [line.replace(work, batch["id"]).replace(
                runner.model, batch["model"]) for line in status["report"]]
        return status

    # the caller's filter, in a line: in the API's error object
    view.job_routes(app, "/v1/batches/{batch_id}/view", batch_view, shown,
                    functools.partial(view.refused, body=_invalid_value))
    anthropic.add_routes(app, store, runner, window_s=window_s)

    @app.post("/v1/batches/{batch_id}/cancel")
    def cancel_batch(request: Request, batch_id: str):
        batch = _batch(store, request, batch_id)
        if batch["status"] == "cancelling":
            return batch
        moved = store.update_batch(batch_id, only_if=("validating", "in_progress"),
                                   status="cancelling", cancelling_at=int(time.time()))
        if moved is None:
            raise APIError(400, "Cannot cancel a batch with status "
                           f"'{_batch(store, request, batch_id)['status']}'.",
                           code="invalid_state")
        runner.wake()
        return moved

    limits = BodyLimits(max_upload_bytes)
    app.add_middleware(BodyLimit, limit_of=limits.limit_of, refuse=limits.refuse)  # outermost
    return app


@dataclass(frozen=True)
class BodyLimits:
    """BodyLimit's configuration for serve's routes: an upload's limit (``max_upload_bytes``
    and its multipart envelope), a message batch's, every other body's (JSON_LIMIT); and the
    413 past it, in the error object of the API the path belongs to."""

    max_upload_bytes: int

    def limit_of(self, method: str, path: str) -> int:
        if method == "POST" and path == "/v1/files":
            return self.max_upload_bytes + UPLOAD_SLACK
        if method == "POST" and path == anthropic.PREFIX:
            return anthropic.MAX_BYTES
        return JSON_LIMIT

    def refuse(self, path: str, limit: int) -> JSONResponse:
        if path == "/v1/files":
            return _answer(_too_large(self.max_upload_bytes))
        return problem(path, 413, f"Request exceeds the maximum size of {limit} bytes.",
                       code="request_too_large", anthropic_kind="request_too_large")


def _add_error_handlers(app: FastAPI) -> None:
    """Every failure answered in the API's error object (Anthropic's on its routes): an
    APIError as it says, JSON nested too deep a 400, a bad parameter a 400 naming it, an
    unknown route a 404, a bug a 500 without its text (the traceback: the server's log)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return _answer(exc)

    @app.exception_handler(RecursionError)
    async def _too_deep(request: Request, exc: RecursionError):
        # JSON nested thousands deep: Python's parser gives up (either API's create call)
        log.warning("%s %s: %s", request.method, request.url.path, type(exc).__name__)
        return problem(request.url.path, 400, "The request body is nested too deeply to be "
                       "read (JSON nested more than a few hundred levels).",
                       code="invalid_json")

    @app.exception_handler(ClientDisconnect)
    async def _gone(request: Request, exc: ClientDisconnect):
        return Response(status_code=400)  # the client left mid-body: no one reads this

    @app.exception_handler(Exception)
    async def _server_error(request: Request, exc: Exception):
        # a bug: the caller gets the API's error object, never the exception's text (the
        # traceback goes to the server's log: Starlette re-raises it to uvicorn)
        return problem(request.url.path, 500, "The server had an error while processing "
                       "your request; its log says why.", kind="server_error",
                       anthropic_kind="api_error")

    @app.exception_handler(HTTPException)
    async def _http_error(request: Request, exc: HTTPException):
        message = ("Invalid URL " f"({request.method} {request.url.path})"
                   if exc.status_code in (404, 405) else str(exc.detail))
        if anthropic.is_anthropic_path(request.url.path):
            return anthropic.error_response(exc.status_code, "not_found_error" if
                                            exc.status_code == 404 else "invalid_request_error",
                                            message)
        return JSONResponse(error_body(message), exc.status_code)

    @app.exception_handler(RequestValidationError)
    async def _bad_params(request: Request, exc: RequestValidationError):
        first = exc.errors()[0]
        param = str(first["loc"][-1]) if first.get("loc") else None
        if anthropic.is_anthropic_path(request.url.path):
            return anthropic.error_response(400, "invalid_request_error",
                                            f"{param}: {first['msg']}")
        return JSONResponse(error_body(f"Invalid value for '{param}': {first['msg']}.",
                                       param=param, code="invalid_value"), 400)


def _invalid_value(message: str, param: str | None) -> dict:
    """A caller's filter refused (pipelines/report/view.py: refused), as the API's error object."""
    return error_body(message, param=param, code="invalid_value")


class ViewCache:
    """The page data of the batches viewed last (a JobView holds a tokenizer once a prompt
    is shown): at most ``kept``, and none of a batch whose job's data is gone (deleted, or
    swept past the retention). One a batch ever viewed was kept for the server's life."""

    def __init__(self, store: Store, kept: int = VIEWS_KEPT):
        self.store, self.kept = store, kept
        self.views: OrderedDict[str, view.JobView] = OrderedDict()
        self._lock = threading.Lock()  # (the routes run in a thread pool)

    def record(self, batch_id: str) -> Path:
        return self.store.batch_dir(batch_id) / f"{RESULTS}.overnight" / "output.overnight.json"

    def get(self, batch_id: str) -> view.JobView | None:
        """The batch's JobView, None if its job has not started (or its data is gone)."""
        with self._lock:
            for gone in [b for b in self.views if not self.record(b).exists()]:
                del self.views[gone]
            found = self.views.get(batch_id)
            if found is not None:
                self.views.move_to_end(batch_id)
                return found
        if not self.record(batch_id).exists():
            return None
        made = view.JobView(str(self.record(batch_id).parent / "output"))
        with self._lock:
            found = self.views.setdefault(batch_id, made)
            self.views.move_to_end(batch_id)
            while len(self.views) > self.kept:
                self.views.popitem(last=False)
        return found


def _answer(exc: APIError) -> JSONResponse:
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), exc.status)


def _is_page(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/batches/") or path.startswith("/static/")


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


def _file(store: Store, request: Request, file_id: str) -> dict:
    found = store.get_file(request.state.owner, file_id)
    if found is None:
        raise _no_file(file_id)
    return found


def _batch(store: Store, request: Request, batch_id: str) -> dict:
    found = store.get_batch(request.state.owner, batch_id)
    if found is None or found.get("api") is not None:  # a message batch is Anthropic's
        raise APIError(404, f"No batch found with id '{batch_id}'.", param="batch_id")
    return found


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id")


def _too_large(limit: int) -> APIError:
    return APIError(413, f"File too large: the limit is {limit} bytes.", param="file",
                    code="file_too_large")


def _check_page(limit: int, most: int, order: str) -> None:
    if not 1 <= limit <= most:
        raise APIError(400, f"Invalid 'limit': must be between 1 and {most}.", param="limit",
                       code="invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(400, "Invalid 'order': 'asc' or 'desc'.", param="order",
                       code="invalid_value")


def _page(data: list[dict], has_more: bool) -> dict:
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def _copy(source, target) -> int:
    with open(target, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    return os.path.getsize(target)


def _json_type(value) -> str:
    """A JSON value's type as OpenAI's messages name it."""
    for kinds, name in ((bool, "a boolean"), ((int, float), "a number"), (list, "an array"),
                        (dict, "an object"), (str, "a string")):
        if isinstance(value, kinds):
            return name
    return "null"
