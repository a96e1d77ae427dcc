"""What a re-run reuses: the earlier output it carries rows over from, and which of the new
table's rows it finds there (``plan_reuse``), or why none."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

import numpy as np

from pipelines.errors import OutputError
from pipelines.plan.changes import changed_settings
from pipelines.reuse.earlier import earlier_files, footer
from pipelines.reuse.join import join_keys
from pipelines.reuse.request_key import KeySpec
from pipelines.storage import Location
from pipelines.write.store import OutputStore
from udfs import columns


@dataclass
class ReusePlan:
    """What a re-run carries over: for each new row, where its earlier outputs are."""

    source: str
    rows: int  # the new table's
    reused: int = 0
    earlier_rows: int = 0  # the earlier output's input rows
    dropped: int = 0  # earlier rows whose request the new table no longer makes
    failed: int = 0  # earlier rows found, with an error: generated again
    why_none: str | None = None  # with nothing reused: why
    # a job of steps whose first steps alone are unchanged: the rows found are carried over
    # up to this step (its first), and run from there (udfs/stages/steps.py); None: whole rows
    from_step: int | None = None
    from_step_name: str | None = None
    files: list = field(default_factory=list, repr=False)  # the earlier output's files
    file_rows: np.ndarray | None = field(default=None, repr=False)  # their first global rows
    at: np.ndarray | None = field(default=None, repr=False)  # int64[rows]: first earlier row, -1
    count: np.ndarray | None = field(default=None, repr=False)  # int32[rows]: its samples

    @property
    def generated(self) -> int:
        return self.rows - self.reused

    def line(self) -> str:
        line = (f"reuse: {self.reused} of {self.rows} rows reusable from {self.source}; "
                f"{self.generated} to generate")
        if self.why_none:
            return f"{line} ({self.why_none})"
        extra = [f"{self.failed} of them failed before" if self.failed else "",
                 f"{self.dropped} earlier rows no longer asked for (removed or changed)"
                 if self.dropped else ""]
        return line + "".join(f"; {e}" for e in extra if e) + steps_carried(self.record())

    def record(self) -> dict:
        return {"source": self.source, "rows": self.rows, "reused": self.reused,
                "generated": self.generated, "dropped": self.dropped, "failed": self.failed,
                "why_none": self.why_none, "from_step": self.from_step,
                "from_step_name": self.from_step_name}


def steps_carried(reuse: dict) -> str:
    """What of a job of steps' rows was carried over, when not the whole rows: words to add
    to a line about the rows reused."""
    if reuse.get("from_step") is None:
        return ""
    name = reuse.get("from_step_name")
    return (f" (the steps before {name!r}: {name!r} and the steps after it run for every row)"
            if name else " (their first steps' columns)")


def reuse_source(config) -> Location | None:
    """The earlier output a run reuses: output.reuse_from, or with output.reuse the output
    itself where it is complete. None: nothing to reuse (a first run)."""
    if config.output.reuse_from:
        source = Location.of(config.output.reuse_from)
        if not source.exists():
            raise OutputError(f"output.reuse_from {str(source)!r}: no such output")
        return source
    if not config.output.reuse:
        return None
    out = Location.of(config.output.path)
    record = OutputStore(out).read_record() or {}
    # an unfinished run's own staging is resumed, the output it replaces is still whole
    if out.exists() and record.get("state") in ("complete", "running", "committing"):
        return out
    return None


def plan_reuse(plan, source: Location) -> ReusePlan:
    """Find the new table's requests among the earlier output's (``plan``: a JobPlan)."""
    files, why = earlier_files(source)
    footers = [footer(file) for file in files]
    keyed = [(file, footer) for file, footer in zip(files, footers)
             if columns.REQUEST_KEY in footer.names]
    result = ReusePlan(source=str(source), rows=plan.input.num_rows,
                       files=[file for file, _ in keyed])
    if why is not None or not keyed:
        result.why_none = why or ("the earlier output has no request_key column: it was "
                                  "written before overnight kept one")
        return result
    ours = json.loads(plan.request_key.parts)
    # each file's job: the settings its rows were keyed by (its first part's: a file of a
    # --retry-errors run holds rows of both runs' settings, each with its own key)
    settings = [footer.job.get("request_key") for _, footer in keyed]
    theirs = next((s for s in settings if s == ours), settings[0])
    # the earlier rows' keys: their request_key column, or with rekey their first steps'
    rekey, why = _first_steps_key(plan.request_key, keyed, theirs, ours, result)
    earlier_rows = sum(footer.rows for _, footer in keyed)
    if why is not None:  # every key differs
        result.why_none = why
        result.earlier_rows = result.dropped = earlier_rows  # (rows, not input rows: about)
        return result
    # (settings that differ in every file: no key can be the same; the rows are looked up
    # all the same, each by its own key, and the line says what changed)
    spec = plan.request_key if rekey is None else rekey
    join_keys(plan, spec, keyed, rekey, result, earlier_rows)
    result.reused = int((result.at >= 0).sum())
    if result.reused == 0 and result.why_none is None:
        other = settings[0] if ours not in settings and rekey is None else None
        result.why_none = (changed_settings(other, ours) if other
                           else "no row's request is the same")
    return result


def _first_steps_key(spec: KeySpec, keyed: list, theirs: dict | None, ours: dict,
                     result: ReusePlan) -> tuple[KeySpec | None, str | None]:
    """A job of steps may have only its first steps unchanged: the key of those steps alone
    (both sides are keyed again by it; ``result`` says from which step), or why no key can be
    the same. (None, None): the whole rows' keys, as they are."""
    if not spec.step_columns:
        return None, None
    rekey = None
    k, why = _unchanged_steps(theirs, ours)
    if k is not None and (k < len(ours["steps"]) or k < len(theirs["steps"])):
        result.from_step = k
        result.from_step_name = ours["steps"][k]["name"] if k < len(ours["steps"]) else None
        rekey = spec.first_steps(k)
    if rekey is not None and why is None:
        names = set(keyed[0][1].names)
        missing = [c for c in rekey.columns
                   if (c if c != columns.ORDINAL else columns.ROW_ID) not in names]
        if missing:
            why = f"the earlier output has no column {missing[0]!r}"
    return rekey, why


