"""The job's fingerprint: what determines its results, recorded with its output.

A resumed run must match it exactly; settings that change only how fast or where a job runs
are left out, so a resume may change them.
"""

from __future__ import annotations

from pipelines.config import JobConfig
from pipelines.plan.adapters import adapters_fingerprint
from pipelines.plan.model_files import model_fingerprint
from pipelines.read import InputPlan
from pipelines.storage import redact
from udfs.rows.parsers import StructuredSpec


def fingerprint(config: JobConfig, plan: InputPlan, max_model_len: int,
                 structured: StructuredSpec | None, steps=None) -> dict:
    """What determines the job's results; a resumed run must match it exactly. ``steps``:
    plan_steps' specs of a job of steps (their JSON Schemas read and checked)."""
    task = {} if config.task == "generate" else {"task": config.task}
    return {**task,
        "structured": structured.engine_params() if structured else None,
        "input files": plan.fingerprint_parts(),
        "input": config.input.model_dump(exclude={"path"}),
        "prompt": config.prompt.model_dump() if config.prompt else None,
        **({"steps": [_step_fingerprint(s, spec) for s, spec in zip(config.steps, steps)]}
           if config.steps else {}),
        "model": _model_fingerprint(config, max_model_len),
        "sampling": config.sampling.model_dump(),
        # file_size_mb changes how the output is cut into files, not what it holds; reuse
        # where its rows come from, not what they are
        "output": config.output.model_dump(exclude={"path", "file_size_mb", "reuse",
                                                    "reuse_from"}),
        "resources.batch_size": config.resources.batch_size,
        "engine": _engine_fingerprint(config),
        **({"adapters": adapters_fingerprint(config.model.adapters)}
           if config.model.adapters else {}),
    }


def _model_fingerprint(config: JobConfig, max_model_len: int) -> dict:
    """The model's settings, and its files: retrained, or its chat template edited, in place
    (pipelines/plan/model_files.py). Not an HTTP engine's: its server holds the model it serves,
    named by model.name; a Hugging Face cache here says nothing of it."""
    model = {**config.model.model_dump(), "max_model_len": max_model_len}
    if config.engine.kind != "http":
        model["files"] = model_fingerprint(config.model.name,
                                           getattr(config.engine, "args", None))
    return model


def _step_fingerprint(step, spec) -> dict:
    """A step's settings, its structured.json_schema file by its content, not its path (a
    schema edited in place asks for other output): the schema plan_steps read and checked
    (``spec``, its StepSpec), not the file read again."""
    dump = step.model_dump()
    schema = (dump.get("structured") or {}).get("json_schema")
    if isinstance(schema, str):
        dump["structured"]["json_schema"] = spec.structured.json_schema
    return dump


# Engine settings that change how fast or where a job runs, not what it writes: a resumed run
# may change them (a smaller KV cache after running out of memory, say).
RECOVERY_SETTINGS = {"max_restarts", "stall_timeout_s"}  # the pipeline's, not the engine's
RESOURCE_SETTINGS = {"kv_cache_memory_bytes", "gpu_memory_utilization", "cpu_threads",
                     "multiprocessing", "enforce_eager", "max_concurrency", "timeout_s",
                     "max_retries", "backoff_s", "api_key_env", *RECOVERY_SETTINGS}


def _engine_fingerprint(config: JobConfig) -> dict:
    """The engine settings that can change results: its kind, server, structured-output
    backend, vLLM's own arguments. A resume never mixes two engines' outputs."""
    engine = config.engine.model_dump(exclude=RESOURCE_SETTINGS)
    if "base_url" in engine:
        engine["base_url"] = redact(engine["base_url"])
    return engine
