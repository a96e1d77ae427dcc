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

from fastapi import FastAPI

from serve import anthropic, routes_batches, routes_files, routes_view
from serve.answers import add_error_handlers
from serve.body_limit import BodyLimit, BodyLimits
from serve.keys import add_key_check
from serve.runner import Runner
from serve.store import Store


def create_app(store: Store, runner: Runner, *, owners: set[str],
               max_upload_bytes: int, window_s: float = routes_batches.WINDOW) -> FastAPI:
    """``owners``: the accepted keys as the store records them (``Store.owner_of``)."""
    app = FastAPI(title="overnight serve", docs_url=None, redoc_url=None, openapi_url=None)
    add_error_handlers(app)
    add_key_check(app, store, owners)  # every route's guard, the pages' own files aside
    routes_files.add_routes(app, store, max_upload_bytes)
    routes_batches.add_routes(app, store, runner, window_s)
    routes_view.add_routes(app, store, runner)
    anthropic.add_routes(app, store, runner, window_s=window_s)
    limits = BodyLimits(max_upload_bytes)
    app.add_middleware(BodyLimit, limit_of=limits.limit_of, refuse=limits.refuse)  # outermost
    return app
