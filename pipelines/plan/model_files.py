"""The files behind a job's model and LoRA adapters, as the fingerprint holds them.

A model retrained, or its chat template edited, at the same path is another job: its rows ask
the engine for other generations, so a resume must not mix them and a re-run must not carry
them over (pipelines/plan/fingerprint.py: ``fingerprint``; pipelines/reuse/request_key.py
keys rows by it). A directory is named by its files: the content of each small one (config.json,
generation_config.json, tokenizer*, chat_template*, *.jinja: what renders and decodes), and the
name, size and modification time of each weight file, whose gigabytes would take minutes a
night to hash (a copy that does not keep the times, ``cp`` without ``-p``, is a change then).
An adapter's weights are small: their content is hashed. A Hugging Face name is its commit in
the local cache (the files there are named by their content).

A directory of up to MAX_LISTED files is held file by file ({name: content digest, or [size,
mtime_ns]}), so a refused resume or reuse can say which file changed (``files_changed``); a
larger one by one digest of them all.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

# Weights: named by (name, size, mtime_ns), never read
WEIGHT_SUFFIXES = (".safetensors", ".bin", ".pt", ".pth", ".gguf", ".ckpt", ".h5", ".msgpack",
                   ".onnx", ".npz", ".pkl")
CONTENT_BYTES = 64 << 20  # a file above this is named by its size and time too
ADAPTER_CONTENT_BYTES = 1 << 30  # an adapter's weights up to this are hashed
MAX_LISTED = 256  # a directory of more files is named by one digest
SHOWN = 3  # files a message names
# engine.args naming files the engine reads beside the model's
PATH_ARGS = ("tokenizer", "hf_config_path")


def folder_fingerprint(root: Path, weights_content: bool = False,
                       content_bytes: int = CONTENT_BYTES) -> dict | str:
    """A directory's files (hidden ones aside: ``.cache``, ``.git``), each small file by its
    content (32 hex digits), each weight file (unless ``weights_content``) and each large one
    by its size and modification time ([size, mtime_ns]): {name: that}; a directory of more
    than MAX_LISTED files, 32 hex digits naming them all."""
    files = {}
    for path in _files(root):
        stat = path.stat()
        name = path.relative_to(root).as_posix()
        weights = path.suffix in WEIGHT_SUFFIXES and not weights_content
        if weights or stat.st_size > content_bytes:
            files[name] = [stat.st_size, stat.st_mtime_ns]
            continue
        digest = hashlib.blake2b(digest_size=16)
        digest.update(str(stat.st_size).encode())
        with path.open("rb") as handle:
            for chunk in iter(lambda: handle.read(1 << 20), b""):
                digest.update(chunk)
        files[name] = digest.hexdigest()
    if len(files) <= MAX_LISTED:
        return files
    return hashlib.blake2b(json.dumps(files, sort_keys=True).encode(),
                           digest_size=16).hexdigest()


def _files(root: Path) -> list[Path]:
    """Every file under ``root`` (following links: a Hugging Face snapshot's are), sorted;
    hidden files and folders left out."""
    found = []
    for folder, dirs, names in os.walk(root, followlinks=True):
        dirs[:] = sorted(d for d in dirs if not d.startswith("."))
        found += [Path(folder) / n for n in names if not n.startswith(".")]
    return sorted(p for p in found if p.is_file())


def model_fingerprint(name: str, engine_args: dict | None = None) -> dict | None:
    """What the fingerprint holds of the model's files, and of a tokenizer or config engine.args
    names apart: a local directory's ``folder_fingerprint``, a local file's size and time, a
    Hugging Face name's cached commit ({"revision": None} where it is not cached here: the
    engine would fetch whatever the hub has)."""
    args = engine_args or {}
    out = {"model": _path_fingerprint(name, args.get("revision"))}
    for key in PATH_ARGS:
        value = args.get(key)
        if isinstance(value, str) and value and value != name:
            out[key] = _path_fingerprint(value, args.get(f"{key}_revision"))
    return out


def _path_fingerprint(name: str, revision: str | None = None) -> dict:
    path = Path(name).expanduser()
    if path.is_dir():
        return {"files": folder_fingerprint(path)}
    if path.is_file():  # a GGUF file, say
        stat = path.stat()
        return {"file": [stat.st_size, stat.st_mtime_ns]}
    return {"revision": hub_revision(name, revision)}


def hub_revision(name: str, revision: str | None = None) -> str | None:
    """The commit of a Hugging Face model in the local cache (its config.json's snapshot
    folder), or None where it is not cached."""
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "config.json", revision=revision)
    except Exception:  # noqa: BLE001 - not a repo name, no huggingface_hub: nothing cached
        return None
    if not isinstance(found, str):
        return None
    return Path(found).parent.name  # .../snapshots/<commit>/config.json


def adapter_fingerprint(path: str) -> dict:
    """An adapter's files, its weights by their content (adapters are small; one above
    ADAPTER_CONTENT_BYTES by its size and time)."""
    root = Path(path).expanduser()
    if not root.is_dir():
        return {"files": None}
    return {"files": folder_fingerprint(root, weights_content=True,
                                        content_bytes=ADAPTER_CONTENT_BYTES)}


def files_changed(old, new) -> str:
    """What differs between two of ``model_fingerprint``'s answers, in a few words:
    ``model.safetensors (modification time)``, ``chat_template.jinja (content)``,
    ``tokenizer: tokenizer.json (content)``, ``the cached commit (...)``."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return "the files"
    out = []
    for key in sorted(set(old) | set(new)):
        a, b = old.get(key), new.get(key)
        if a == b:
            continue
        said = _path_changed(a, b)
        out.append(said if key == "model" else f"{key}: {said}")
    return "; ".join(out) or "the files"


