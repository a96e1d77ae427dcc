"""Pre-flight: everything that can be checked before an engine starts, checked, in order.

``plan_job`` turns a validated config into a ``JobPlan``: the input scanned, the template
compiled against the input's columns, the model's tokenizer and context length resolved, and
the picklable specs each stage needs. Any problem is a JobError whose one line names it.
"""

from __future__ import annotations

import json

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, one_line
from pipelines.plan.fingerprint import fingerprint
from pipelines.plan.images import check_images
from pipelines.plan.input_checks import check_columns, check_output_apart, name_apart
from pipelines.plan.model import resolve_model
from pipelines.plan.prompt_checks import (check_rows_render, check_template_renders,
                                          compile_prompt)
from pipelines.plan.specs import (JobPlan, engine_spec, render_spec, sampling_spec,
                                  structured_spec)
from pipelines.plan.vllm_args import check_engine_args, check_reasoning_parser, check_tool_parser
from pipelines.read import (InputPlan, earlier_job, plan_block_rows, read_block, resolve_files,
                            scan_input)
from pipelines.reuse.request_key import KeySpec, key_columns, key_parts, step_key_columns
from pipelines.storage import Location, redact, scrub_record
from udfs import columns
from udfs.rows.parsers import SchemaError, StructuredSpec
from udfs.rows.tool_calls import read_spec
from udfs.stages.pooler import PoolingSpec


def plan_job(config: JobConfig) -> JobPlan:
    """Check the config against the input and the model; raise JobError on the first problem."""
    config, variables, pooling = _prompt_variables(config)
    structured = _structured(config)
    output = _output_location(config)
    config, plan = _scan(config)
    check_output_apart(config.input.path, plan, output)
    check_columns(config, plan, variables)
    if config.steps is None and config.prompt.template is not None:
        check_template_renders(config, plan, variables)
    max_model_len, images = _check_model(config, plan, pooling)
    steps = None
    if config.steps is not None:
        from pipelines.plan.steps import plan_steps

        steps = plan_steps(config, plan.schema, max_model_len, structured_spec,
                           sample=read_block(plan.blocks[0], plan.schema))
        # the first generating step's, for what reads one job's prompt (overnight validate)
        first = next(s for s in config.steps if s.prompt is not None)
        config_prompt, config_sampling = first.prompt, first.sampling
    else:
        config_prompt, config_sampling = config.prompt, config.sampling
    render = render_spec(config, config_prompt, config_sampling, max_model_len, pooling)
    if config.steps is None and pooling is None and plan.blocks and (
            config.prompt.messages_column is None or config.prompt.system is not None):
        # (a messages column's rows, a Batch file's lines, are each their own conversation:
        # failing alike, they are still each their own error)
        check_rows_render(config, plan, render)
    engine = engine_spec(config, config_prompt, max_model_len, images, structured, pooling)
    sampling = sampling_spec(config, config_prompt, structured)
    # as recorded: no credentials, and as JSON keeps it (a resume compares it with the
    # record's: a logit_bias's token ids come back as strings)
    recorded = json.loads(json.dumps(scrub_record(fingerprint(
        config, plan, max_model_len, structured, steps)), default=str))
    return JobPlan(config=config, input=plan, render=render, engine=engine,
                   sampling=sampling, structured=structured, pooling=pooling, steps=steps,
                   fingerprint=recorded,
                   request_key=_request_key(config, plan, recorded, variables))


def _prompt_variables(config: JobConfig) -> tuple[JobConfig, list[str], PoolingSpec | None]:
    """The input columns the prompt reads; a pooling job's model read for its labels and
    vector size (pipelines/plan/pooling.py), which may settle the config further."""
    if config.steps is not None:
        variables = []  # each step's are checked against the columns it sees (steps.py)
    elif config.prompt.messages_column is not None:
        variables = [config.prompt.messages_column]
    else:
        _, variables = compile_prompt(config.prompt.template)
    pooling = None
    if config.task != "generate":
        from pipelines.plan.pooling import plan_pooling

        config, pooling = plan_pooling(config)
        if config.prompt.pair_template is not None:
            variables = sorted({*variables, *compile_prompt(config.prompt.pair_template,
                                                            "prompt.pair_template")[1]})
    return config, variables, pooling


def _structured(config: JobConfig) -> StructuredSpec | None:
    """The structured-output spec, its JSON Schema loaded and checked; a named tool_choice's
    function's parameters are the job's schema (its arguments parsed into a struct)."""
    forced = config.prompt.forced_tool() if config.prompt is not None else None
    if forced is not None and forced["parameters"]:
        spec = StructuredSpec(json_schema=forced["parameters"],
                              parsed_column=config.output.parsed_column)
        try:
            spec.check()
        except SchemaError as exc:
            raise ConfigError(f"prompt.tools: {forced['name']}'s parameters: {exc}") from None
        return spec
    if config.structured is None:
        return None
    return structured_spec(config.structured, config.output.parsed_column)


