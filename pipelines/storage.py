"""Where files live: a local path, or an object store (``s3://``, ``gs://``, any pyarrow or
fsspec filesystem), behind the few operations the job needs.

A ``Location`` is picklable (it travels to the writer actor and the read tasks) and is shown as
the user wrote it, less any credentials. Local paths keep the strongest guarantees (write to a
temporary name, fsync, rename); on an object store every file is one upload, which appears
whole or not at all, and there is no rename: see ``OutputStore.commit`` for what that means for
the output directory.

    s3://bucket/prefix/in.parquet
    s3://bucket/out?endpoint_override=127.0.0.1:9000&scheme=http   # MinIO and the like
    gs://bucket/out
"""

from __future__ import annotations

import fcntl
import fnmatch
import io
import os
import shutil
import tempfile
import uuid
from dataclasses import dataclass
from pathlib import Path

import pyarrow.fs as pafs

from pipelines.errors import one_line
from udfs.redact import redact, scrub, scrub_record  # noqa: F401  (re-exported)


@dataclass(frozen=True)
class Location:
    """A path on a filesystem. ``fs`` is None for the local filesystem."""

    path: str
    fs: pafs.FileSystem | None = None
    scheme: str = ""  # "s3://" and so on; shown before the path

    @classmethod
    def of(cls, where: str | Path | Location) -> Location:
        if isinstance(where, Location):
            return where
        text = str(where)
        if "://" not in text or text.startswith("file://"):
            return cls(text.removeprefix("file://"))
        scheme = text.split("://", 1)[0] + "://"
        try:
            fs, path = pafs.FileSystem.from_uri(text)
        except Exception:  # noqa: BLE001 - not one of pyarrow's own: try fsspec's
            fs, path = _fsspec(text)
        return cls(path.rstrip("/"), fs, scheme)

    @property
    def local(self) -> bool:
        return self.fs is None

    def __str__(self) -> str:
        # fsspec's http(s) paths are whole URLs, credentials and all
        return redact(self.path if "://" in self.path else self.scheme + self.path)

    def __truediv__(self, name: str) -> Location:
        return Location(f"{self.path.rstrip('/')}/{name}", self.fs, self.scheme)

    @property
    def name(self) -> str:
        return self.path.rstrip("/").rsplit("/", 1)[-1]

    @property
    def parent(self) -> Location:
        head, sep, _ = self.path.rstrip("/").rpartition("/")
        return Location((head or "/") if sep else ".", self.fs, self.scheme)

    def sibling(self, suffix: str) -> Location:
        """``OUTPUT`` -> ``OUTPUT<suffix>``, beside it."""
        return Location(self.path.rstrip("/") + suffix, self.fs, self.scheme)

    def with_name(self, name: str) -> Location:
        return self.parent / name

    # -- what is there
    def _info(self) -> pafs.FileInfo:
        return self.fs.get_file_info(self.path)

    def exists(self) -> bool:
        if self.local:
            return os.path.exists(self.path)
        return self._info().type != pafs.FileType.NotFound

    def is_dir(self) -> bool:
        if self.local:
            return os.path.isdir(self.path)
        return self._info().type == pafs.FileType.Directory

    def is_file(self) -> bool:
        if self.local:
            return os.path.isfile(self.path)
        return self._info().type == pafs.FileType.File

    def stat(self) -> tuple[int, int]:
        """(size in bytes, modification time in ns)."""
        if self.local:
            st = os.stat(self.path)
            return st.st_size, st.st_mtime_ns
        info = self._info()
        return info.size, info.mtime_ns or 0

    def names(self) -> list[str]:
        """The names directly inside this directory, sorted (empty if it does not exist)."""
        if self.local:
            return sorted(os.listdir(self.path)) if os.path.isdir(self.path) else []
        found = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return sorted(i.base_name for i in found)

    def sizes(self) -> dict[str, int]:
        """Each file directly inside this directory: its size in bytes, from one listing
        (an object store answers it in one call, not one per file)."""
        if self.local:
            # a snapshot of a directory others write to: a writer renames its .tmp file to
            # the part's name, or compaction removes a part, between the listing and the
            # stat; what is gone by then is left out, as a listing a moment later would
            sizes = {}
            try:
                with os.scandir(self.path) as entries:
                    for entry in entries:
                        try:
                            if entry.is_file():
                                sizes[entry.name] = entry.stat().st_size
                        except FileNotFoundError:
                            continue
            except FileNotFoundError:  # the directory itself (committed: renamed away)
                return {}
            return sizes
        found = self.fs.get_file_info(pafs.FileSelector(self.path, allow_not_found=True))
        return {i.base_name: i.size for i in found if i.type == pafs.FileType.File}

    def files(self, pattern: str | None = None) -> list[Location]:
        """Every file under this directory (recursively), sorted; with ``pattern`` (a glob
        over the path below this directory), only those it matches."""
        if self.local:
            found = (str(p) for p in Path(self.path).rglob("*") if p.is_file())
        else:
            selector = pafs.FileSelector(self.path, recursive=True, allow_not_found=True)
            found = (i.path for i in self.fs.get_file_info(selector)
                     if i.type == pafs.FileType.File)
        return [Location(p, self.fs, self.scheme) for p in sorted(found)
                if pattern is None or fnmatch.fnmatchcase(p, pattern)]

    # -- reading
    def open(self):
        """A binary file for reading (seekable)."""
        if self.local:
            return open(self.path, "rb")
        return io.BufferedReader(self.fs.open_input_file(self.path), buffer_size=1 << 20)

    def read_text(self) -> str:
        with self.open() as handle:
            return handle.read().decode("utf-8")

    # -- writing
    def mkdir(self) -> None:
        if self.local:
            os.makedirs(self.path, exist_ok=True)
        else:
            self.fs.create_dir(self.path, recursive=True)

    def write(self, write) -> None:
        """Call ``write(tmp_path)`` with a local temporary file, then put it here whole: on a
        local disk by fsync and rename, on an object store as one upload."""
        if self.local:
            _write_local(Path(self.path), write)
            return
        with tempfile.TemporaryDirectory(prefix="overnight-") as tmp:
            staged = Path(tmp) / self.name
            write(staged)
            pafs.copy_files(str(staged), self.path, destination_filesystem=self.fs)

    def write_text(self, text: str) -> None:
        self.write(lambda tmp: tmp.write_text(text, encoding="utf-8"))

    def copy_to(self, dest: Location) -> None:
        """A file, copied (hard-linked on a local disk: the parts are never modified)."""
        if self.local:
            os.link(self.path, dest.path)
        else:
            self.fs.copy_file(self.path, dest.path)

    def remove(self) -> None:
        """This file or directory, and everything under it; nothing if it is not there."""
        if self.local:
            if os.path.isdir(self.path):
                shutil.rmtree(self.path)
            elif os.path.lexists(self.path):
                os.unlink(self.path)
        elif self.is_dir():
            self.fs.delete_dir(self.path)
        elif self.exists():
            self.fs.delete_file(self.path)

    def rename_to(self, dest: Location) -> None:
        """Local only: an atomic rename."""
        assert self.local and dest.local
        os.rename(self.path, dest.path)


