"""The server's state: file and batch objects in SQLite, file contents on disk.

Layout of the data directory::

    state.sqlite3          files and batches (the API objects as JSON, an owner, a status)
    key.secret             the HMAC key owners are computed with (random, made once)
    serve.lock             held (flock) by the one server that owns the directory
    files/<file id>        each file's bytes, written to a temporary name and renamed in
    batches/<batch id>/    a batch's input, its ``overnight batch`` work directory and log

An owner is an HMAC-SHA256 of an API key under ``key.secret``, never the key: a copy of the
database alone does not let keys be tried against it (a store made with unsalted SHA-256
owners is moved over as each of its keys is seen again). Every read takes the owner, so a key
that does not own an object finds nothing, exactly as if it did not exist. Each write is one
SQLite transaction (WAL, synchronous FULL): a ``kill -9`` loses at most the request in flight.

One server at a time: a second on the same directory would take the first one's batches for
its own leftovers (it stops their children as stale). A batch in a final status (TERMINAL)
never leaves it.
"""

from __future__ import annotations

import fcntl
import hashlib
import hmac
import json
import os
import secrets
import shutil
import sqlite3
import threading
import time
from pathlib import Path

from pipelines.errors import ConfigError

SCHEMA = """
CREATE TABLE IF NOT EXISTS files (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL,
    purpose TEXT NOT NULL, object TEXT NOT NULL);
CREATE TABLE IF NOT EXISTS batches (
    seq INTEGER PRIMARY KEY AUTOINCREMENT, id TEXT UNIQUE NOT NULL, owner TEXT NOT NULL,
    status TEXT NOT NULL, object TEXT NOT NULL, child_pid INTEGER);
"""


TERMINAL = ("completed", "failed", "expired", "cancelled")
# a batch's folder (batches/<batch id>/): its input's copy, and the result and error files its
# job writes (the job's work directory beside them, RESULTS.overnight/)
RESULTS, ERRORS, INPUT = "results.jsonl", "errors.jsonl", "input.jsonl"


SECRET = "key.secret"


def new_id(prefix: str) -> str:
    return f"{prefix}{secrets.token_hex(12)}"


