"""A Batch file run end to end: its lines prepared, the job run (or resumed) over them, and
the result and error files written; ``run_batch`` is what ``overnight batch`` and the
server's batch workers call."""

from __future__ import annotations

import json
from pathlib import Path

from pipelines.batchfile import anthropic
from pipelines.batchfile import embeddings
from pipelines.batchfile.envelopes import served_name
from pipelines.batchfile.lines import (CUSTOM_ID, MAX_TOKENS, MODEL, OVERRIDES, PROMPT, TOOLS,
                                       file_format)
from pipelines.batchfile.prepare import Prepared, model_resolver, prepare, prompt_counter
from pipelines.batchfile.results import finish_write, work_dir, write_results
from pipelines.config import JobConfig, apply_overrides, load_config, read_yaml
from pipelines.errors import ConfigError, InputError, OutputError
from pipelines.storage import scrub_record
from pipelines.write import write_atomically


def run_batch(requests: str | Path, results: str | Path, *, model: str,
              errors: str | Path | None = None, config: str | Path | None = None,
              overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False,
              served_model_name: str | None = None, format: str | None = None,
              quiet: bool = False) -> int:
    """What ``overnight batch`` does with its arguments: the file run (``run_batch_file``,
    with a progress line unless ``quiet``), then its counts and files printed. Returns the
    exit status, 0; a user's mistake is raised (a JobError), for the caller to end the run
    as the command line does (``pipelines.errors.exit_status``). The ``batch`` command runs
    this, and so do ``overnight serve``'s batch workers (serve/worker.py)."""
    from pipelines.job.progress import Progress

    counts = run_batch_file(requests, results, errors=errors, model=model, config=config,
                            overrides=overrides, overwrite=overwrite,
                            served_model_name=served_model_name,
                            progress=Progress(total=0, enabled=not quiet), format=format)
    if counts["format"] == "anthropic":
        print(f"requests: {counts['requests']} lines -> {counts['results']} succeeded, "
              f"{counts['errors']} errored ({counts['rejected_lines']} could not run)")
        print(f"results: {counts['results_path']}")
        return 0
    print(f"requests: {counts['requests']} lines -> {counts['results']} results, "
          f"{counts['errors']} errors ({counts['rejected_lines']} could not run)")
    print(f"results: {counts['results_path']}\nerrors: {counts['errors_path']}")
    return 0


def run_batch_file(requests: str | Path, results: str | Path, *, model: str,
                   errors: str | Path | None = None, config: dict | str | Path | None = None,
                   overrides: list[str] | tuple[str, ...] = (), overwrite: bool = False,
                   progress=None, served_model_name: str | None = None,
                   format: str | None = None) -> dict:
    """Run an OpenAI Batch input file; write the result and error files. Returns counts.
    ``served_model_name``: the ``model`` of every result body (default: the model
    directory's name, ``served_name``). ``format`` "openai" or "anthropic" (default: the
    file's shape, ``file_format``): an Anthropic Message Batches file has one result file
    of succeeded and errored results, and no error file."""
    from pipelines.plan.model import resolve_max_model_len

    requests, results = Path(requests), Path(results)
    fmt, errors = _format_and_errors(requests, results, errors, format)
    committed = finish_write(results, errors)  # a kill between the two renames: complete it
    base = _base_config(config, overrides)
    model_section = base.get("model", {})
    max_model_len = resolve_max_model_len(model, model_section.get("max_model_len"),
                                          model_section.get("trust_remote_code", False))
    served = served_model_name or served_name(model)

    work = work_dir(results)
    # what the results depend on: the file, and the model and settings it runs with
    source = scrub_record({"path": str(requests.resolve()), "size": requests.stat().st_size,
                           "mtime": requests.stat().st_mtime, "max_model_len": max_model_len,
                           "model": model, "config": base, "format": fmt})
    manifest = work / "source.json"
    unchanged = manifest.exists() and json.loads(manifest.read_text()) == source \
        and (work / "requests.parquet").exists()
    # the files in place are this run's own (written from this work directory for the same
    # file and settings): a re-run completes them, as it resumes the job
    ours = committed is not None and unchanged
    for path in (results, errors):
        if path is not None and path.exists() and not overwrite and not ours:
            raise OutputError(f"{path} already exists; pass --overwrite to replace it")
    work.mkdir(parents=True, exist_ok=True)
    prepared = _prepared(requests, work, source, unchanged, base, model, max_model_len, served,
                         fmt)
    job_output = work / "output"
    summary = _run_job(prepared, job_output, model, base, unchanged, overwrite, progress)
    if summary is None and ours and not overwrite:  # nothing ran: the files are up to date
        ok, failed = committed["counts"]
    else:
        ok, failed = write_results(job_output, prepared.errors, results, errors, served,
                                   tokenizer=model,
                                   adapters=tuple(model_section.get("adapters") or ()),
                                   fmt=fmt)
    return {"requests": prepared.requests + prepared.rejected, "results": ok, "errors": failed,
            "rejected_lines": prepared.rejected, "results_path": str(results),
            "errors_path": errors and str(errors), "summary": summary, "format": fmt}


def _format_and_errors(requests: Path, results: Path, errors: str | Path | None,
                       format: str | None) -> tuple[str, Path | None]:
    """The file's format (``format``, else its shape) and its error file: ``errors``, else
    RESULTS.errors.jsonl beside the results; a Message Batches file has none."""
    if not requests.is_file():
        raise InputError(f"{requests}: no such request file")
    if format not in (None, "openai", anthropic.FORMAT):
        raise ConfigError(f"batch: format {format!r} is not one of openai, anthropic")
    fmt = format or file_format(requests)
    if fmt != anthropic.FORMAT:
        return fmt, Path(errors) if errors else results.with_name(results.stem + ".errors.jsonl")
    if errors:
        raise ConfigError("batch: a Message Batches file's results hold its errored "
                          "requests too; it has no error file (drop -e/--errors)")
    return fmt, errors


