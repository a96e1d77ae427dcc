"""Request keys: what determines a row's generation, in 32 hex digits a row.

A key hashes the job's settings that determine a generation (``key_parts``: model, engine,
prompt, sampling, structured output, the output's columns) and the row's own values its prompt
reads (``key_columns``). Two rows with one key ask for the same generation: a re-run with
output.reuse carries the earlier one's over (pipelines/reuse.py). The writers add the key to
every part they write (pipelines/write/writers.py).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from udfs import columns

SCHEME = 1  # the key's own version: a change of how keys are made changes every key


@dataclass(frozen=True)
class KeySpec:
    """How a job makes its rows' request keys; small and picklable (each writer has it)."""

    parts: str  # JSON: the job's settings that determine a generation (key_parts)
    columns: tuple[str, ...]  # the row's values in its key (ORDINAL: a seed by position)
    seeds: tuple[int, int] = (0, 0)
    # a job of steps: the row's values each step reads (its key's columns are theirs, and the
    # seed's key); a run whose earlier steps are unchanged keys them by its first steps alone
    step_columns: tuple[tuple[str, ...], ...] = ()

    @classmethod
    def of(cls, parts: dict, key_columns: list[str],
           step_columns: list[list[str]] | None = None) -> KeySpec:
        blob = json.dumps(parts, sort_keys=True, default=str)
        digest = hashlib.blake2b(blob.encode(), digest_size=16).digest()
        return cls(blob, tuple(key_columns),
                   (int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:], "big")),
                   tuple(tuple(c) for c in step_columns or ()))

    def first_steps(self, k: int) -> KeySpec:
        """A job of steps: the key of a row's first ``k`` steps, what they generate (their
        settings, the row's values they read): equal in two jobs whose first ``k`` steps are
        the same, whatever their later steps."""
        parts = json.loads(self.parts)
        parts["steps"] = parts["steps"][:k]
        every = {c for step in self.step_columns for c in step}
        own = {c for step in self.step_columns[:k] for c in step}
        return KeySpec.of(parts, sorted(own | (set(self.columns) - every)),
                          [list(c) for c in self.step_columns[:k]])


def key_parts(fingerprint: dict) -> dict:
    """The job's settings that determine each row's generation: the fingerprint without what
    says where or how fast (the input's files, batch size, resources, the output's path and
    file size: already out of it) and with the hashing's own version."""
    import polars

    parts = {k: v for k, v in fingerprint.items()
             if k not in ("input files", "input", "resources.batch_size")}
    parts["output"] = {k: v for k, v in (parts.get("output") or {}).items()
                       if k not in ("reuse", "reuse_from")}
    # polars' row hash is stable within a version only: another version, other keys
    parts["request key"] = {"scheme": SCHEME, "polars": polars.__version__}
    return parts


def key_columns(config, variables: list[str], step_columns: list[list[str]] = ()) -> list[str]:
    """The row's values a generation reads: the prompt's columns, the per-row settings, and
    the seed's key when a row may be sampled (a greedy row needs no seed). A job of steps:
    each step's (``step_columns``, from ``step_key_columns``) and the seed's key."""
    if config.steps is not None:
        sampled = any(step.sampling.temperature > 0 for step in config.steps
                      if step.prompt is not None)
        names = [c for step in step_columns for c in step]
        return sorted({*names, *[config.input.id_column or columns.ORDINAL] * sampled})
    s, p = config.sampling, config.prompt
    # a prompt's images by their values (bytes, or a path: an image changed in place under
    # the same path is not seen)
    images = [name for prompt in config.prompts() for name in prompt.images or ()]
    names = [*variables, *images, p.adapter_column, s.max_tokens_column, s.overrides_column]
    if s.temperature > 0 or s.overrides_column is not None:
        names.append(config.input.id_column or columns.ORDINAL)
    return sorted({n for n in names if n is not None})


def step_key_columns(config, source: set[str]) -> list[list[str]]:
    """A job of steps: the source columns each step reads (its template's, or its messages
    column; its filter's; its images and adapter column). An earlier step's columns it reads
    are keyed by that step's own key, which the later step's includes."""
    import polars as pl

    from udfs.prompts import compile_template

    out = []
    for step in config.steps:
        names = []
        if step.where is not None:
            names += pl.sql_expr(step.where).meta.root_names()
        p = step.prompt
        if p is not None:
            names += ([p.messages_column] if p.messages_column is not None
                      else compile_template(p.template)[1])
            names += [*(p.images or ()), p.adapter_column]
        out.append(sorted({n for n in names if n in source}))
    return out


def request_keys(table: pa.Table, spec: KeySpec) -> pa.Array:
    """Each row's request key, vectorized: two 64-bit row hashes (polars), seeded by the job's
    settings, as 32 hex digits."""
    return _hex(*request_words(table, spec))


def request_words(table: pa.Table, spec: KeySpec) -> tuple[np.ndarray, np.ndarray]:
    """Each row's request key as its two 64-bit words (high, low): what a lookup joins on."""
    import polars as pl

    if not spec.columns:  # a prompt that reads nothing of its row: every row the same request
        rows = table.num_rows
        return (np.full(rows, spec.seeds[0], np.uint64), np.full(rows, spec.seeds[1], np.uint64))
    frame = pl.from_arrow(table.select(list(spec.columns)), rechunk=False)
    return (frame.hash_rows(spec.seeds[0]).to_numpy(), frame.hash_rows(spec.seeds[1]).to_numpy())


_HEX = np.frombuffer(b"".join(b"%02x" % i for i in range(256)), np.uint8).reshape(256, 2)
_NIBBLE = np.zeros(256, np.uint8)
_NIBBLE[np.frombuffer(b"0123456789abcdef", np.uint8)] = np.arange(16, dtype=np.uint8)


def _hex(high: np.ndarray, low: np.ndarray) -> pa.Array:
    raw = np.empty((len(high), 2), ">u8")
    raw[:, 0], raw[:, 1] = high, low
    digits = _HEX[raw.view(np.uint8).reshape(len(high), 16)].reshape(len(high), 32)
    return pa.array(np.ascontiguousarray(digits).view("S32").ravel()).cast(pa.string())


def key_words(keys: pa.Array | pa.ChunkedArray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """(high, low, valid) of a key column; a value that is no key (null, another length) is
    not valid, and never matches."""
    keys = keys.combine_chunks() if isinstance(keys, pa.ChunkedArray) else keys
    keys = keys.cast(pa.string())
    n = len(keys)
    valid = pc.fill_null(pc.equal(pc.utf8_length(keys), 32), False).to_numpy(
        zero_copy_only=False)
    text = pc.if_else(pa.array(valid), keys, pa.scalar("0" * 32)).combine_chunks() \
        if not valid.all() else keys
    offsets = np.frombuffer(text.buffers()[1], np.int32)[text.offset:text.offset + n + 1]
    data = np.frombuffer(text.buffers()[2], np.uint8)[offsets[0]:offsets[0] + 32 * n]
    nibbles = _NIBBLE[data.reshape(n, 32)]
    raw = np.ascontiguousarray((nibbles[:, 0::2] << 4) | nibbles[:, 1::2])
    words = raw.view(">u8").reshape(n, 2).astype(np.uint64)
    return words[:, 0], words[:, 1], valid
