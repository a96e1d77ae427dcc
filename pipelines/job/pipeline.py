"""The job, assembled: read -> render prompts and generate -> write parts -> commit.

``run_job`` is the whole data path on one screen; each step lives in the module named for it.
"""

from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from dataclasses import replace

from pipelines.config import JobConfig
from pipelines.errors import JobError, OutputError, StageError, one_line, root_cause
from pipelines.job.health import Health
from pipelines.job.progress import Progress
from pipelines.job.resources import (LIGHT_STAGE_CPUS, ReplicaPlan, check_paths_shared,
                                     plan_replicas, ray_session)
from pipelines.job.stage import stage
from pipelines.job.summary import RunSummary
from pipelines.job.watchdog import watch
from pipelines.order import grouped
from pipelines.plan.preflight import plan_job
from pipelines.plan.specs import JobPlan
from pipelines.read import blocks_at_once, read_dataset
from pipelines.report.run_report import RunTimes, build_report, write_report
from pipelines.reuse.carry import LookUpInRay, find_reuse, stage_reuse
from pipelines.storage import scrub_record
from pipelines.write import OutputStore, PartLayout, PartWriter, RetryWriter
from pipelines.write.compact import compact
from udfs import columns
from udfs.rows.parsers import OutputParser
from udfs.stages.chain import chain_named_for
from udfs.stages.pooler import Pooler
from udfs.stages.predictor import Predictor
from udfs.stages.steps import StepsPredictor


def build_dataset(plan: JobPlan, layout: PartLayout, skip_blocks: frozenset[int],
                  only_rows: dict[int, list[int]] | None = None, health: str | None = None,
                  others: bool = False, from_step: int | None = None):
    """The Ray Data chain; each stage is one ``map_batches`` over whole blocks."""
    replicas = plan_replicas(plan.config)
    resources = plan.config.resources
    # a small table's blocks are smaller than batch_size (pipelines/read/sizes.py:
    # plan_block_rows): an engine holds more of them, the same rows at once
    block_rows = max((b.num_rows for b in plan.input.blocks), default=resources.batch_size)
    at_once = blocks_at_once(resources.blocks_in_flight, resources.batch_size, block_rows,
                             len(plan.input.blocks))
    ds, ray_block_rows = read_dataset(plan.input, skip_blocks, only_rows, others,
                                      block_rows=block_rows,
                                      slots=replicas.replicas * at_once)
    if ds is None:
        return None
    engine_stage, after = job_stages(plan, replicas, health, staged_steps=(
        # a re-run that reuses an earlier output's first steps: their rows, staged
        {"states": str(layout.staging), "from_step": from_step,
         "block_starts": layout.block_starts} if from_step is not None else None))
    # Parts are written as they come, where the rows are: in the last stage's actors, a pool
    # as large as the engines' (udfs/stages/chain.py says why). A re-run of rows with errors merges
    # each block whole: one writer, a stage of its own.
    retry = layout.merge_from is not None
    writer = (RetryWriter if retry else PartWriter, {"layout": layout})
    if retry:
        after.append(writer)
    engine_stages = [engine_stage] if after else [engine_stage, writer]
    ds = ds.map_batches(chain_named_for(engine_stages),
                        # Ray Data's blocks, cut back into the plan's blocks in the actor, as
                        # many at once as the engine takes; a block may come in pieces, each
                        # written as a part of its own
                        fn_constructor_kwargs={"stages": engine_stages,
                                               "cut": (layout.block_starts, block_rows),
                                               "at_once": at_once},
                        # by rows, not whole blocks (Ray Data insists on it for GPU stages)
                        batch_format="pyarrow", batch_size=ray_block_rows,
                        **replicas.remote_args(),
                        compute=actor_pool(replicas.replicas, concurrent_blocks=at_once))
    if after:
        if not retry:
            after.append(writer)
        pool = 1 if retry else replicas.replicas
        # the parse and write stages' share of the light stages' CPUs, whatever the pool's size
        # (pipelines/job/resources.py plans the cluster for it)
        ds = ds.map_batches(chain_named_for(after), fn_constructor_kwargs={"stages": after},
                            batch_format="pyarrow", batch_size=None,
                            num_cpus=round(2 * LIGHT_STAGE_CPUS / pool, 4),
                            compute=actor_pool(pool))
    return ds