def _base_config(config: dict | str | Path | None, overrides) -> dict:
    """The operator's config (a dict, or a YAML file's path) with ``overrides`` applied: the
    engine, resources and sampling defaults every request of the file runs with."""
    import yaml

    if isinstance(config, (str, Path)):
        try:
            config = read_yaml(config) or {}  # a key given twice refused, as a job's
        except (OSError, yaml.YAMLError) as exc:
            raise ConfigError(f"{config}: cannot read: {exc}") from None
    return apply_overrides({k: dict(v) if isinstance(v, dict) else v
                            for k, v in (config or {}).items()}, list(overrides))


def _prepared(requests: Path, work: Path, source: dict, unchanged: bool, base: dict,
              model: str, max_model_len: int, served: str, fmt: str) -> Prepared:
    """The file's prepared table: the work directory's own when the file and settings are
    ``unchanged``, else prepared anew and recorded (with ``source``, what it was made from)."""
    prepared_record = work / "prepared.json"
    if unchanged and prepared_record.exists():
        return Prepared(**{**json.loads(prepared_record.read_text()),
                           "table": work / "requests.parquet",
                           "errors": work / "rejected.jsonl"})
    model_section = base.get("model", {})
    # a request without max_tokens: the operator's sampling.max_tokens, else the room its
    # prompt leaves in the context (the hosted API's default, and vLLM's run_batch's)
    adapters = model_section.get("adapters") or {}
    prepared = prepare(requests, work, base.get("sampling", {}).get("max_tokens"),
                       max_model_len, prompt_counter(
                           model, max_model_len, model_section.get("trust_remote_code", False)),
                       adapter_of=model_resolver(served, model, adapters) if adapters else None,
                       fmt=fmt, tool_parser=model_section.get("tool_parser"))
    write_atomically(prepared_record, lambda tmp: tmp.write_text(json.dumps(
        {k: v for k, v in prepared.__dict__.items() if k not in ("table", "errors")})))
    write_atomically(work / "source.json", lambda tmp: tmp.write_text(json.dumps(source)))
    return prepared


def _run_job(prepared: Prepared, job_output: Path, model: str, base: dict, unchanged: bool,
             overwrite: bool, progress) -> dict | None:
    """The prepared requests' job: started over for a new file (or ``overwrite``), resumed
    for the same file interrupted; its summary, or None where nothing ran."""
    from pipelines.job.pipeline import run_job
    from pipelines.write import OutputStore

    if not prepared.requests:  # nothing to run: no result may come from an earlier file's parts
        if not unchanged or overwrite:
            OutputStore(str(job_output)).discard()
        job_output.mkdir(exist_ok=True)
        return None
    record = OutputStore(str(job_output)).read_record() or {}
    # an edited request file (its results replaced with --overwrite): the lines whose
    # requests are unchanged are carried over from the earlier file's (pipelines/reuse/carry.py)
    reuse = (not unchanged and prepared.task != "embed"
             and record.get("state") == "complete")
    job = (embeddings_config if prepared.task == "embed" else batch_config)(
        prepared, job_output, model, base, ["output.reuse=true"] if reuse else [])
    if overwrite or not unchanged:  # a new request file (or asked for): start over
        return run_job(job, overwrite=True, progress=progress)
    if record.get("state") != "complete":  # the same file, interrupted: resume
        return run_job(job, progress=progress)
    return None


def batch_config(prepared: Prepared, output: Path, model: str, base: dict | None,
                 overrides: list[str]) -> JobConfig:
    """The job that runs the prepared requests: messages (or a raw prompt) per row, each
    row's own max_tokens and sampling; the rest (engine, resources, context) from ``base``."""
    raw = {k: dict(v) if isinstance(v, dict) else v for k, v in (base or {}).items()}
    for section in ("input", "prompt", "output", "structured"):
        if section in raw:
            raise ConfigError(f"batch: the config's {section!r} section is set by the batch "
                              "file; remove it")
    raw["input"] = {"path": str(prepared.table), "id_column": CUSTOM_ID}
    raw.setdefault("model", {})["name"] = model
    raw["prompt"] = {"messages_column": PROMPT, "on_too_long": "error",
                     # each request's own tools (lines.py), where any has them
                     **({"tools_column": TOOLS} if prepared.tools else {})}
    sampling = raw.setdefault("sampling", {})
    sampling.update({"max_tokens": prepared.max_tokens, "max_tokens_column": MAX_TOKENS,
                     "overrides_column": OVERRIDES})
    sampling.setdefault("temperature", 1.0)  # the OpenAI default
    # the logprobs column is there for the requests that ask (each row says; null: not)
    raw["output"] = {"path": str(output), "column": "text", "logprobs": 0}
    raw = apply_overrides(raw, overrides)
    if (raw.get("model") or {}).get("adapters"):  # each request's model names its adapter
        raw["prompt"]["adapter_column"] = MODEL
    return load_config(raw)


def embeddings_config(prepared: Prepared, output: Path, model: str, base: dict | None,
                      overrides: list[str]) -> JobConfig:
    """The embed job over a file of /v1/embeddings lines: one row per input."""
    raw = base or {}
    for section in ("input", "prompt", "output", "structured", "sampling"):
        if section in raw:
            raise ConfigError(f"batch: the config's {section!r} section is set by the batch "
                              "file; remove it")
    table = embeddings.explode(prepared.table, prepared.table.with_name("inputs.parquet"))
    return load_config(apply_overrides(embeddings.job_raw(table, output, model, raw),
                                       overrides))
