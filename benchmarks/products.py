"""A product table of any size, generated (never shipped), for the benchmarks that need one.

    from benchmarks.products import make_products, PROMPT
    files = make_products(Path("/tmp/products-1m"), rows=1_000_000, files=4, row_group=1_000_000)

Columns: ``sku`` (unique, "SKU-000000000" in input order), ``title`` (2-3 words), ``description``
(30-40 words) and ``price``. The words mix ones the tiny model's tokenizer holds whole with
longer ones it splits, so that a row renders with ``PROMPT`` to ~170 prompt tokens (the shape of
issue #24's table: 172 a row). Generated with numpy and Arrow compute, one row group at a time:
10M rows in about a minute, never more than one row group in memory.
"""

from __future__ import annotations

import json
from pathlib import Path

# One token each with the tiny model's tokenizer (its training words)...
SHORT = ("soft bright warm cool steel wood cotton wool glass leather red blue green black white "
         "small large light heavy fast slow quiet new classic modern simple elegant durable "
         "cheap premium lamp chair table shirt shoe phone cable bag bottle").split()
# ... and words it splits into ~5 tokens: their share sets the prompt length.
LONG = ("handmade waterproof adjustable ergonomic stainless breathable lightweight "
        "rechargeable portable foldable vintage organic washable wireless compact sturdy").split()
ADJ = ["Soft", "Bright", "Compact", "Classic", "Modern", "Rugged", "Elegant", "Quiet", "Light",
       "Premium", "Handmade", "Vintage"]
NOUN = ["desk lamp", "wool scarf", "steel bottle", "leather bag", "cotton shirt", "phone case",
        "oak chair", "glass vase", "running shoe", "USB-C cable", "tea kettle", "backpack"]
LONG_SHARE = 0.52  # of a description's words: ~172 prompt tokens a row with PROMPT

# The job both benchmarks run: a short label from a long row.
PROMPT = {"system": "You label products with one category.",
          "template": "Title: {{ title }}\nPrice: {{ price }}\nDescription: {{ description }}\n"
                      "Category:"}
ID_COLUMN = "sku"


def product_chunk(first: int, rows: int, seed: int):
    """Rows [first, first + rows) of the table, as an Arrow table (the same for the same
    ``first``, ``rows`` and ``seed``)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.compute as pc

    rng = np.random.default_rng([seed, first])
    ids = pc.utf8_lpad(pa.array(np.arange(first, first + rows)).cast(pa.string()), 9, "0")
    sku = pc.binary_join_element_wise("SKU-", ids, "")
    title = pc.binary_join_element_wise(
        pa.array(ADJ).take(pa.array(rng.integers(0, len(ADJ), rows))),
        pa.array(NOUN).take(pa.array(rng.integers(0, len(NOUN), rows))), " ")
    lengths = rng.integers(30, 41, rows)
    total = int(lengths.sum())
    long = rng.random(total) < LONG_SHARE
    words = np.where(long, rng.integers(0, len(LONG), total) + len(SHORT),
                     rng.integers(0, len(SHORT), total))
    offsets = pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))
    listed = pa.ListArray.from_arrays(offsets, pa.array(SHORT + LONG).take(pa.array(words)))
    description = pc.binary_join(listed, " ")
    price = pa.array(np.round(rng.uniform(3, 250, rows), 2))
    return pa.table({"sku": sku, "title": title, "description": description, "price": price})


def make_products(folder: Path, rows: int, files: int = 4, row_group: int = 1_000_000,
                  jsonl: bool = False, seed: int = 0) -> list[Path]:
    """The table as ``files`` Parquet files (row groups of ``row_group`` rows) or JSONL files,
    in ``folder``; reused when a table of the same shape is there already."""
    import pyarrow.parquet as pq

    folder.mkdir(parents=True, exist_ok=True)
    shape = {"rows": rows, "files": files, "row_group": row_group, "jsonl": jsonl,
             "seed": seed, "long_share": LONG_SHARE}
    marker = folder / ".table.json"  # hidden: the job reads the folder as its input
    suffix = "jsonl" if jsonl else "parquet"
    paths = [folder / f"products-{i:02d}.{suffix}" for i in range(files)]
    if marker.exists() and json.loads(marker.read_text()) == shape:
        return paths
    marker.unlink(missing_ok=True)
    per_file = -(-rows // files)
    for i, path in enumerate(paths):
        start, end = i * per_file, min(rows, (i + 1) * per_file)
        tmp = path.with_suffix(".tmp")
        if jsonl:
            _write_jsonl(tmp, start, end, row_group, seed)
        else:
            with pq.ParquetWriter(tmp, product_chunk(0, 1, seed).schema) as writer:
                for first in range(start, end, row_group):
                    writer.write_table(product_chunk(first, min(row_group, end - first), seed),
                                       row_group_size=row_group)
        tmp.rename(path)
    marker.write_text(json.dumps(shape))
    return paths


def _write_jsonl(path: Path, start: int, end: int, chunk: int, seed: int) -> None:
    import polars as pl

    with open(path, "wb") as handle:
        for first in range(start, end, chunk):
            pl.from_arrow(product_chunk(first, min(chunk, end - first), seed)).write_ndjson(handle)
