"""Images in a prompt: where a row's images come from, and each one loaded and checked.

A row's image (a ``prompt.images`` column's value, or a chat message's ``image_url`` part) is
one of: bytes (a Parquet binary column), a ``{bytes, path}`` struct (the shape Hugging Face
``datasets`` and Daft write), a path (local or an object store's, relative to the table's
folder), a ``data:`` URL, an http(s) URL (fetched only where ``ImageSpec.fetch_urls`` allows),
or a list of these: several images in one prompt.

The renderer only says which images a prompt holds (``sources``: cheap, no decoding); they are
loaded and decoded where the engine takes them (``load``), a request at a time, so a job never
holds more decoded images than the requests the engine is running. A bad image raises
``ImageError``, one line: that row's ``image_error``, never the job's.
"""

from __future__ import annotations

import base64
import binascii
import io
import os
from dataclasses import dataclass
from urllib.parse import unquote_to_bytes

# An image's source as the prompt carries it between stages: the bytes, or where to find them
SOURCE_FIELDS = ("bytes", "path")
DEFAULT_MAX_PIXELS = 50_000_000


class ImageError(ValueError):
    """One image of a row cannot be used: the row's ``image_error``, in one line."""


@dataclass(frozen=True)
class ImageSpec:
    """How a job's images are found and checked; small and picklable."""

    columns: tuple[str, ...] = ()  # prompt.images: the columns holding each row's images
    root: str | None = None  # the table's folder: relative paths are read from there
    max_pixels: int = DEFAULT_MAX_PIXELS  # a decompression bomb's cap, width x height
    fetch_urls: bool = False  # http(s) URLs: fetched, or the row's error
    fetch_timeout_s: float = 30.0


def sources(value) -> list[dict]:
    """A column's value in one row as its image sources, ``{bytes, path}`` each (one of the
    two set), in order; a null (or an empty list) is none. ValueError: not an image's shape."""
    if value is None:
        return []
    if isinstance(value, (list, tuple)):
        return [one for item in value for one in _source(item)]
    return _source(value)


def _source(value) -> list[dict]:
    if value is None:
        raise ValueError("a null in the list of images")
    if isinstance(value, (bytes, bytearray, memoryview)):
        return [{"bytes": bytes(value), "path": None}]
    if isinstance(value, str):
        if not value.strip():
            raise ValueError("an empty string where an image's path or URL should be")
        return [{"bytes": None, "path": value}]
    if isinstance(value, dict):
        data, path = value.get("bytes"), value.get("path")
        if data is not None:
            return [{"bytes": bytes(data), "path": None}]
        if isinstance(path, str) and path:
            return [{"bytes": None, "path": path}]
        raise ValueError("a {bytes, path} image with neither set")
    raise ValueError(f"a {type(value).__name__} is not an image (bytes, a path, a data: URL, "
                     "or a list of them)")


def describe(source: dict) -> str:
    """A source named for an error line: its path or URL (cut), or its size."""
    path = source.get("path")
    if path is None:
        return f"{len(source.get('bytes') or b''):,} bytes"
    return (path[:40] + "...") if path.startswith("data:") else path[:200]


def read_bytes(source: dict, spec: ImageSpec) -> bytes:
    """The encoded image a source names: its bytes, a data: URL's, a file's or a URL's."""
    if source.get("bytes") is not None:
        return source["bytes"]
    path = source["path"]
    if path.startswith("data:"):
        return _data_url(path)
    if path.startswith(("http://", "https://")):
        if not spec.fetch_urls:
            raise ImageError(f"{path[:200]}: http(s) images are not fetched unless the job "
                             "allows it (prompt.fetch_image_urls: true)")
        return _fetch(path, spec.fetch_timeout_s)
    return _read_file(path, spec.root)


