"""A request body's size, counted as it arrives and refused with a 413 past its route's
limit (``BodyLimit``), and those limits for serve's routes (``BodyLimits``)."""

from __future__ import annotations

from dataclasses import dataclass

from fastapi.responses import JSONResponse

from serve import anthropic
from serve.answers import answer, file_too_large, problem

JSON_LIMIT = 1 << 20  # a body other than an upload or a message batch (a create call: ~10 kB)
UPLOAD_SLACK = 64 * 1024  # the multipart envelope around an uploaded file


class BodyLimit:
    """ASGI middleware: each request's body counted as it arrives (Content-Length or
    chunked); past its route's limit (``limit_of(method, path)``) the app is told the client
    left, what it answers is dropped, and the request is answered 413 by
    ``refuse(path, limit)``: nothing more is read, so a chunked body, which has no
    Content-Length to refuse it by, is never held whole. (An exception raised from
    ``receive`` would reach the route wrapped in the key middleware's task group, as a
    500.)"""

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
            return answer(file_too_large(self.max_upload_bytes))
        return problem(path, 413, f"Request exceeds the maximum size of {limit} bytes.",
                       code="request_too_large", anthropic_kind="request_too_large")