def job_stages(plan: JobPlan, replicas: ReplicaPlan, health: str | None = None,
               staged_steps: dict | None = None) -> tuple[tuple[type, dict], list]:
    """The engine's stage and the stages after it (the structured output's parser), each
    ``(class, kwargs)``: what a job runs between its read and its write, and what
    ``pipelines.add_stages`` appends to a user's own dataset."""
    engine = plan.engine
    if engine.kind != "http" and replicas.cpu_threads and not engine.options.get("cpu_threads"):
        engine = replace(engine, options={**engine.options,
                                          "cpu_threads": replicas.cpu_threads})
    # The predictor renders the prompts too (udfs/stages/predictor.py says why); a pooling
    # task's pooler (udfs/stages/pooler.py) likewise
    shared = {"engine": engine, "render": plan.render, "health": health,
              "stall_timeout_s": plan.config.engine.stall_timeout_s}
    if plan.steps is not None:  # every step on this engine (udfs/stages/steps.py)
        stage = (StepsPredictor, {
            "engine": engine, "steps": plan.steps, "health": health,
            "stall_timeout_s": plan.config.engine.stall_timeout_s,
            "key_column": plan.config.input.id_column or columns.ORDINAL,
            "keep_dropped": plan.config.output.keep_dropped, **(staged_steps or {})})
    elif plan.pooling is None:
        stage = (Predictor, {**shared, "sampling": plan.sampling,
                             "output_column": plan.config.output.column})
    else:
        stage = (Pooler, {**shared, "pooling": plan.pooling,
                          "pair_template": plan.config.prompt.pair_template})
    after = []  # the stages after the engine's, in actors of their own
    if plan.structured is not None:
        after.append((OutputParser, {"spec": plan.structured,
                                     "output_column": plan.config.output.column}))
    return stage, after


def actor_pool(size: int, concurrent_blocks: int = 1):
    """A fixed pool of actors; with ``concurrent_blocks`` > 1 each actor runs that many
    calls at once, in threads (the predictor's engine is built for it)."""
    import ray.data

    if concurrent_blocks == 1:
        return ray.data.ActorPoolStrategy(size=size)
    return ray.data.ActorPoolStrategy(size=size, max_concurrent_calls_per_actor=concurrent_blocks,
                                      enable_true_multi_threading=True)


def run_job(config: JobConfig, *, overwrite: bool = False, retry_errors: bool = False,
            progress: Progress | None = None, verbose: bool = False) -> RunSummary:
    """Run a job to completion (or resume it) and commit its output. Raises JobError.

    With ``retry_errors``, only the rows of the committed output whose ``error`` is set run
    again, and their new results replace the old ones. The output is this run's alone from
    start to end: a second run of it at once is refused in one line."""
    # (the session: a Ray started early, for a large table's reuse, is stopped at the end)
    with OutputStore(config.output.path).locked(), ExitStack() as session:
        return _run_job(config, overwrite=overwrite, retry_errors=retry_errors,
                        progress=progress, verbose=verbose, session=session)


