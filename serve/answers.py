"""How the OpenAI routes answer: the API's error object (``APIError``, ``problem``), the
handlers that turn every failure into it (Anthropic's on its routes), and a list's page."""

from __future__ import annotations

import logging

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from starlette.exceptions import HTTPException
from starlette.requests import ClientDisconnect

from serve import anthropic

log = logging.getLogger("overnight.serve")


class APIError(Exception):
    """A refusal a route raises, answered in OpenAI's error object with its status."""

    def __init__(self, status: int, message: str, *, param: str | None = None,
                 code: str | None = None, kind: str = "invalid_request_error"):
        super().__init__(message)
        self.status, self.message, self.param, self.code, self.kind = (
            status, message, param, code, kind)


def error_body(message: str, kind: str = "invalid_request_error", param: str | None = None,
               code: str | None = None) -> dict:
    """OpenAI's error object."""
    return {"error": {"message": message, "type": kind, "param": param, "code": code}}


def problem(path: str, status: int, message: str, *, param: str | None = None,
            code: str | None = None, kind: str = "invalid_request_error",
            anthropic_kind: str = "invalid_request_error") -> JSONResponse:
    """An error in the error object of the API ``path`` belongs to: Anthropic's on its
    routes, OpenAI's everywhere else."""
    if anthropic.is_anthropic_path(path):
        return anthropic.error_response(status, anthropic_kind, message)
    return JSONResponse(error_body(message, kind, param, code), status)


def answer(exc: APIError) -> JSONResponse:
    """An APIError as the response it stands for."""
    return JSONResponse(error_body(exc.message, exc.kind, exc.param, exc.code), exc.status)


def file_too_large(limit: int) -> APIError:
    """An upload past ``limit`` bytes: the 413 of ``POST /v1/files``."""
    return APIError(413, f"File too large: the limit is {limit} bytes.", param="file",
                    code="file_too_large")


def check_page(limit: int, most: int, order: str) -> None:
    """A list call's ``limit`` (1 to ``most``) and ``order`` checked, a 400 naming the bad one."""
    if not 1 <= limit <= most:
        raise APIError(400, f"Invalid 'limit': must be between 1 and {most}.", param="limit",
                       code="invalid_value")
    if order not in ("asc", "desc"):
        raise APIError(400, "Invalid 'order': 'asc' or 'desc'.", param="order",
                       code="invalid_value")


def page(data: list[dict], has_more: bool) -> dict:
    """A list call's answer: OpenAI's list object."""
    return {"object": "list", "data": data, "has_more": has_more,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None}


def add_error_handlers(app: FastAPI) -> None:
    """Every failure answered in the API's error object (Anthropic's on its routes): an
    APIError as it says, JSON nested too deep a 400, a bad parameter a 400 naming it, an
    unknown route a 404, a bug a 500 without its text (the traceback: the server's log)."""

    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError):
        return answer(exc)

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