def load(source: dict, spec: ImageSpec):
    """One source as a decoded ``PIL.Image``; ImageError in one line if it cannot be used."""
    from PIL import Image, UnidentifiedImageError

    data = read_bytes(source, spec)
    name = describe(source)
    try:
        image = Image.open(io.BytesIO(data))
    except UnidentifiedImageError:
        raise ImageError(f"{name}: not an image (no format PIL reads)") from None
    except Image.DecompressionBombError as exc:
        raise ImageError(f"{name}: a decompression bomb: {exc}"[:300]) from None
    except Exception as exc:  # noqa: BLE001 - a header PIL cannot parse
        raise ImageError(f"{name}: a truncated or corrupt image: {_line(exc)}") from None
    width, height = image.size
    if width * height > spec.max_pixels:
        raise ImageError(f"{name}: {width}x{height} is {width * height:,} pixels, over the "
                         f"cap of {spec.max_pixels:,} (prompt.max_image_pixels), as a "
                         "decompression bomb would be")
    try:
        image.load()
    except Exception as exc:  # noqa: BLE001 - truncated or corrupt data
        raise ImageError(f"{name}: a truncated or corrupt {image.format or ''} image: "
                         f"{_line(exc)}".replace("  ", " ")) from None
    # as opened: vLLM itself turns it to RGB (EXIF rotation, transparency laid on white), as
    # it does an image it loads from a data: URL, so both reach the model alike
    return image


def mime_type(data: bytes) -> str:
    """An encoded image's MIME type, for a ``data:`` URL sent to a server."""
    from PIL import Image

    with Image.open(io.BytesIO(data)) as image:
        return Image.MIME.get(image.format or "", "application/octet-stream")


def data_url(source: dict, spec: ImageSpec) -> str:
    """A source as a ``data:`` URL (its bytes as they are), checked first as ``load`` checks
    it: what an HTTP engine sends a server."""
    data = read_bytes(source, spec)
    load({"bytes": data, "path": None}, spec)  # a bad image is the row's error, not the server's
    return f"data:{mime_type(data)};base64,{base64.b64encode(data).decode()}"


def _data_url(url: str) -> bytes:
    head, sep, body = url.partition(",")
    if not sep:
        raise ImageError(f"{url[:40]}...: a data: URL without a comma")
    try:
        if head.endswith(";base64"):
            return base64.b64decode(body, validate=False)
        return unquote_to_bytes(body)
    except (binascii.Error, ValueError) as exc:
        raise ImageError(f"{url[:40]}...: a data: URL whose base64 does not decode: "
                         f"{exc}") from None


def _read_file(path: str, root: str | None) -> bytes:
    if "://" in path:  # an object store's (s3://, gs://...): read through pyarrow
        return _read_uri(path)
    full = path if os.path.isabs(path) or root is None else (
        f"{root.rstrip('/')}/{path}" if "://" in root else os.path.join(root, path))
    if "://" in full:
        return _read_uri(full)
    try:
        with open(full, "rb") as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError(f"{path}: no such file" + (f" (in {root})" if root and
                                                    not os.path.isabs(path) else "")) from None
    except IsADirectoryError:
        raise ImageError(f"{path}: a directory, not an image file") from None
    except OSError as exc:
        raise ImageError(f"{path}: cannot be read: {exc.strerror or exc}") from None


def _read_uri(uri: str) -> bytes:
    import pyarrow.fs as pafs

    try:
        fs, where = pafs.FileSystem.from_uri(uri)
        with fs.open_input_stream(where) as f:
            return f.read()
    except FileNotFoundError:
        raise ImageError(f"{uri}: no such file") from None
    except Exception as exc:  # noqa: BLE001 - the store's own errors (access, network)
        raise ImageError(f"{uri}: cannot be read: {_line(exc)}") from None


def _fetch(url: str, timeout: float) -> bytes:
    import httpx

    try:
        response = httpx.get(url, timeout=timeout, follow_redirects=True)
        response.raise_for_status()
    except httpx.HTTPError as exc:
        raise ImageError(f"{url[:200]}: cannot be fetched: {_line(exc)}") from None
    return response.content


def _line(exc: BaseException) -> str:
    return " ".join(str(exc).split())[:200] or type(exc).__name__