def _run_job(config: JobConfig, *, overwrite: bool, retry_errors: bool,
             progress: Progress | None, verbose: bool, session: ExitStack) -> RunSummary:
    started = time.time()
    _refuse_flags(config, retry_errors)
    with stage("planning the job"):  # every stage's unforeseen failure: one line
        plan = plan_job(config)
    planned = time.time()
    store = OutputStore(config.output.path)
    if not retry_errors and (record := store.interrupted_commit(plan.fingerprint)):
        return _finish_commit(store, record)
    progress = progress or Progress(total=0, enabled=False)
    reuse_started = time.time()
    reusing = find_reuse(plan, store, progress) if not retry_errors else None
    reuse_s = time.time() - reuse_started
    # a reuse run replaces the output it reuses (at its commit, as any run does)
    done, only_rows, todo = _open_output(config, plan, store, retry_errors,
                                         overwrite=overwrite or reusing is not None)
    layout = _part_layout(config, plan, store, only_rows, retry_errors)
    reused = None
    if reusing is not None:  # the rows found, staged as parts before any engine starts
        staging_started = time.time()
        if isinstance(reusing, LookUpInRay):  # Ray now, for the task (and the job after)
            session.enter_context(ray_session(config.resources.address, verbose=verbose))
        with stage("staging the reused rows"):
            reused = stage_reuse(plan, store, reusing, layout, done, progress)
        reuse_s += time.time() - staging_started
        done = store.resume(layout.block_starts, plan.input.num_rows)
        only_rows = store.remaining or None
        todo = _rows_to_run(plan, done, only_rows)
    grouping_started = time.time()
    order, run_plan, run_layout, (done, only_rows, todo) = _in_head_order(
        config, plan, store, layout, progress, (done, only_rows, todo), reusing, retry_errors)
    grouping_s = time.time() - grouping_started
    _start_progress(config, run_plan, store, progress, todo, retry_errors)
    times = RunTimes(started)  # this run's part records, added up: replicas, times
    progress.phase("starting Ray")
    with ray_session(config.resources.address, verbose=verbose):
        ray_ready = time.time()
        recovery, samples = _generate(config, run_plan, store, run_layout, done, only_rows,
                                      progress, times, retry_errors=retry_errors,
                                      verbose=verbose, from_step=(reused or {}).get("from_step"))
        restore_s = _restore_input_order(config, order, layout) if order is not None else 0.0
        stats = _compact(config, plan, store, layout)
    summary = _summarize(config, plan, store, stats, todo, reused, recovery, started)
    record = _commit(config, plan, store, summary)
    with stage("writing the run report (the output is committed)"):
        summary.report = build_report(store.path, record, times=times, samples=samples,
                                      stats=stats, timings={
            "started": started, "planned": planned, "ray_ready": ray_ready,
            **({"reuse_s": reuse_s} if reused is not None else {}),
            **({"grouped": order.found.summary(), "grouping_s": grouping_s,
                "restore_s": restore_s} if order and order.found else {}),
            "finished": time.time()})
        summary.report_path = str(write_report(store.path, summary.report))
    return summary


def _in_head_order(config: JobConfig, plan: JobPlan, store: OutputStore, layout: PartLayout,
                   progress: Progress, opened: tuple, reusing, retry_errors: bool) -> tuple:
    """Rows sharing a prompt head run one after another (pipelines/order/), where that pays:
    (the order or None, the plan, layout and ``opened`` (done, only_rows, todo) to run by)."""
    done, only_rows, _ = opened
    if reusing is not None or len(done) >= len(plan.input.blocks) or grouped.why_not(
            config, plan, retry_errors):
        return None, plan, layout, opened
    with stage("grouping the rows by prompt prefix"):
        order = grouped.head_order(config, plan, store.staging, progress,
                                   fresh=not done and not only_rows)
    if order is None:
        return None, plan, layout, opened
    done, only_rows = order.open()  # the job reads the input's copy in head order
    return order, order.plan, order.layout(layout), (
        done, only_rows, _rows_to_run(order.plan, done, only_rows))


def _restore_input_order(config: JobConfig, order, layout: PartLayout) -> float:
    """A run in head order's rows put back in input order; its seconds."""
    started = time.time()
    with stage("putting the rows back in input order", kept=True):
        order.restore(layout.block_starts, int(config.output.file_size_mb * (1 << 20)))
    return time.time() - started


def _refuse_flags(config: JobConfig, retry_errors: bool) -> None:
    """--retry-errors where it does not apply: one line, before anything is planned."""
    if retry_errors and config.steps is not None:
        raise JobError("--retry-errors does not apply to a job with steps yet (a row's steps "
                       "run together); run the job again with --overwrite")
    if retry_errors and (config.output.reuse or config.output.reuse_from):
        raise JobError("--retry-errors and output.reuse do not go together: a reuse run "
                       "generates the rows that failed before anyway; drop one")


def _open_output(config: JobConfig, plan: JobPlan, store: OutputStore, retry_errors: bool,
                 overwrite: bool) -> tuple[set[int], dict | None, int]:
    """The output opened for this run: the blocks done already, of the others the rows still
    to run where not all (None: all), and the input rows this run generates."""
    key_column = config.input.id_column or columns.ROW_ID
    block_starts = tuple(b.ordinal for b in plan.input.blocks)
    try:
        if retry_errors:
            only_rows, done = store.open_retry(plan.fingerprint, key_column, block_starts,
                                               plan.input.num_rows), set()
            return done, only_rows, sum(len(rows) for rows in only_rows.values())
        done = store.open(plan.fingerprint, overwrite=overwrite,
                          rows_total=plan.input.num_rows, block_starts=block_starts)
        # of blocks written in part by an interrupted run, only the rows still to run
        only_rows = store.remaining or None
        return done, only_rows, _rows_to_run(plan, done, only_rows)
    except OSError as exc:  # permissions, a full disk, an object store refusing
        raise OutputError(f"output.path {str(store.path)!r}: cannot write there: "
                          f"{one_line(exc, 300)}") from None