class Store:
    """Files and batches, by owner. Safe to share between the HTTP handlers and the runner."""

    def __init__(self, root: str | Path):
        self.root = Path(root)
        self._owner_lock = _lock(self.root)  # held while this object (the server) lives
        self.files_dir = self.root / "files"
        self.batches_dir = self.root / "batches"
        for folder in (self.files_dir, self.batches_dir):
            folder.mkdir(parents=True, exist_ok=True)
        self._db = sqlite3.connect(self.root / "state.sqlite3", check_same_thread=False,
                                   isolation_level=None)
        self._db.row_factory = sqlite3.Row
        self._lock = threading.RLock()
        with self._lock:
            self._db.execute("PRAGMA journal_mode=WAL")
            self._db.execute("PRAGMA synchronous=FULL")
            self._db.executescript(SCHEMA)
        self._secret = _secret(self.root / SECRET)

    # -- owners ------------------------------------------------------------------------------

    def owner_of(self, key: str) -> str:
        """What the store records for a key: its HMAC (the key itself is kept nowhere)."""
        return hmac.new(self._secret, key.encode(), hashlib.sha256).hexdigest()

    def adopt_keys(self, keys: list[str]) -> None:
        """Objects recorded under a key's unsalted SHA-256 (a store made before owners
        were HMACs) moved to its HMAC, for each key given."""
        with self._lock:
            for key in keys:
                old, new = hashlib.sha256(key.encode()).hexdigest(), self.owner_of(key)
                for table in ("files", "batches"):
                    self._db.execute(f"UPDATE {table} SET owner=? WHERE owner=?", (new, old))

    # -- files -------------------------------------------------------------------------------

    def file_path(self, file_id: str) -> Path:
        return self.files_dir / file_id

    def temp_path(self) -> Path:
        return self.files_dir / f".upload-{secrets.token_hex(8)}.tmp"

    def add_file(self, owner: str, source: Path, filename: str, purpose: str, *,
                 file_id: str | None = None, link: bool = False) -> dict:
        """``source`` (a file in the data directory) moved in as a new file object; or
        hard-linked (``link``), under a given id, once (a batch's results, registered again
        after a restart, stay one file)."""
        file_id = file_id or new_id("file-")
        obj = {"id": file_id, "object": "file", "bytes": source.stat().st_size,
               "created_at": int(time.time()), "filename": filename, "purpose": purpose,
               "status": "processed", "expires_at": None, "status_details": None}
        target = self.file_path(file_id)
        if not link:
            os.replace(source, target)
        elif not target.exists():
            os.link(source, target)
        with self._lock:
            self._db.execute("INSERT OR IGNORE INTO files (id, owner, purpose, object) "
                             "VALUES (?,?,?,?)", (file_id, owner, purpose, json.dumps(obj)))
        return obj

    def get_file(self, owner: str, file_id: str) -> dict | None:
        with self._lock:
            row = self._db.execute("SELECT object FROM files WHERE id=? AND owner=?",
                                   (file_id, owner)).fetchone()
        return json.loads(row["object"]) if row else None

    def list_files(self, owner: str, *, purpose: str | None, after: str | None, limit: int,
                   order: str) -> tuple[list[dict], bool]:
        where, args = "owner=?", [owner]
        if purpose:
            where, args = where + " AND purpose=?", [*args, purpose]
        return self._page("files", where, args, after, limit, order)

    def delete_file(self, owner: str, file_id: str) -> bool:
        """The file gone, with every copy of its data a batch made: a batch's output or
        error file takes its link in the batch's folder (an output file, the job's work
        directory too: its parts hold the same results, beside the prompts); an input file
        takes each finished batch's copy of it and its work directory (a batch still running
        keeps its copy until it ends: ``sweep``)."""
        with self._lock:
            gone = self._db.execute("DELETE FROM files WHERE id=? AND owner=?",
                                    (file_id, owner)).rowcount
        if not gone:
            return False
        self.file_path(file_id).unlink(missing_ok=True)
        for key, name in (("output_file_id", RESULTS), ("error_file_id", ERRORS)):
            for batch_id in self._batches_where(f"json_extract(object, '$.{key}')=?",
                                                (file_id,)):
                (self.batch_dir(batch_id) / name).unlink(missing_ok=True)
                if name == RESULTS:
                    _remove(self.batch_dir(batch_id) / f"{RESULTS}.overnight")
        self.sweep()
        return True

    def sweep(self, retention: float | None = None, now: float | None = None) -> list[str]:
        """Finished batches' data that nothing needs any more: the input copy and work
        directory of each whose input file was deleted; with ``retention`` (seconds), the
        whole folder and the output and error files of each that finished longer ago than
        that. Returns the ids of the batches whose folders were removed."""
        now = time.time() if now is None else now
        marks = ",".join("?" * len(TERMINAL))
        with self._lock:
            rows = self._db.execute(f"SELECT id, owner, object FROM batches WHERE status IN "
                                    f"({marks})", TERMINAL).fetchall()
            files = {row["id"] for row in self._db.execute("SELECT id FROM files")}
        removed = []
        for row in rows:
            batch, folder = json.loads(row["object"]), self.batch_dir(row["id"])
            if not folder.exists():
                continue
            ended = batch.get(f"{batch['status']}_at") or batch["created_at"]
            if retention is not None and ended < now - retention:
                for key in ("output_file_id", "error_file_id"):
                    if batch.get(key) in files:
                        self.delete_file(row["owner"], batch[key])
                _remove(folder)
                removed.append(row["id"])
            elif batch["input_file_id"] not in files:
                (folder / INPUT).unlink(missing_ok=True)
                _remove(folder / f"{RESULTS}.overnight")
        return removed

    def _batches_where(self, where: str, args: tuple) -> list[str]:
        with self._lock:
            return [row["id"] for row in self._db.execute(
                f"SELECT id FROM batches WHERE {where}", args).fetchall()]

    # -- batches -----------------------------------------------------------------------------

    def batch_dir(self, batch_id: str) -> Path:
        return self.batches_dir / batch_id

    def add_batch(self, owner: str, obj: dict) -> dict:
        with self._lock:
            self._db.execute("INSERT INTO batches (id, owner, status, object) VALUES (?,?,?,?)",
                             (obj["id"], owner, obj["status"], json.dumps(obj)))
        return obj

    def get_batch(self, owner: str | None, batch_id: str) -> dict | None:
        """A batch object; ``owner=None`` is the runner's view (any owner)."""
        with self._lock:
            if owner is None:
                row = self._db.execute("SELECT object FROM batches WHERE id=?",
                                       (batch_id,)).fetchone()
            else:
                row = self._db.execute("SELECT object FROM batches WHERE id=? AND owner=?",
                                       (batch_id, owner)).fetchone()
        return json.loads(row["object"]) if row else None

    def batch_owner(self, batch_id: str) -> str:
        with self._lock:
            return self._db.execute("SELECT owner FROM batches WHERE id=?",
                                    (batch_id,)).fetchone()["owner"]

    def list_batches(self, owner: str, *, after: str | None, limit: int,
                     before: str | None = None, api: str | None = None) -> tuple[list[dict], bool]:
        """A key's batches of one API (None: OpenAI's; "anthropic": message batches), newest
        first, after (older than) or before (newer than) a cursor."""
        where = "owner=? AND json_extract(object, '$.api') " + ("IS NULL" if api is None
                                                                 else "= ?")
        args = [owner] if api is None else [owner, api]
        if before:
            data, more = self._page("batches", where, args, before, limit, "asc")
            return data[::-1], more
        return self._page("batches", where, args, after, limit, "desc")

    def delete_batch(self, owner: str, batch_id: str) -> bool:
        """An ended batch gone, with its folder (its input, work directory and results)."""
        with self._lock:
            gone = self._db.execute("DELETE FROM batches WHERE id=? AND owner=?",
                                    (batch_id, owner)).rowcount
        if gone:
            _remove(self.batch_dir(batch_id))
        return bool(gone)

    def update_batch(self, batch_id: str, *, only_if: tuple[str, ...] = (), **changes) -> dict | None:
        """Apply ``changes`` to a batch object, atomically; with ``only_if``, only when its
        status is one of those (else None: someone else moved it first). A final status
        stays: a change that would move a batch out of one is refused the same way."""
        with self._lock:
            row = self._db.execute("SELECT object FROM batches WHERE id=?",
                                   (batch_id,)).fetchone()
            obj = json.loads(row["object"])
            if only_if and obj["status"] not in only_if:
                return None
            if obj["status"] in TERMINAL and changes.get("status") not in (None, obj["status"]):
                return None
            obj.update(changes)
            self._db.execute("UPDATE batches SET status=?, object=? WHERE id=?",
                             (obj["status"], json.dumps(obj), batch_id))
        return obj

    def batches_in(self, *statuses: str) -> list[str]:
        """Ids of the batches in these states, oldest first (the queue's order)."""
        marks = ",".join("?" * len(statuses))
        with self._lock:
            rows = self._db.execute(f"SELECT id FROM batches WHERE status IN ({marks}) "
                                    "ORDER BY seq", statuses).fetchall()
        return [row["id"] for row in rows]

    def metrics(self) -> dict:
        """The server's numbers for its metrics endpoint: batches by status (every owner's),
        the in_progress ones split into those queued (not started: no ``in_progress_at``)
        and those running, and their requests by state, summed (request_counts)."""
        with self._lock:
            rows = self._db.execute("SELECT status, object FROM batches").fetchall()
        statuses: dict[str, int] = {}
        queued = running = 0
        requests = {"completed": 0, "failed": 0, "total": 0}
        for row in rows:
            statuses[row["status"]] = statuses.get(row["status"], 0) + 1
            obj = json.loads(row["object"])
            if row["status"] == "in_progress":
                started = obj.get("in_progress_at") is not None
                queued, running = queued + (not started), running + started
            counts = obj.get("request_counts") or {}
            for key in requests:
                requests[key] += counts.get(key) or 0
        return {"batches": statuses, "queued": queued, "running": running,
                "requests": requests}

    def set_child(self, batch_id: str, pid: int | None) -> None:
        with self._lock:
            self._db.execute("UPDATE batches SET child_pid=? WHERE id=?", (pid, batch_id))

    def child_of(self, batch_id: str) -> int | None:
        with self._lock:
            return self._db.execute("SELECT child_pid FROM batches WHERE id=?",
                                    (batch_id,)).fetchone()["child_pid"]

    # -- pages -------------------------------------------------------------------------------

    def _page(self, table: str, where: str, args: list, after: str | None, limit: int,
              order: str) -> tuple[list[dict], bool]:
        """OpenAI's cursor pages: ``after`` is the last id of the previous page."""
        direction, compare = ("DESC", "<") if order == "desc" else ("ASC", ">")
        with self._lock:
            if after:
                row = self._db.execute(f"SELECT seq FROM {table} WHERE id=? AND {where}",
                                       [after, *args]).fetchone()
                if row is None:
                    return [], False
                where, args = f"{where} AND seq {compare} ?", [*args, row["seq"]]
            rows = self._db.execute(f"SELECT object FROM {table} WHERE {where} "
                                    f"ORDER BY seq {direction} LIMIT ?",
                                    [*args, limit + 1]).fetchall()
        objects = [json.loads(row["object"]) for row in rows]
        return objects[:limit], len(objects) > limit


def _secret(path: Path) -> bytes:
    """The store's HMAC key: read, or made once (readable by its owner only), written whole
    under a temporary name and linked in, so no server ever reads half of one."""
    if not path.exists():
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(4)}.tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as handle:
            handle.write(secrets.token_hex(32) + "\n")
            handle.flush()
            os.fsync(handle.fileno())
        try:
            os.link(tmp, path)  # never replaces a key already made
        except FileExistsError:
            pass
        tmp.unlink()
    return bytes.fromhex(path.read_text().strip())


def _remove(path: Path) -> None:
    if path.is_dir():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _lock(root: Path):
    """The data directory, locked for this process (``flock``, released by the kernel when
    the process dies, however it dies); a ConfigError if another server holds it."""
    root.mkdir(parents=True, exist_ok=True)
    handle = open(root / "serve.lock", "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        raise ConfigError(f"serve: --data-dir {root} is in use by another overnight serve "
                          f"(pid {holder}); stop it, or give another --data-dir") from None
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle
