"""``/v1/files``: a key's batch input files uploaded, listed, read and deleted, with the
OpenAI API's shapes."""

from __future__ import annotations

import os
import shutil

from fastapi import FastAPI, Request
from fastapi.responses import FileResponse
from starlette.concurrency import run_in_threadpool

from serve.answers import APIError, check_page, file_too_large, page
from serve.store import Store


def add_routes(app: FastAPI, store: Store, max_upload_bytes: int) -> None:
    """The file endpoints on ``app`` (whose key check has set ``request.state.owner``)."""

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
                raise file_too_large(max_upload_bytes)
            return store.add_file(request.state.owner, tmp, filename, purpose)
        finally:
            tmp.unlink(missing_ok=True)

    @app.get("/v1/files")
    def list_files(request: Request, purpose: str | None = None, limit: int = 10000,
                   order: str = "desc", after: str | None = None):
        check_page(limit, 10000, order)
        data, more = store.list_files(request.state.owner, purpose=purpose, after=after,
                                      limit=limit, order=order)
        return page(data, more)

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


def _file(store: Store, request: Request, file_id: str) -> dict:
    found = store.get_file(request.state.owner, file_id)
    if found is None:
        raise _no_file(file_id)
    return found


def _no_file(file_id: str) -> APIError:
    return APIError(404, f"No such File object: {file_id}", param="id")


def _copy(source, target) -> int:
    with open(target, "wb") as out:
        shutil.copyfileobj(source, out, 1 << 20)
    return os.path.getsize(target)