def _output_location(config: JobConfig) -> Location:
    """Where the output goes: a local folder, or a folder inside an object store's bucket."""
    try:
        output = Location.of(config.output.path)
    except ValueError as exc:
        raise ConfigError(f"output.path {redact(config.output.path)!r}: "
                          f"{one_line(exc, None)}") from None
    if not output.local and "/" not in output.path.strip("/"):
        # the staging directory and the record sit beside the output: in the same bucket
        raise ConfigError(f"output.path {str(output)!r}: name a folder inside the bucket, "
                          f"e.g. {str(output).rstrip('/')}/out")
    return output


def _scan(config: JobConfig) -> tuple[JobConfig, InputPlan]:
    """The input's files listed once and scanned into blocks; an earlier overnight job's
    output keeps its row ids, and its columns this job adds too are named apart."""
    resolved = resolve_files(config.input.path, config.input.format)  # listed once
    earlier = earlier_job(resolved[0])  # the input is an overnight output: chained by hand
    if earlier is not None and config.input.id_column is None \
            and columns.ROW_ID in earlier.get("added", ()):
        # its rows keep the ids they have: the next job's output joins back to both
        config = config.model_copy(update={"input": config.input.model_copy(
            update={"id_column": columns.ROW_ID})})
    plan = scan_input(config.input.path, config.input.format, config.resources.batch_size,
                      config.input.id_column, resolved)
    block_rows = plan_block_rows(plan.num_rows, config.resources.batch_size)
    if block_rows < config.resources.batch_size:  # a small table: scanned again, in moments
        plan = scan_input(config.input.path, config.input.format, block_rows,
                          config.input.id_column, resolved)
    if earlier is not None:
        plan.schema = name_apart(plan.schema, earlier, config)
    return config, plan


def _check_model(config: JobConfig, plan: InputPlan,
                 pooling: PoolingSpec | None) -> tuple[int, int]:
    """The model, its images and the engine's settings checked; -> its max_model_len, and the
    most images a prompt may hold."""
    max_model_len = resolve_model(config)
    images = check_images(config, plan)
    if config.engine.kind == "vllm":
        check_engine_args(config.engine.args)
    if config.model.reasoning_parser is not None:
        check_reasoning_parser(config.model.reasoning_parser)
    check_tools(config)
    if pooling is not None:
        from pipelines.plan.pooling import max_seq_length

        if config.model.max_model_len is None:  # vLLM's limit for a sentence-transformer
            max_model_len = min(max_model_len, max_seq_length(config.model.name) or max_model_len)
    elif config.steps is None and config.sampling.max_tokens >= max_model_len:
        # (a job of steps: each step's own sampling, checked in plan_steps)
        raise ConfigError(f"sampling.max_tokens {config.sampling.max_tokens} leaves no room "
                          f"for a prompt in max_model_len {max_model_len}; lower it (e.g. "
                          f"--set sampling.max_tokens={max(1, max_model_len // 2)}) or raise "
                          "model.max_model_len")
    return max_model_len, images


def check_tools(config: JobConfig) -> None:
    """A job's tools can run: a choice other than none needs model.tool_parser, and the
    in-process engine (the HTTP engine sends no tools yet)."""
    prompt = config.prompt
    if config.model.tool_parser is not None:
        check_tool_parser(config.model.tool_parser)
    if config.engine.kind != "vllm" and config.model.tool_parser is not None:
        raise ConfigError("model.tool_parser needs engine.kind: vllm (the HTTP engine does "
                          "not parse tool calls yet)")
    if prompt is None or prompt.tools is None:
        return
    if config.engine.kind != "vllm":
        raise ConfigError("prompt.tools needs engine.kind: vllm (the HTTP engine does not "
                          "send tools yet)")
    choice = read_spec(prompt.tool_spec())["tool_choice"]
    if choice not in (None, "none") and config.model.tool_parser is None:
        shown = choice if isinstance(choice, str) else choice["function"]["name"]
        raise ConfigError(f"prompt.tool_choice {shown!r} needs model.tool_parser, the "
                          "model's tool-call parser (e.g. hermes), as vLLM's server needs "
                          "--tool-call-parser")


def _request_key(config: JobConfig, plan: InputPlan, recorded: dict,
                 variables: list[str]) -> KeySpec | None:
    """How a generate job's rows' request keys are made, where the job writes them."""
    if columns.REQUEST_KEY not in config.generated_columns():
        return None
    step_columns = (step_key_columns(config, set(plan.schema.names))
                    if config.steps is not None else None)
    return KeySpec.of(key_parts(recorded),
                      key_columns(config, variables, step_columns or ()), step_columns)
