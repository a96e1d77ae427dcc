"""``overnight view OUT``: a local web page of a job, running or done: its progress and errors,
and its rows, source columns beside generated ones, paged and filtered.

Everything is read from what the job writes, never from its processes: the job record (its
config, its state), the committed parts (the staging folder while it runs, the output once
done) and the run report. Rows are read a page at a time by a polars scan over the parts
(filters and the page pushed down: the output is never loaded whole), filtered by error kind,
finish reason, a text search in the output column, or a condition in SQL's small language of
filters (pipelines/report/filters.py: the frame's columns, literals and operators only; never polars'
SQL, which opens files a subquery names). A row's prompt is shown as the job rendered it: its
template over its values.

A row's text is data, never markup: the page is a static file whose script puts every value in
the page with ``textContent``, and a Content-Security-Policy allows no script but that file's
(a value holding ``<script>`` shows as those characters). The page binds to 127.0.0.1 unless
told otherwise and loads nothing from the internet.
"""

from __future__ import annotations

import json
import logging
from pathlib import Path

from starlette.requests import Request  # (at the top: FastAPI reads the routes' annotations)

from pipelines.errors import ConfigError, OutputError, one_line
from pipelines.report.filters import FilterError
from pipelines.storage import Location
from pipelines.order.grouped import running_parts
from pipelines.write import OutputStore, list_parts, summarize_part
from udfs import columns

PAGE_ROWS = 50  # rows per page, at most MAX_PAGE_ROWS when asked
MAX_PAGE_ROWS = 500
MAX_OFFSET = 1 << 60  # a row offset past any table (polars takes 64-bit offsets)
log = logging.getLogger("overnight.view")
STATIC = Path(__file__).with_name("view_static")
CSP = "default-src 'self'; img-src 'self' data:; object-src 'none'; base-uri 'none'"


