"""Finding the input's files: a path, a folder or a glob, local or on an object store, and
the format each file is read in. Hidden files and folders (``_temporary``, ``.ipynb_checkpoints``)
are never part of a table.
"""

from __future__ import annotations

import glob
import json
import os
import re
from pathlib import PurePosixPath

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.errors import InputError, one_line
from pipelines.storage import Location, redact
from udfs import columns


FORMATS = {".parquet": "parquet", ".pq": "parquet", ".jsonl": "jsonl", ".ndjson": "jsonl",
           ".json": "jsonl"}


def resolve_files(path: str, fmt: str = "auto") -> tuple[list[Location], str]:
    """The input files a path names (a file, a directory or a glob; local or on an object
    store such as ``s3://``), sorted, and their format."""
    try:
        where = Location.of(path)
    except (OSError, ValueError) as exc:
        raise InputError(f"input.path {redact(path)!r}: {one_line(exc, None)}") from None
    shown = str(where)
    try:
        if any(ch in where.path for ch in "*?["):
            files = _glob(where)
            if not files:
                raise InputError(f"input.path {shown!r}: the glob matches no file")
        elif where.is_dir():
            files = [f for f in where.files() if _suffix(f) in FORMATS and _visible(f, where)]
            if not files:
                raise InputError(f"input.path {shown!r}: the directory holds no .parquet or "
                                 ".jsonl file")
        elif where.is_file():
            files = [where]
        else:
            raise InputError(f"input.path {shown!r}: no such file or directory")
    except OSError as exc:  # an object store refusing: credentials, bucket, network
        raise InputError(f"input.path {shown!r}: {one_line(exc, 300)}") from None

    if fmt == "auto":
        kinds = {FORMATS.get(_suffix(f)) for f in files}
        if None in kinds:
            odd = next(f for f in files if _suffix(f) not in FORMATS)
            raise InputError(f"{odd}: unknown format; name it .parquet or .jsonl, "
                             "or set input.format")
        if len(kinds) > 1:
            raise InputError(f"input.path {shown!r}: mixes Parquet and JSONL files")
        fmt = kinds.pop()
    return files, fmt


def _suffix(file: Location) -> str:
    return PurePosixPath(file.name).suffix.lower()


def _visible(file: Location, root: Location) -> bool:
    """Not hidden: no name below ``root`` starts with "." or "_" (``.ipynb_checkpoints/``,
    Spark's ``_temporary/`` and ``_SUCCESS``, editors' ``.~lock`` files)."""
    if root.local:
        below = os.path.relpath(file.path, root.path)
    else:
        below = file.path.removeprefix(root.path.rstrip("/")).strip("/")
    return not any(part.startswith((".", "_")) for part in below.split("/") if part != "..")


def _glob(where: Location) -> list[Location]:
    fixed = []  # the pattern's leading folders without a wildcard
    for segment in where.path.split("/"):
        if any(ch in segment for ch in "*?["):
            break
        fixed.append(segment)
    root = Location("/".join(fixed) or ".", where.fs, where.scheme)
    if where.local:
        found = [Location(p) for p in sorted(glob.glob(where.path, recursive=True))
                 if os.path.isfile(p)]
    else:  # object stores have no glob: list below the fixed prefix, then match
        pattern = glob_regex(where.path)
        found = [f for f in root.files() if pattern.fullmatch(f.path)]
    return [f for f in found if _visible(f, root)]


def glob_regex(pattern: str) -> re.Pattern:
    """A glob as the local filesystem's reads it: ``*``, ``?`` and ``[...]`` stay within one
    folder name; ``**/`` spans any number of folders."""
    out, i = [], 0
    while i < len(pattern):
        if pattern.startswith("**/", i):
            out.append("(?:[^/]*/)*")
            i += 3
        elif pattern.startswith("**", i):
            out.append(".*")
            i += 2
        elif pattern[i] == "*":
            out.append("[^/]*")
            i += 1
        elif pattern[i] == "?":
            out.append("[^/]")
            i += 1
        elif pattern[i] == "[" and "]" in pattern[i + 2:]:
            end = pattern.index("]", i + 2)
            body = pattern[i + 1:end]
            out.append("[" + ("^" + body[1:] if body.startswith("!") else body) + "]")
            i = end + 1
        else:
            out.append(re.escape(pattern[i]))
            i += 1
    return re.compile("".join(out))


def parquet_file(file: Location) -> pq.ParquetFile:
    """A local file by path (Arrow opens and closes it), a remote one through its filesystem.
    A local file is read through a small buffer, a page at a time: read whole (pre-buffered),
    the first rows of a row group held all the group's column chunks; an object
    store's reads are coalesced as Arrow does by default."""
    if file.local:
        return pq.ParquetFile(file.path, pre_buffer=False, buffer_size=1 << 20)
    return pq.ParquetFile(file.open())


def earlier_job(files: list[Location]) -> dict | None:
    """What an input written by overnight says of the job that wrote it (the metadata of its
    first file: columns.JOB_METADATA), or None."""
    if not files or _suffix(files[0]) != ".parquet":
        return None
    try:
        found = (parquet_file(files[0]).schema_arrow.metadata or {}).get(columns.JOB_METADATA)
        return json.loads(found) if found else None
    except (OSError, ValueError, pa.ArrowException):  # the scan says what is wrong with it
        return None
