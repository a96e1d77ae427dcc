"""Request keys: what determines a row's generation, in 32 hex digits a row.

A key hashes the job's settings that determine a generation (``key_parts``: model and its
files, engine, prompt, sampling, structured output, the output's columns) and the row's own
values its prompt reads (``key_columns``). Two rows with one key ask for the same generation: a
re-run with output.reuse carries the earlier one's over (pipelines/reuse/carry.py). The writers add
the key to every part they write (pipelines/write/writers.py).

The invariant (docs/contributing.md): two rows share a key only where the engine would get the
same request from both. polars' row hash alone does not keep it: it hashes a value's bits, not
its type (``True`` and 1, ``b"a"`` and ``"a"``, 0.10 at scale 2 and 1.0 at scale 1, an instant
in two time zones share a hash) and folds -0.0 into 0.0, which a template prints apart. So each
key column is first made canonical (``canonical``: a value that prints apart is another value)
and its type's name (``type_label``: the types that print apart) seeds the hash.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from udfs import columns

SCHEME = 2  # the key's own version: a change of how keys are made changes every key
# (2: the key columns' types in the seed, their values canonical: -0.0, decimals' scales)


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
    names = [*variables, *images, p.adapter_column, s.max_tokens_column, s.overrides_column,
             p.tools_column]
    if s.temperature > 0 or s.overrides_column is not None:
        names.append(config.input.id_column or columns.ORDINAL)
    return sorted({n for n in names if n is not None})


def step_key_columns(config, source: set[str]) -> list[list[str]]:
    """A job of steps: the source columns each step reads (its template's, or its messages
    column; its filter's; its images and adapter column). An earlier step's columns it reads
    are keyed by that step's own key, which the later step's includes."""
    import polars as pl

    from udfs.stages.templates import compile_template

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
    values, labels = {}, []
    for name in spec.columns:
        values[name], label = canonical_column(table.column(name))
        labels.append(label)
    high, low = _typed_seeds(spec.seeds, tuple(labels))
    try:
        frame = pl.from_arrow(pa.table(values), rechunk=False)
    except (Exception, pl.exceptions.PanicException):  # noqa: BLE001 - a type not foreseen
        frame = pl.from_arrow(pa.table({name: pa.chunked_array(
            [as_text(chunk) for chunk in column.chunks], pa.large_string())
            for name, column in values.items()}))
    return frame.hash_rows(high).to_numpy(), frame.hash_rows(low).to_numpy()


def _typed_seeds(seeds: tuple[int, int], labels: tuple[str, ...]) -> tuple[int, int]:
    """The job's seeds with the key columns' types in them: a column of another type (a
    decimal of another scale, a time zone, bool for int) makes other keys."""
    blob = json.dumps([list(seeds), list(labels)]).encode()
    digest = hashlib.blake2b(blob, digest_size=16).digest()
    return int.from_bytes(digest[:8], "big"), int.from_bytes(digest[8:], "big")


def canonical_column(column: pa.ChunkedArray | pa.Array) -> tuple[pa.ChunkedArray, str]:
    """A key column as values polars hashes apart exactly where a template prints them
    apart, and the name of its type (``type_label``), which seeds the hash."""
    chunks = column.chunks if isinstance(column, pa.ChunkedArray) else [column]
    if not chunks:
        chunks = [pa.array([], column.type)]
    try:
        out = [canonical(chunk) for chunk in chunks]
        if len({chunk.type for chunk in out}) > 1:
            raise ValueError("the chunks' canonical types differ")
    except (pa.ArrowException, ValueError):  # a layout these cannot rebuild: as text
        out = [as_text(chunk) for chunk in chunks]
    return pa.chunked_array(out, out[0].type), type_label(column.type)


_INT64_SAFE = (pa.types.is_signed_integer, lambda t: pa.types.is_unsigned_integer(t)
               and t.bit_width < 64)


def type_label(kind: pa.DataType) -> str:
    """A type's name as the key sees it: types whose values print alike share one (int32 and
    int64, string and large_string, list and large_list), any two that may print a value apart
    do not (a decimal's scale, a timestamp's unit and zone, bool, uint64, binary)."""
    if pa.types.is_dictionary(kind):
        return type_label(kind.value_type)
    if isinstance(kind, pa.ExtensionType):
        return f"extension[{kind.extension_name}]<{type_label(kind.storage_type)}>"
    if pa.types.is_boolean(kind) or pa.types.is_null(kind):
        return str(kind)
    if any(test(kind) for test in _INT64_SAFE):
        return "int"
    if pa.types.is_floating(kind):
        return "float"
    if pa.types.is_decimal(kind):
        return f"decimal[{kind.scale}]"
    if pa.types.is_string(kind) or pa.types.is_large_string(kind) or \
            pa.types.is_string_view(kind):
        return "string"
    if pa.types.is_binary(kind) or pa.types.is_large_binary(kind) or \
            pa.types.is_binary_view(kind) or pa.types.is_fixed_size_binary(kind):
        return "binary"
    if pa.types.is_list(kind) or pa.types.is_large_list(kind) or \
            pa.types.is_fixed_size_list(kind):
        return f"list<{type_label(kind.value_type)}>"
    if pa.types.is_map(kind):
        return f"map<{type_label(kind.key_type)},{type_label(kind.item_type)}>"
    if pa.types.is_struct(kind):
        return "struct<" + ",".join(json.dumps(kind.field(i).name) + ":" +
                                    type_label(kind.field(i).type)
                                    for i in range(kind.num_fields)) + ">"
    return str(kind)  # uint64, temporal types (unit, zone), anything else: as Arrow names it


def canonical(array: pa.Array) -> pa.Array:
    """One chunk of a key column in a form polars takes and hashes apart wherever a template
    would print apart (with ``type_label`` telling the types apart): ints as int64, floats as
    their float64 bits (-0.0 is not 0.0; every NaN one), decimals as their text (polars
    cannot read decimal256), times as their integers, lists, maps and structs by their
    parts; what else there is (unions, intervals...) as the text of each value. Raises
    ArrowException or ValueError on a layout it cannot rebuild (``canonical_column`` then
    takes the column as text)."""
    kind = array.type
    if pa.types.is_dictionary(kind):
        return canonical(array.dictionary_decode())
    if isinstance(kind, pa.ExtensionType):
        return canonical(array.storage)
    if pa.types.is_boolean(kind) or pa.types.is_null(kind) or pa.types.is_string(kind) or \
            pa.types.is_large_string(kind) or pa.types.is_binary(kind) or \
            pa.types.is_large_binary(kind) or kind == pa.uint64():
        return array
    if any(test(kind) for test in _INT64_SAFE):
        return array.cast(pa.int64())
    if pa.types.is_floating(kind):
        wide = array.cast(pa.float64())
        wide = pc.if_else(pc.is_nan(wide), pa.scalar(float("nan")), wide)
        return wide.view(pa.uint64())
    if pa.types.is_decimal(kind):
        return array.cast(pa.large_string())
    if pa.types.is_fixed_size_binary(kind) or pa.types.is_binary_view(kind) or \
            pa.types.is_string_view(kind):
        return array.cast(pa.large_binary() if not pa.types.is_string_view(kind)
                          else pa.large_string())
    if pa.types.is_temporal(kind) and kind.bit_width in (32, 64):
        return array.view(pa.int32() if kind.bit_width == 32 else pa.int64()).cast(pa.int64())
    if pa.types.is_fixed_size_list(kind):
        return canonical(array.cast(pa.list_(kind.value_field)))
    if pa.types.is_list(kind) or pa.types.is_large_list(kind):
        offsets, (values,) = _list_parts(array, array.values)
        return pa.LargeListArray.from_arrays(offsets, canonical(values), mask=array.is_null())
    if pa.types.is_map(kind):
        offsets, (keys, items) = _list_parts(array, array.keys, array.items)
        entries = pa.StructArray.from_arrays([canonical(keys), canonical(items)],
                                             names=["key", "value"])
        return pa.LargeListArray.from_arrays(offsets, entries, mask=array.is_null())
    if pa.types.is_struct(kind) and kind.num_fields and \
            len({kind.field(i).name for i in range(kind.num_fields)}) == kind.num_fields:
        # (flatten: a null struct's fields null too, whatever its slots held)
        return pa.StructArray.from_arrays(
            [canonical(child) for child in array.flatten()],
            names=[kind.field(i).name for i in range(kind.num_fields)], mask=array.is_null())
    return as_text(array)


def as_text(array: pa.Array) -> pa.Array:
    """Each value's Python text: a type the rest cannot take apart (unions, intervals...)."""
    return pa.array([None if v is None else repr(v) for v in array.to_pylist()],
                    pa.large_string())


def _list_parts(array: pa.Array, *children: pa.Array) -> tuple[pa.Array, list[pa.Array]]:
    """A list array's offsets from 0 and its children's values it holds (Arrow rebuilds a
    list with nulls only from offsets that start at 0: a sliced block's do not)."""
    offsets = array.offsets.cast(pa.int64())
    first, last = offsets[0].as_py(), offsets[-1].as_py()
    rebased = pc.subtract(offsets, pa.scalar(first, pa.int64()))
    return rebased, [child.slice(first, last - first) for child in children]


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
