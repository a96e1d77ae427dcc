"""The key check in front of every route: a bearer key (``x-api-key`` on Anthropic's routes)
that the store knows as one of ``owners``, its owner set on the request; only the pages' own
files go without one."""

from __future__ import annotations

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from pipelines.report import view
from serve import anthropic
from serve.answers import error_body
from serve.store import Store


def add_key_check(app: FastAPI, store: Store, owners: set[str]) -> None:
    """``owners``: the accepted keys as the store records them (``Store.owner_of``)."""

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


def _is_page(path: str) -> bool:
    return path == "/ui" or path.startswith("/ui/batches/") or path.startswith("/static/")
