"""The output path, its staging directory ``OUTPUT.partial/`` and its job record
``OUTPUT.overnight.json``: the rules for starting over, resuming, retrying and committing.

A commit leaves either the old state or the new one: on a local disk the staging folder is
renamed to the output (the earlier output moved aside first, removed after); on an object store
each part is copied into place, and only then does the record say ``complete``. A run stopped
in its commit is finished by the same command.
"""

from __future__ import annotations

import json
import os
import time
import uuid
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.plan.changes import diff_fingerprints, what_changed
from pipelines.errors import AlreadyComplete, OutputError, one_line
from pipelines.storage import Location, hold_lock, scrub_record
from pipelines.write.counts import read_part
from pipelines.write.parts import (RETRY_OLD, Part, covered_blocks, input_offsets, list_parts,
                                   missing_rows, part_name)
from udfs import columns

def write_atomically(path: Path | Location, write) -> None:
    """Call ``write(tmp_path)``, then put the file at ``path`` whole (fsync and rename on a
    local disk, one upload on an object store): whole or absent."""
    Location.of(path).write(write)


class OutputStore:
    """The output path, its staging directory and its job record; the rules for starting
    over, resuming and committing. Paths may be local or on an object store."""

    def __init__(self, path: str | Location):
        if isinstance(path, (str, os.PathLike)) and os.path.islink(path):
            # a link to the real output folder: work beside what it points to, so the commit
            # renames real folders and the link keeps pointing at the output
            path = os.path.realpath(path)
        self.path = Location.of(path)
        self.staging = self.path.sibling(".partial")
        self.record = self.path.sibling(".overnight.json")
        # after open(): the rows still to run of blocks an interrupted run wrote in part
        self.remaining: dict[int, list[int]] = {}

    @contextmanager
    def locked(self):
        """This output, for this process alone while the block runs: a second run of a job
        writing here is refused in one line (two at once would write the same parts and
        commit over each other). A local output's lock is ``OUTPUT.overnight.lock`` beside
        it; an object store has no lock to take (say so in the docs)."""
        if not self.path.local:
            yield
            return
        try:
            handle, holder = hold_lock(self.path.sibling(".overnight.lock").path)
        except OSError as exc:  # a folder this user cannot write
            raise OutputError(f"output.path {str(self.path)!r}: cannot write there: "
                              f"{one_line(exc, 300)}") from None
        if handle is None:
            raise OutputError(f"output.path {str(self.path)!r} is being written by another "
                              f"overnight run (pid {holder}); wait for it to end, or choose "
                              "another output.path")
        try:
            yield
        finally:
            handle.close()

    def read_record(self) -> dict | None:
        try:
            return json.loads(self.record.read_text())
        except FileNotFoundError:
            return None

    def write_record(self, record: dict) -> None:
        self.path.parent.mkdir()
        self.record.write_text(json.dumps(scrub_record(record), indent=2, default=str))

    def interrupted_commit(self, fingerprint: dict) -> dict | None:
        """The record of a run of this job stopped after its output was put in place and
        before the record said so (a local disk's commit: the staging folder renamed to the
        output, the record still "committing"): the commit to finish. None otherwise."""
        record = self.read_record() or {}
        if (record.get("state") == "committing" and "summary" in record
                and not self.staging.exists() and self.path.exists()
                and not diff_fingerprints(record.get("fingerprint", {}), fingerprint)):
            return record
        return None

    def finish_commit(self, record: dict) -> None:
        """Record the job complete, once its output is in place; clear what a commit stopped
        half-way left beside it."""
        self.write_record({**record, "state": "complete", "finished": time.time()})
        self.staging.remove()  # on a local disk, already gone
        self._remove_replaced()

    def _remove_replaced(self) -> None:
        """An earlier output a local commit moved aside (``.NAME.replaced-*``), left by a
        commit stopped between its two renames: the output is now the staged one."""
        if self.path.local:
            for name in self.path.parent.names():
                if name.startswith(f".{self.path.name}.replaced-"):
                    (self.path.parent / name).remove()

    def open(self, fingerprint: dict, *, overwrite: bool, rows_total: int = 0,
             block_starts: tuple[int, ...] = ()) -> set[int]:
        """Prepare staging for this job; return the first ordinals of blocks already written
        (``block_starts``: every planned block's)."""
        record = self.read_record() or {}
        if self.staging.exists() and record.get("state") in ("running", "committing"):
            # An unfinished run. Of this job: resume it, with or without --overwrite (the
            # command that started it may have had the flag; "the same command resumes").
            earlier = record.get("fingerprint", {})
            if not diff_fingerprints(earlier, fingerprint):
                return self._resume(block_starts, rows_total)
            if not overwrite:
                raise OutputError(
                    f"{self.staging} holds an unfinished run of a different job "
                    f"({what_changed(earlier, fingerprint)}); pass --overwrite to discard "
                    "it, or choose another output.path")
        elif self.path.exists() and not overwrite:
            self._refuse_existing(record, fingerprint)
        self.staging.remove()
        self.staging.mkdir()
        self.write_record({"state": "running", "started": time.time(),
                           "rows_total": rows_total, "fingerprint": fingerprint})
        return set()

    def _refuse_existing(self, record: dict, fingerprint: dict) -> None:
        """An output already in place, and no --overwrite: a finished run of this same job
        says so (``AlreadyComplete``: nothing to do); anything else is in the way."""
        earlier = record.get("fingerprint")
        if earlier is None:  # no record, or one that says nothing of the job: not ours
            raise OutputError(f"output.path {str(self.path)!r} already exists; "
                              "pass --overwrite to replace it, or choose another path")
        if diff_fingerprints(earlier, fingerprint):
            raise OutputError(f"output.path {str(self.path)!r} already exists, written by a "
                              f"different job ({what_changed(earlier, fingerprint)}); pass "
                              "--overwrite to replace it, or choose another path")
        if record.get("state") != "complete":
            raise OutputError(f"output.path {str(self.path)!r} already exists (its record "
                              f"says {record.get('state')!r}); pass --overwrite to replace "
                              "it, or choose another path")
        counts = record.get("summary") or {}
        errors = sum((counts.get("errors") or {}).values())
        raise AlreadyComplete(f"{self.path} already exists and is complete: "
                              f"{counts.get('rows', '?')} rows of this same job, {errors} with "
                              f"errors (overnight status {self.path}); to run it again, "
                              "add --overwrite")

    def resume(self, block_starts: tuple[int, ...], rows_total: int) -> set[int]:
        """``open``'s answer again, once more parts are staged (a reuse run's own)."""
        return self._resume(block_starts, rows_total)

    def _resume(self, block_starts: tuple[int, ...], rows_total: int) -> set[int]:
        """The blocks the staged parts cover whole. Superseded parts are removed. Of a block
        only partly written (its other rows were in flight when the run stopped), the rows
        still to run are kept in ``self.remaining`` ({block start: positions in the block}):
        the rows written are not read again."""
        kept, superseded = list_parts(self.staging)
        for part in superseded:
            (self.staging / part.name).remove()
        if not block_starts:  # no plan given: each part stands for the block it starts
            return {p.start for p in kept}
        done, partial = covered_blocks(kept, block_starts, rows_total)
        self.remaining = missing_rows(kept, partial, block_starts, rows_total)
        return done

    def done_blocks(self, block_starts: tuple[int, ...] = (), rows_total: int = 0) -> set[int]:
        """The blocks the staged parts cover whole (without ``block_starts``: the starts of
        the staged parts)."""
        kept, _ = list_parts(self.staging)
        if not block_starts:
            return {p.start for p in kept}
        return covered_blocks(kept, block_starts, rows_total)[0]

    def open_retry(self, fingerprint: dict, key_column: str, block_starts: tuple[int, ...],
                   rows_total: int) -> dict[int, list[int]]:
        """Stage a re-run of the rows with errors in the committed output. Files without
        errors are linked (copied, on an object store) into staging unchanged; of a file with
        errors, the blocks without errors are staged as parts and each block with errors as
        its committed rows, for the retry writer to merge into. Returns {block start: input
        positions in the block to re-run}."""
        record = self.read_record()
        # "retrying": an interrupted retry; the committed output is untouched, start it again
        if not self.path.exists() or not record or record.get("state") not in ("complete",
                                                                                 "retrying"):
            raise OutputError(f"--retry-errors: {str(self.path)!r} is not a completed output "
                              "of this job; run it first")
        # a larger budget for the rows that failed is allowed (a thinking model's no_answer
        # rows: --retry-errors --set sampling.max_tokens=N); anything else is another job
        earlier, ours = _budget_apart(record.get("fingerprint", {})), _budget_apart(fingerprint)
        if diff_fingerprints(earlier, ours):
            raise OutputError(f"--retry-errors: {self.path} was written by a different job "
                              f"({what_changed(earlier, ours)})")
        self.staging.remove()
        self.staging.mkdir()
        retry: dict[int, list[int]] = {}
        for part in list_parts(self.path)[0]:
            table = read_part(self.path / part.name, columns=[key_column, columns.ERROR])
            ordinals = part.start + np.asarray(
                input_offsets(table.column(key_column).to_pylist()), dtype=np.int64)
            failed = ordinals[table.column(columns.ERROR).is_valid().to_numpy(
                zero_copy_only=False)]
            if len(failed) == 0:
                (self.path / part.name).copy_to(self.staging / part.name)
                continue
            retry.update(self._stage_for_retry(part, ordinals, set(failed.tolist()),
                                               block_starts, rows_total))
        self.write_record({**record, "state": "retrying", "retry_started": time.time()})
        return retry

    def _stage_for_retry(self, part: Part, ordinals: np.ndarray, failed: set[int],
                         block_starts: tuple[int, ...], rows_total: int) -> dict[int, list]:
        whole = read_part(self.path / part.name)
        blocks = np.asarray(block_starts)[
            np.searchsorted(np.asarray(block_starts), ordinals, side="right") - 1]
        retry, clean = {}, []  # clean: row indices of a run of blocks without errors

        def stage_clean():
            if clean:
                rows = pa.array(np.concatenate(clean), pa.int64())
                first, last = ordinals[rows[0].as_py()], ordinals[rows[-1].as_py()]
                table = whole.take(rows)
                (self.staging / part_name(int(first), int(last) + 1)).write(
                    lambda tmp: pq.write_table(table, tmp))
                clean.clear()

        for start in np.unique(blocks):
            rows = np.flatnonzero(blocks == start)
            bad = sorted(o - int(start) for o in set(ordinals[rows].tolist()) & failed)
            if not bad:
                clean.append(rows)
                continue
            stage_clean()
            old = whole.take(pa.array(rows, pa.int64()))
            (self.staging / RETRY_OLD.format(int(start))).write(
                lambda tmp, old=old: pq.write_table(old, tmp))
            retry[int(start)] = bad
        stage_clean()
        return retry

    def discard(self) -> None:
        """The output, its staging folder and its record, removed."""
        for where in (self.path, self.staging, self.record):
            where.remove()

    def commit(self, record: dict) -> None:
        """Make the staged parts the output, then record the job as complete. On a local
        disk that is one rename; on an object store, a copy of each part, after which the
        record turns complete (an interrupted copy is redone by the next run)."""
        kept, superseded = list_parts(self.staging)
        keep = {p.name for p in kept}
        for name in self.staging.names():  # temporaries left by a killed run; superseded
            if name not in keep:
                (self.staging / name).remove()
        # "committing", with the summary: a run stopped from here on finishes the commit
        # (``interrupted_commit``) instead of finding an output it would refuse to replace
        self.write_record({**record, "state": "committing"})
        if self.path.local:
            if self.path.exists():  # moved aside, then removed once the new one is in place
                self.path.rename_to(self.path.with_name(
                    f".{self.path.name}.replaced-{uuid.uuid4().hex[:8]}"))
            self.staging.rename_to(self.path)
        else:
            self.path.remove()
            self.path.mkdir()
            for name in self.staging.names():
                (self.staging / name).copy_to(self.path / name)
        self.finish_commit(record)


def _budget_apart(fingerprint: dict) -> dict:
    """A fingerprint without sampling.max_tokens: what a retry must match."""
    sampling = fingerprint.get("sampling")
    if not isinstance(sampling, dict):
        return fingerprint
    return {**fingerprint, "sampling": {k: v for k, v in sampling.items() if k != "max_tokens"}}