class JobView:
    """What the page shows of one output, read afresh at each request (parts' counts are
    cached by part name: a part never changes once written)."""

    def __init__(self, path: str):
        self.store = OutputStore(path)
        if self.store.read_record() is None:
            raise OutputError(f"{path!r}: no overnight job record here "
                              f"({self.store.record.name} is missing)")
        self.counted: dict[str, dict] = {}
        self._renderer = None

    def _where(self) -> tuple[dict, Path, list[Path]]:
        record = self.store.read_record() or {}
        live = record.get("state") in ("running", "retrying", "committing") \
            and self.store.staging.exists()
        folder = running_parts(self.store.staging) if live else self.store.path
        files = [Path(str(folder / p.name)) for p in list_parts(folder)[0]] \
            if folder.exists() else []  # (a batch's output its owner deleted)
        return record, Path(str(folder)), files

    def key_column(self, record: dict) -> str:
        return ((record.get("config") or {}).get("input") or {}).get("id_column") \
            or columns.ROW_ID

    def status(self) -> dict:
        record, folder, files = self._where()
        key = self.key_column(record)
        rows = prompt = out = skipped = 0
        errors: dict[str, int] = {}
        steps = None
        for file in files:
            counts = self.counted.get(str(file))
            if counts is None:
                counts = self.counted[str(file)] = summarize_part(Location.of(file), key)
            rows += counts["input_rows"]
            prompt += counts["prompt_tokens"]
            out += counts["completion_tokens"]
            skipped += counts["skipped"]
            for kind, n in json.loads(counts["errors"]).items():
                errors[kind] = errors.get(kind, 0) + n
            if counts.get("steps"):
                from pipelines.write import add_steps

                steps = add_steps(steps or [], counts["steps"])
        config = record.get("config") or {}
        from pipelines.report.report_text import report_lines
        from pipelines.report.run_report import report_path

        report = _read_json(report_path(self.store.path)) \
            if record.get("state") == "complete" else None

        return {
            "output": str(self.store.path), "state": record.get("state") or "not started",
            "model": (config.get("model") or {}).get("name"),
            "rows_done": rows, "rows_total": record.get("rows_total") or rows,
            "errors": dict(sorted(errors.items())), "skipped": skipped,
            "tokens": {"prompt": prompt, "output": out}, "parts": len(files),
            "started": record.get("started"),
            "steps": [{k: s.get(k) for k in ("name", "rows_in", "rows_out", "dropped",
                                             "errors")} for s in steps or []],
            "report": report_lines(report) if report else None,
            "columns": self._columns(files),
            "output_column": (config.get("output") or {}).get("column"),
        }

    @staticmethod
    def _columns(files: list[Path]) -> list[str]:
        if not files:
            return []
        import pyarrow.parquet as pq

        return [n for n in pq.read_schema(files[0]).names
                if not n.startswith(columns.INTERNAL_PREFIX)]

    def _frame(self, files, record, error_kind, finish_reason, text, where):
        import polars as pl

        frame = pl.scan_parquet([str(f) for f in files])
        schema = self._collect(frame.collect_schema, None)
        names = schema.names()
        if error_kind:
            frame = frame.filter(pl.col(columns.ERROR_KIND) == error_kind
                                 if error_kind != "none" else pl.col(columns.ERROR).is_null())
        if finish_reason and columns.FINISH_REASON in names:
            frame = frame.filter(pl.col(columns.FINISH_REASON) == finish_reason)
        column = ((record.get("config") or {}).get("output") or {}).get("column")
        if text and column in names:
            frame = frame.filter(pl.col(column).cast(pl.String).str.contains(
                text, literal=True))
        if where:
            from pipelines.report.filters import filter_expr

            try:
                frame = frame.filter(filter_expr(where, schema))
            except FilterError as exc:  # the caller's condition, said in a line of our own
                raise FilterError(f"where {_quoted(where)}: {exc}") from None
        return frame

    def _collect(self, query, where: str | None):
        """``query()`` (a collect), a failure said in a line of our own: polars' text may
        name the server's paths, so it goes to the log only."""
        try:
            return query()
        except Exception as exc:  # noqa: BLE001 - a filter that fails on the data, a part gone
            log.warning("view %s: %s", self.store.path, one_line(exc))
            raise _unevaluable(where, exc) from None

    def rows(self, offset: int = 0, limit: int = PAGE_ROWS, error_kind: str | None = None,
             finish_reason: str | None = None, text: str | None = None,
             where: str | None = None) -> dict:
        """A page of rows matching the filters, and how many match."""
        import polars as pl

        record, _, files = self._where()
        if not files:
            return {"columns": [], "rows": [], "matching": 0, "offset": 0}
        limit, offset = max(1, min(limit, MAX_PAGE_ROWS)), min(max(offset, 0), MAX_OFFSET)
        frame = self._frame(files, record, error_kind, finish_reason, text, where)
        matching = self._collect(lambda: frame.select(pl.len()).collect().item(), where)
        page = self._collect(lambda: frame.slice(offset, limit).collect(), where)
        shown = [c for c in page.columns if not c.startswith(columns.INTERNAL_PREFIX)]
        return {"columns": shown, "offset": offset, "matching": matching,
                "rows": [[_plain(row[c]) for c in shown]
                         for row in page.select(shown).iter_rows(named=True)]}

    def prompt(self, offset: int, **filters) -> dict:
        """The prompt of the row at ``offset`` among those matching, as the job rendered it
        (its template over its values; a job of steps: its first step's prompt)."""
        record, _, files = self._where()
        if not files:
            return {"prompt": None}
        where = filters.get("where")
        frame = self._frame(files, record, filters.get("error_kind"),
                            filters.get("finish_reason"), filters.get("text"), where)
        page = self._collect(
            lambda: frame.slice(min(max(offset, 0), MAX_OFFSET), 1).collect(), where)
        if page.height == 0:
            return {"prompt": None}
        renderer = self._render(record)
        if renderer is None:
            return {"prompt": None}
        row = page.row(0, named=True)
        try:
            values = {v: row.get(v) for v in renderer.variables}
            return {"prompt": renderer.render_text(renderer.fill_nulls(values))}
        except Exception as exc:  # noqa: BLE001 - the row's own error says why it has none
            # its text may quote the server's paths or another part of the template: to the
            # log; the caller (in serve, a tenant) is told the kind of error only
            log.warning("view %s: a row's prompt: %s", self.store.path, one_line(exc))
            return {"prompt": None,
                    "error": f"the row's prompt could not be rendered: {type(exc).__name__}"}

    def _render(self, record: dict):
        if self._renderer is None:
            from udfs.stages.prompts import PromptRenderer, RenderSpec

            config = record.get("config") or {}
            prompt = config.get("prompt") or next(
                (s["prompt"] for s in config.get("steps") or () if s.get("prompt")), None)
            if not prompt or (prompt.get("template") is None
                              and prompt.get("messages_column") is None):
                return None
            model = config.get("model") or {}
            self._renderer = PromptRenderer(RenderSpec(
                template=prompt.get("template"), max_model_len=1 << 30,
                messages_column=prompt.get("messages_column"), tokenizer=model["name"],
                max_tokens=0, system=prompt.get("system"),
                chat=prompt.get("chat") if prompt.get("chat") is not None else True,
                trust_remote_code=model.get("trust_remote_code", False),
                chat_template_kwargs=prompt.get("chat_template_kwargs"),
                chat_template_content_format=prompt.get("chat_template_content_format",
                                                        "auto")))
        return self._renderer


# The page's files; they hold no data (the page fetches it), so `overnight serve` gives them
# without a key and its API behind one
STATIC_FILES = {"view.html": "text/html", "batches.html": "text/html",
                "view.js": "text/javascript", "batches.js": "text/javascript",
                "view.css": "text/css"}