def _unchanged_steps(theirs: dict | None, ours: dict) -> tuple[int | None, str | None]:
    """A job of steps: how many of its first steps the earlier job had the same, all its
    other settings the same too; or why none of its rows can be carried over."""
    if theirs is None or "steps" not in theirs:
        return None, "the earlier output is not of a job of steps"
    rest = lambda parts: {k: v for k, v in parts.items() if k != "steps"}  # noqa: E731
    if rest(theirs) != rest(ours):
        return None, changed_settings(rest(theirs), rest(ours))
    k = 0
    while k < min(len(theirs["steps"]), len(ours["steps"])) and \
            theirs["steps"][k] == ours["steps"][k]:
        k += 1
    if k == 0:
        return None, f"steps[0] ({ours['steps'][0]['name']}) changed"
    later = theirs["steps"][k:]
    dropping = next((s for s in later if s.get("where") is not None or s.get("explode") or
                     (s.get("prompt") or {}).get("on_too_long") == "skip"), None)
    if dropping is not None and not (theirs.get("output") or {}).get("keep_dropped"):
        # a row its later step dropped is not in the earlier output at all
        changed = ours["steps"][k]["name"] if k < len(ours["steps"]) else "the steps after"
        return None, (f"steps[{k}] ({changed}) changed, and the earlier job's step "
                      f"{dropping['name']!r} after it drops rows, which its output does "
                      "not hold (output.keep_dropped: true keeps them for a next run)")
    return k, None
