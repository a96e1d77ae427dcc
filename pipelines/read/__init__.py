"""Reading the input table: find the files, check them, cut them into ordered blocks.

The scan reads every file once, cheaply (Parquet footers; JSONL line by line), before any engine
starts: it reports the first unreadable file or malformed line with its location, settles one
schema for the whole input, and records where each block of ``block_rows`` rows starts. Blocks
are numbered by the ordinal of their first row, so the same input always cuts the same way and
a resumed job can skip the blocks already written.

Where each step lives, in the order the data meets them:

- ``files.py``: which files a path names (a file, a folder, a glob; local or an object store);
- ``schema.py``: one schema for every file, widened only where no value changes;
- ``scan.py``: the scan itself, ``scan_input`` -> ``InputPlan`` (blocks, schema, id checks);
- ``sizes.py``: block sizes and the read-ahead budget;
- ``blocks.py``: ``read_dataset``, the Ray Data datasource that streams the planned blocks.
"""

from pipelines.read.blocks import (ReadUnit, TableDatasource, read_block, read_dataset,
                                   read_unit, read_units)
from pipelines.read.files import FORMATS, earlier_job, glob_regex, resolve_files
from pipelines.read.scan import Block, IdDigest, InputPlan, scan_input
from pipelines.read.schema import renamed
from pipelines.read.sizes import (BLOCK_ROWS_AT_LEAST, PARTS_AT_LEAST, RAY_BLOCK_ROWS,
                                  READ_AHEAD_BLOCKS, READ_AHEAD_MIN, ROUNDS, blocks_at_once,
                                  plan_block_rows, ray_block_rows, read_ahead_bytes)

__all__ = ["BLOCK_ROWS_AT_LEAST", "FORMATS", "PARTS_AT_LEAST", "RAY_BLOCK_ROWS",
           "READ_AHEAD_BLOCKS", "READ_AHEAD_MIN", "ROUNDS", "Block", "IdDigest", "InputPlan",
           "ReadUnit", "TableDatasource", "blocks_at_once", "earlier_job", "glob_regex",
           "plan_block_rows", "ray_block_rows", "read_ahead_bytes", "read_block", "read_dataset",
           "read_unit", "read_units", "renamed", "resolve_files", "scan_input"]
