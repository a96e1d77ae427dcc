"""Reuse: a re-run over a changed table carries over the rows whose request is unchanged.

Every row of a generate job's output holds its request key (``request_key``, made in
pipelines/reuse/request_key.py). The key is a column, not a sidecar: it travels with the row
wherever the output is copied (yesterday's snapshot, an object store), and a reader that does
not want it leaves one column out.

A run with ``output.reuse`` (or ``output.reuse_from``) finds the new table's keys among the
earlier output's (``find_reuse``, then pipelines/reuse/find.py: ``plan_reuse``), then stages the
rows found as parts, their generated columns beside the new table's values in the new table's
order (``stage_reuse``, then pipelines/reuse/staging.py: ``stage_reused``), before any engine
starts; the rest run as the rows still to do of a resumed job do. The lookup is a join of two
key columns, never a dict of rows (pipelines/reuse/join.py): both sides are hashed a block at a
time and spilled to local files by their keys' bits, and each slice is joined by sorting, so the
driver holds 5 bytes a new row (where its earlier outputs are) and one slice at a time.

Two input rows never merge. Rows may share a key (a greedy job's duplicate texts under two
ids: the same request); the earlier output's input rows are told apart by their ids and
sample_index, never by the key (``_input_rows``), and the k-th new row with a key takes the
k-th earlier input row with it (``_join``): each earlier row is carried over once at most. The
lookup is row by row: an output a --retry-errors run with another max_tokens merged into holds
rows keyed by either run's settings, each found by its own key. The earlier output is its parts
by their names, or, where its files were renamed, every Parquet file in its folder
(pipelines/reuse/earlier.py).

A job of steps: a row's key covers every step, and its output rows (its fan-out) are carried
over together. When only its first steps are unchanged, both sides are keyed again by those
steps alone (``KeySpec.first_steps``, over the earlier output's source values), and a row found
is staged as its state after them (``_stage_states``: a hidden file a block, which
udfs/stages/steps.py starts the block's rows from) rather than as a part.
"""

from __future__ import annotations

from dataclasses import dataclass

from pipelines.job.stage import stage
from pipelines.reuse.find import plan_reuse, reuse_source
from pipelines.reuse.ray_task import carry_over_on_ray
from pipelines.reuse.staging import stage_reused
from pipelines.write import diff_fingerprints

# A run over a table this large looks up and stages its rows in a Ray task on the driver's
# node (pipelines/reuse/ray_task.py): the lookup's arrays and the staging's blocks are that
# task's memory, and the driver's stays what a first run's is
LARGE_ROWS = 1_000_000


def find_reuse(plan, store, progress):
    """With output.reuse: the earlier output's rows this run's table asks for again (None:
    no reuse). A resumed reuse run has staged them already: its record says what it found.
    ``plan``: a JobPlan; ``store``: its OutputStore; ``progress``: the job's Progress."""
    if plan.request_key is None or not (plan.config.output.reuse
                                        or plan.config.output.reuse_from):
        return None
    record = store.read_record() or {}
    if (record.get("state") == "running" and store.staging.exists()
            and record.get("reuse") and not diff_fingerprints(record.get("fingerprint", {}),
                                                              plan.fingerprint)):
        return record["reuse"]  # staged before it stopped
    source = reuse_source(plan.config)
    if source is None:
        progress.say(f"reuse: no earlier output at {plan.config.output.path} yet; every row "
                     "is generated")
        return None
    if plan.input.num_rows >= LARGE_ROWS:
        return LookUpInRay(source)  # found and staged in one Ray task: stage_reuse
    with stage("finding the rows to reuse"):
        found = plan_reuse(plan, source)
    progress.say(found.line())
    return found


@dataclass
class LookUpInRay:
    """A large table's rows to reuse: looked up and staged in a Ray task, not the driver."""

    source: object  # a Location


def stage_reuse(plan, store, found, layout, done: set[int], progress) -> dict:
    """The rows found, written as parts; the record says so, so that a resumed run does not
    look for them again."""
    if isinstance(found, dict):  # a resumed run's: staged already
        return found
    if isinstance(found, LookUpInRay):
        record, saved, line = carry_over_on_ray(plan, found.source, layout, done)
        progress.say(line)
    else:
        record, saved = found.record(), stage_reused(plan, found, layout, done)
    reused = {**record, "reused": saved["rows"],
              "generated": plan.input.num_rows - saved["rows"],
              "prompt_tokens_saved": saved["prompt_tokens"],
              "completion_tokens_saved": saved["completion_tokens"]}
    store.write_record({**(store.read_record() or {}), "reuse": reused})
    return reused