def adapters_changed(old, new) -> str:
    """What differs between two of pipelines/plan/adapters.py's ``adapters_fingerprint``: each
    adapter that changed, and how (``de: adapter_model.safetensors (content)``)."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return "added" if not old else "removed" if not new else "the adapters"
    out = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name, "absent"), new.get(name, "absent")
        if a == b:
            continue
        if "absent" in (a, b):
            out.append(f"{name} ({'added' if a == 'absent' else 'removed'})")
        elif a is None or b is None:  # (None: the server's adapter, by its name)
            out.append(f"{name} ({'a local folder' if a is None else 'served by its server'} now)")
        else:
            out.append(f"{name}: {_path_changed(a, b)}")
    return "; ".join(out) or "the adapters"


def _path_changed(old, new) -> str:
    """One path's change (``_path_fingerprint``'s answers, or None where it was not named)."""
    if old is None or new is None:
        return "named" if old is None else "no longer named"
    if isinstance(old, dict) and isinstance(new, dict) and set(old) == set(new) == {"files"}:
        return _listing_changed(old["files"], new["files"])
    if isinstance(old, dict) and isinstance(new, dict) and set(old) == set(new) == {"file"}:
        return f"the file ({_stat_changed(old['file'], new['file'])})"
    if isinstance(old, dict) and isinstance(new, dict) and \
            set(old) == set(new) == {"revision"}:
        return (f"the cached commit ({str(old['revision'])[:12]} -> "
                f"{str(new['revision'])[:12]})")
    return "its files"  # (a folder now a file, say, or a record's older form)


def _stat_changed(old: list, new: list) -> str:
    """[size, mtime_ns] against [size, mtime_ns]: which of them changed."""
    return "size" if old[:1] != new[:1] else "modification time"


def _listing_changed(old, new) -> str:
    """The files that differ between two of ``folder_fingerprint``'s answers."""
    if not (isinstance(old, dict) and isinstance(new, dict)):
        return "its files"  # (more than MAX_LISTED, or a record's older form)
    said = []
    for name in sorted(set(old) | set(new)):
        a, b = old.get(name), new.get(name)
        if a == b:
            continue
        if a is None or b is None:
            said.append(f"{name} ({'added' if a is None else 'removed'})")
        elif isinstance(a, list) and isinstance(b, list):
            said.append(f"{name} ({_stat_changed(a, b)})")
        else:
            said.append(f"{name} (content)")
    more = len(said) - SHOWN
    return ", ".join(said[:SHOWN]) + (f" and {more} more" if more > 0 else "")
