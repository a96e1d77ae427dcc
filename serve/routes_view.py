"""The pages (``/ui``): a key's batches, and each batch's job as ``overnight view`` shows it
(pipelines/report/view.py), its data behind the same keys at ``/v1/batches/{id}/view/...``."""

from __future__ import annotations

import functools
import threading
from collections import OrderedDict
from pathlib import Path

from fastapi import FastAPI, Request

from pipelines.report import view
from serve.answers import APIError, error_body
from serve.routes_batches import batch_of
from serve.store import RESULTS, Store

VIEWS_KEPT = 4  # batches whose page data (and prompt tokenizer) stay loaded, most recent first


def add_routes(app: FastAPI, store: Store, runner) -> None:
    """The pages' files (no key: they hold no data) and each batch's view data (the key's)."""

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
        batch = batch_of(store, request, batch_id)  # another key's batch: 404, as everywhere
        found = views.get(batch_id)
        if found is None:  # its job has not started
            raise APIError(404, f"Batch '{batch_id}' has no rows yet (status "
                           f"{batch['status']}).", param="batch_id", code="no_rows")
        return found

    def shown(status: dict, request: Request) -> dict:
        """The status as a key's user sees it: the batch, never the server's paths."""
        batch = batch_of(store, request, request.path_params["batch_id"])
        work = str(store.batch_dir(batch["id"]) / f"{RESULTS}.overnight" / "output")
        status.update(output=batch["id"], model=batch["model"], batch=batch)
        if status.get("report"):
            status["report"] = [line.replace(work, batch["id"]).replace(
                runner.model, batch["model"]) for line in status["report"]]
        return status

    # the caller's filter, in a line: in the API's error object
    view.job_routes(app, "/v1/batches/{batch_id}/view", batch_view, shown,
                    functools.partial(view.refused, body=_invalid_value))


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
