"""Writing the output: Parquet parts committed as they are generated, the dataset committed once.

While a job runs, its parts go to a staging directory beside the output, ``OUTPUT.partial/``,
each written to a temporary name and renamed into place, so a part is either whole or absent.
A part holds a run of consecutive input rows and is named by their ordinals, ``[start, end)``:
``part-000000000256-000000000512.parquet``. The names alone say which rows are done, and sort
in input order.

The invariant everything here rests on (resume's coverage arithmetic, the retry merge,
compaction): **a part holds whole input rows, all of each row's samples, and no two parts
overlap** but where one holds the other whole (a compaction not yet finished). Ray Data may
cut a block anywhere between the engine's stage and the writer's, between two samples of one
row too: the writer keeps a row's samples that came without the rest aside, as a hidden
``.samples-ORDINAL-FIRST.parquet``, and the writer that completes the row writes its part
(``PartWriter``). A listing that finds two parts overlapping in part refuses them
(``list_parts``): that is a defect, and "superseded" would drop rows. The writers are a pool,
stateless: each writes what it is handed at once, one part per run of consecutive rows of one
block, so no actor holds rows back and none is a funnel every row passes through.

When every row is written, the parts are compacted (pipelines/write/compact.py) into files of about
``output.file_size_mb``, each written whole and then the parts it replaces removed: a file whose
range holds another's supersedes it, so a compaction interrupted at any moment is finished by
the next run. Then the staging directory is renamed to the output path. A crash at any moment
leaves either the old state or the new one; the next run of the same job picks up the parts
already there.

On an object store (``s3://``, ``gs://``: see pipelines/storage.py) each part is one upload,
whole or absent, but a directory cannot be renamed: the commit copies the staged files into
place, and only then marks the record complete. The record says which state the output is in; a
run interrupted during the commit finishes it when run again.

The output directory holds Parquet files and nothing else, so that ``pl.read_parquet(OUTPUT)``,
``pq.read_table(OUTPUT)`` and DuckDB's ``read_parquet('OUTPUT/*.parquet')`` all read it, in input
order. The job's own record (its fingerprint, state and summary) is a file beside it,
``OUTPUT.overnight.json``.

Where each piece lives:

- ``parts.py``: part names, the listing of a folder's parts, and resume's coverage arithmetic
  (``covered_blocks``, ``missing_rows``), all resting on the invariant above;
- ``writers.py``: ``PartLayout`` and ``PartWriter``, the pool that writes parts as rows come;
- ``retries.py``: ``RetryWriter``, the --retry-errors merge of re-run rows into a block;
- ``counts.py``: what each part holds, counted for the progress line and the report;
- ``store.py``: ``OutputStore``, the output's staging, record, resume and commit.
"""

from pipelines.write.counts import (COUNTED, COUNTED_IF_PRESENT, RECORD_SCHEMA, STEP_NUMBERS,
                                    add_steps, count_part, part_steps, read_part,
                                    summarize_part)
from pipelines.write.parts import (PART_PREFIX, PART_SUFFIX, RETRY_OLD, Part, count_runs,
                                   covered_blocks, input_offsets, list_parts, missing_rows,
                                   part_name, part_ordinal, part_range)
from pipelines.write.retries import RetryWriter
from pipelines.write.store import OutputStore, diff_fingerprints, write_atomically
from pipelines.write.writers import PartLayout, PartWriter

__all__ = ["COUNTED", "COUNTED_IF_PRESENT", "PART_PREFIX", "PART_SUFFIX", "RECORD_SCHEMA",
           "RETRY_OLD", "STEP_NUMBERS", "OutputStore", "Part", "PartLayout", "PartWriter",
           "RetryWriter", "add_steps",
           "count_part", "count_runs", "covered_blocks", "diff_fingerprints", "input_offsets",
           "list_parts", "missing_rows", "part_name", "part_ordinal", "part_range", "part_steps",
           "read_part", "summarize_part", "write_atomically"]