def _part_layout(config: JobConfig, plan: JobPlan, store: OutputStore,
                 only_rows: dict | None, retry_errors: bool) -> PartLayout:
    """Where and how the writers put this run's parts."""
    return PartLayout(
        staging=store.staging,
        source_columns=tuple(plan.input.schema.names),
        added_columns=tuple(plan.config.generated_columns()),  # with a classifier's labels
        block_starts=tuple(b.ordinal for b in plan.input.blocks),
        block_rows=tuple(len(only_rows.get(b.ordinal, ())) if retry_errors else b.num_rows
                         for b in plan.input.blocks),
        merge_from=store.path if retry_errors else None,
        key_column=config.input.id_column or columns.ROW_ID,
        text_column=config.output.column,
        dedupe=config.output.dedupe,
        rows_total=plan.input.num_rows,
        keep_dropped=config.output.keep_dropped,
        metadata=((columns.JOB_METADATA, json.dumps(job_metadata(plan)).encode()),),
        request_key=plan.request_key,
    )


def _start_progress(config: JobConfig, plan: JobPlan, store: OutputStore, progress: Progress,
                    todo: int, retry_errors: bool) -> None:
    """The progress line's totals: this run's rows, and those an earlier run wrote."""
    already = 0 if retry_errors else plan.input.num_rows - todo
    progress.total = todo + already
    progress.requests_total = todo * requests_per_row(config)
    progress.start(str(store.path), already=already)


def _generate(config: JobConfig, plan: JobPlan, store: OutputStore, layout: PartLayout,
              done: set[int], only_rows: dict | None, progress: Progress, times: RunTimes, *,
              retry_errors: bool, verbose: bool, from_step: int | None) -> tuple[dict, list]:
    """The rows still to do through the engines and writers, in the Ray session; each part's
    record counted as it comes. Returns the engines' recovery summary and the throughput
    samples."""
    # object stores are shared by nature; local paths must be seen by every node
    check_paths_shared([os.path.abspath(loc.path) for loc in (*plan.input.files,
                                                               store.staging) if loc.local])
    _quiet_ray_data(verbose)
    replicas = plan_replicas(plan.config)
    # the cores of this machine, where the engines run on it (not a cluster's elsewhere)
    local = config.resources.address is None and config.engine.kind != "http"
    # (a CPU engine's threads are its cores; a GPU engine's are not counted, only the others')
    health = Health(plan.config.engine.max_restarts, progress, check_cores=local,
                     engine_cores=(replicas.cpu_threads or 0) * replicas.replicas or None)
    ds = build_dataset(plan, layout, frozenset(done), only_rows, health=health.name,
                       others=not retry_errors, from_step=from_step)
    n = replicas.replicas
    progress.phase(f"starting {n} replica{'s' if n != 1 else ''} of the server client"
                   if config.engine.kind == "http" else
                   f"loading the model on {n} replica{'s' if n != 1 else ''}")
    try:
        # watch(): a job that writes nothing for a while says what it waits for
        for batch in watch(ds.iter_batches(batch_size=None, batch_format="pyarrow"),
                           config) if ds else ():
            for record in batch.to_pylist():
                times.add(record)
                by_kind = json.loads(record["errors"])
                progress.update(record["input_rows"], record["completion_tokens"],
                                sum(by_kind.values()), by_kind, record["prompt_tokens"])
    except Exception as exc:  # an engine that would not start or died; a failed write
        progress.finish()
        health.close()
        raise StageError(f"the job stopped: {root_cause(exc)} (the parts written are "
                         "kept, and the same command resumes from them; --debug shows "
                         "the traceback)") from exc
    recovery = health.close()
    progress.finish()
    return recovery, health.samples


