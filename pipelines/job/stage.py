"""A stage of the job whose unforeseen failure stops it in one line, as a user's mistake does:
the boundary ``run_job`` and the reuse it runs put around each step."""

from __future__ import annotations

from contextlib import contextmanager

from pipelines.errors import JobError, StageError, root_cause


@contextmanager
def stage(what: str, kept: bool = False):
    """A stage of ``run_job`` whose unforeseen failure (a corrupt part, a full disk, a bug)
    stops the job in one line, as a user's mistake does; --debug shows the traceback."""
    try:
        yield
    except JobError:
        raise
    except Exception as exc:  # noqa: BLE001 - the boundary: whatever it was, one line
        kept_note = ("the parts written are kept: fix the cause and run the same command "
                     "again; " if kept else "")
        raise StageError(f"{what} failed: {root_cause(exc)} ({kept_note}--debug shows the "
                         "traceback)") from exc