def static_file(name: str):
    """One of the page's files, or a 404."""
    from fastapi import HTTPException
    from fastapi.responses import FileResponse

    if name not in STATIC_FILES:
        raise HTTPException(404)
    return FileResponse(STATIC / name, media_type=STATIC_FILES[name])


def secure_headers(response):
    """Every answer of the page's servers: no script but the page's own, no sniffing."""
    response.headers["Content-Security-Policy"] = CSP
    response.headers["X-Content-Type-Options"] = "nosniff"
    return response


def refused(exc: ConfigError, body=None):
    """A filter's (or a page's) mistake, a 400 of one line: as ``overnight view`` answers it
    (``{"error": line}``), or in ``body(line, param)``'s shape (serve: the API's error
    object), ``param`` "where" for a filter."""
    from fastapi.responses import JSONResponse

    if body is None:
        return JSONResponse({"error": str(exc)}, 400)
    return JSONResponse(body(str(exc), "where" if isinstance(exc, FilterError) else None), 400)


def job_routes(app, prefix: str, view_of, shown=lambda status, request: status,
               problem=refused) -> None:
    """The page's data at ``prefix``/status, /rows and /prompt. ``view_of(request, **path)``:
    the JobView the request may see (raising what the app answers otherwise); ``shown``: the
    status as this server shows it (serve names no path of its own); ``problem``: a
    ConfigError (the caller's filter) as this server answers it."""

    def answer(call):
        try:
            return call()
        except ConfigError as exc:  # a user's filter, said in a line
            return problem(exc)

    @app.get(f"{prefix}/status")
    def status(request: Request):
        view = view_of(request, **request.path_params)
        return shown(view.status(), request)

    @app.get(f"{prefix}/rows")
    def rows(request: Request, offset: int = 0, limit: int = PAGE_ROWS,
             error_kind: str | None = None, finish_reason: str | None = None,
             text: str | None = None, where: str | None = None):
        view = view_of(request, **request.path_params)
        return answer(lambda: view.rows(offset, limit, error_kind, finish_reason, text, where))

    @app.get(f"{prefix}/prompt")
    def prompt(request: Request, offset: int = 0, error_kind: str | None = None,
               finish_reason: str | None = None, text: str | None = None,
               where: str | None = None):
        view = view_of(request, **request.path_params)
        return answer(lambda: view.prompt(offset, error_kind=error_kind,
                                          finish_reason=finish_reason, text=text, where=where))


def create_app(path: str):
    from fastapi import FastAPI

    view = JobView(path)
    app = FastAPI(title="overnight view", docs_url=None, redoc_url=None, openapi_url=None)

    @app.middleware("http")
    async def _headers(request, call_next):
        return secure_headers(await call_next(request))

    @app.exception_handler(Exception)
    async def _failed(request, exc):  # a bug: one line here, its traceback in the log
        from fastapi.responses import JSONResponse

        return JSONResponse({"error": "overnight view failed on this request; its log "
                                      "says why"}, 500)

    @app.get("/")
    def page():
        return static_file("view.html")

    @app.get("/static/{name}")
    def static(name: str):
        return static_file(name)

    job_routes(app, "/api", lambda request: view)
    return app


def serve_view(path: str, host: str = "127.0.0.1", port: int = 8765) -> None:
    import uvicorn

    app = create_app(path)
    print(f"overnight view: http://{host}:{port}/  ({path}; Ctrl-C stops it)", flush=True)
    uvicorn.run(app, host=host, port=port, log_level="warning")


def _plain(value):
    """A value as the page shows it: JSON's own types; nested values as JSON text."""
    if value is None or isinstance(value, (str, int, float, bool)):
        return value
    if isinstance(value, bytes):
        return f"<{len(value)} bytes>"
    return json.dumps(value, default=str, ensure_ascii=False)


def _read_json(location) -> dict | None:
    try:
        return json.loads(location.read_text())
    except (OSError, ValueError):
        return None


def _quoted(where: str) -> str:
    """The caller's filter as a message quotes it (its start, where it is long)."""
    return repr(where if len(where) <= 200 else where[:200] + "...")


def _unevaluable(where: str | None, exc: BaseException) -> ConfigError:
    """What a caller is told when the rows cannot be read: in words of our own, never
    polars' (its messages name files and the server's paths)."""
    import polars as pl

    if not where:
        return ConfigError("the rows could not be read (the job's parts changed while they "
                           "were read?); try again")
    if isinstance(exc, (pl.exceptions.InvalidOperationError, pl.exceptions.ComputeError,
                        pl.exceptions.SchemaError)):
        why = ("a row's value does not convert or compare as the filter asks (CAST of a word "
               "to a number, say: TRY_CAST gives null instead)")
    else:
        why = "polars could not evaluate it on the job's rows"
    return FilterError(f"where {_quoted(where)} cannot be evaluated on these rows: {why}")