def _compact(config: JobConfig, plan: JobPlan, store: OutputStore, layout: PartLayout) -> list:
    """Every block written, the parts into files of output.file_size_mb, on the cluster
    (pipelines/write/compact.py). Returns each file's counts."""
    block_starts = layout.block_starts
    written = store.done_blocks(block_starts, plan.input.num_rows)
    missing = [start for start in block_starts if start not in written]
    if missing:  # never commit an output with a hole in it
        raise JobError(f"{len(missing)} block(s) were not written (first: rows from "
                       f"{missing[0]}); the parts written are kept: run again to resume")
    with stage("compacting the parts", kept=True):
        return compact(store.staging, block_starts, plan.input.num_rows,
                       int(config.output.file_size_mb * (1 << 20)), layout.key_column)


def _summarize(config: JobConfig, plan: JobPlan, store: OutputStore, stats: list, todo: int,
               reused: dict | None, recovery: dict, started: float) -> RunSummary:
    """The run's counts, from the output's files and what this run did."""
    summary = RunSummary(output=str(store.path))
    for file in stats:
        summary.add_part(file)
    summary.structured = plan.structured is not None
    summary.keep_dropped = bool(plan.steps) and config.output.keep_dropped
    summary.rows_total = plan.input.num_rows
    if config.output.dedupe:  # every input row was written with n samples, less duplicates
        summary.deduped = plan.input.num_rows * config.sampling.n - summary.rows
    summary.rows_reused = reused["reused"] if reused else 0
    # (rows whose first steps were carried over ran their later steps: not done before)
    summary.rows_resumed = plan.input.num_rows - todo - (
        summary.rows_reused if reused and reused.get("from_step") is None else 0)
    summary.reuse = reused
    summary.seconds = time.time() - started
    summary.recovery = recovery
    return summary


def _commit(config: JobConfig, plan: JobPlan, store: OutputStore, summary: RunSummary) -> dict:
    """The staged output put in place, with its record. Returns the record."""
    record = scrub_record({"fingerprint": plan.fingerprint,
                           "fingerprint_hash": plan.fingerprint_hash,
                           "rows_total": plan.input.num_rows,
                           "config": config.model_dump(mode="json"),
                           "summary": summary.counts()})
    try:
        store.commit(record)
    except OSError as exc:  # the staged parts stay; the same command commits them
        raise OutputError(f"output.path {str(store.path)!r}: cannot commit the output: "
                          f"{one_line(exc, 300)} (the parts written are kept: "
                          "run the same command again)") from None
    return record


def _rows_to_run(plan: JobPlan, done: set[int], only_rows: dict | None) -> int:
    """The input rows this run generates: of the blocks not done, the rows no part holds."""
    return sum(len(only_rows[b.ordinal]) if only_rows and b.ordinal in only_rows
               else b.num_rows for b in plan.input.blocks if b.ordinal not in done)




def _finish_commit(store: OutputStore, record: dict) -> RunSummary:
    """A run stopped after its output was put in place, before its record said so: the
    output is whole (the staging folder became it in one rename); the record is marked
    complete, and the report counted from the output."""
    summary = RunSummary(**record["summary"])
    store.finish_commit(record)
    summary.report = build_report(store.path, record)  # (the stopped run's times are gone)
    summary.report_path = str(write_report(store.path, summary.report))
    return summary


def requests_per_row(config: JobConfig) -> int:
    """The engine requests an input row makes: its samples; with steps, each generating
    step's rows (an estimate: a step that explodes an array, or a filter, changes it)."""
    if config.steps is None:
        return config.sampling.n
    rows, total = 1, 0
    for step in config.steps:
        if step.prompt is not None:
            rows *= step.sampling.n
            total += rows
    return total


def job_metadata(plan: JobPlan) -> dict:
    """What every file of the output says of the job that wrote it: the columns it added, and
    the prefix a later job reading this output names them by, where it would add the same
    (pipelines/plan/input_checks.py: ``output.column`` + ``_finish_reason``...); the settings in its
    request keys, for a re-run to say which changed (pipelines/reuse/carry.py)."""
    config = plan.config
    prefix = "job" if config.steps is not None else config.output.column
    meta = {"prefix": prefix, "added": config.generated_columns()}
    if plan.request_key is not None:
        meta["request_key"] = json.loads(plan.request_key.parts)
        # the column that tells its input rows apart, where two ask for one request
        meta["id_column"] = config.input.id_column or columns.ROW_ID
    return meta




def _quiet_ray_data(verbose: bool) -> None:
    from ray.data import DataContext

    ctx = DataContext.get_current()
    ctx.enable_progress_bars = verbose
    ctx.print_on_execution_start = verbose