def hold_lock(path: str | Path):
    """An exclusive ``flock`` on the file at ``path`` (made, with its folder, if missing),
    held while the handle returned is open and released by the kernel however the process
    ends; None and the holder's pid (as it wrote it) when another process holds it."""
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    handle = open(path, "a+", encoding="utf-8")
    try:
        fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BlockingIOError:
        handle.seek(0)
        holder = handle.read().strip() or "unknown"
        handle.close()
        return None, holder
    handle.truncate(0)
    handle.write(f"{os.getpid()}\n")
    handle.flush()
    return handle, None


def _write_local(path: Path, write) -> None:
    tmp = path.with_name(f".{path.name}.{uuid.uuid4().hex[:8]}.tmp")
    try:
        write(tmp)
        fd = os.open(tmp, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    finally:
        if tmp.exists():
            tmp.unlink()


def _fsspec(uri: str) -> tuple[pafs.FileSystem, str]:
    try:
        import fsspec
    except ImportError:  # pragma: no cover - fsspec comes with ray[data]
        raise ValueError(f"{redact(uri)}: unknown filesystem") from None
    try:
        fs, path = fsspec.core.url_to_fs(uri)
    except (ImportError, ValueError) as exc:
        raise ValueError(f"{redact(uri)}: {one_line(exc, None)}") from None
    return pafs.PyFileSystem(pafs.FSSpecHandler(fs)), path
