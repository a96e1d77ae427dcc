"""Pre-flight: everything that can be checked before an engine starts, checked.

``plan_job`` turns a validated config into a ``JobPlan``: the input scanned, the template
compiled against the input's columns, the model's tokenizer and context length resolved, and
the picklable specs each stage needs. Any problem is a JobError whose one line names it.
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from pipelines.plan.adapters import adapter_sampling, adapters_fingerprint, check_adapters
from pipelines.plan.model_files import model_fingerprint
from pipelines.plan.images import check_image_columns, check_model_takes_images, image_spec, \
    max_images
from pipelines.reuse.request_key import KeySpec, key_columns, key_parts, step_key_columns
from pipelines.config import JobConfig
from pipelines.errors import ConfigError, InputError, JobError, one_line
from pipelines.read import (InputPlan, earlier_job, glob_regex, read_block, read_unit,
                            plan_block_rows, read_units, renamed, resolve_files,
                            scan_input)
from pipelines.storage import Location, redact, scrub_record
from udfs import columns
from udfs.engines.engine import EngineSpec
from udfs.rows.logprobs import SERVER_TOP_K_MAX, confidence_top_k
from udfs.rows.parsers import SchemaError, StructuredSpec
from udfs.stages.predictor import SamplingSpec
from udfs.stages.pooler import PoolingSpec
from udfs.stages.prompts import PromptRenderer, RenderSpec, load_tokenizer, rows_fail_alike
from udfs.stages.templates import NullValue, TemplateError, compile_template, render_template


@dataclass
class JobPlan:
    config: JobConfig
    input: InputPlan
    render: RenderSpec
    engine: EngineSpec
    sampling: SamplingSpec
    fingerprint: dict
    structured: StructuredSpec | None = None
    pooling: PoolingSpec | None = None  # task: embed | score | classify
    steps: tuple | None = None  # a job of several steps: StepSpec each (udfs/stages/steps.py)
    # a generate job's: how its rows' request keys are made (pipelines/reuse/request_key.py)
    request_key: KeySpec | None = None

    @property
    def fingerprint_hash(self) -> str:
        blob = json.dumps(self.fingerprint, sort_keys=True, default=str).encode()
        return hashlib.sha256(blob).hexdigest()[:16]


def plan_job(config: JobConfig) -> JobPlan:
    """Check the config against the input and the model; raise JobError on the first problem."""
    if config.steps is not None:
        variables = []  # each step's are checked against the columns it sees (steps.py)
    elif config.prompt.messages_column is not None:
        variables = [config.prompt.messages_column]
    else:
        _, variables = _compile(config.prompt.template)
    pooling = None
    if config.task != "generate":  # the model's labels and vector size (pipelines/plan/pooling.py)
        from pipelines.plan.pooling import plan_pooling

        config, pooling = plan_pooling(config)
        if config.prompt.pair_template is not None:
            variables = sorted({*variables, *_compile(config.prompt.pair_template,
                                                      "prompt.pair_template")[1]})
    structured = _structured(config)
    try:
        output = Location.of(config.output.path)
    except ValueError as exc:
        raise ConfigError(f"output.path {redact(config.output.path)!r}: "
                          f"{one_line(exc, None)}") from None
    if not output.local and "/" not in output.path.strip("/"):
        # the staging directory and the record sit beside the output: in the same bucket
        raise ConfigError(f"output.path {str(output)!r}: name a folder inside the bucket, "
                          f"e.g. {str(output).rstrip('/')}/out")
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
        plan.schema = _name_apart(plan.schema, earlier, config)
    check_output_apart(config.input.path, plan, output)
    _check_columns(config, plan, variables)
    if config.steps is None and config.prompt.template is not None:
        _check_template_renders(config, plan, variables)
    max_model_len = _resolve_model(config)
    images = _check_images(config, plan)
    if config.engine.kind == "vllm":
        _check_engine_args(config.engine.args)
    if config.model.reasoning_parser is not None:
        _check_reasoning_parser(config.model.reasoning_parser)
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
    render = RenderSpec(
        template=config_prompt.template, tokenizer=config.model.name,
        max_model_len=max_model_len, max_tokens=0 if pooling else config_sampling.max_tokens,
        system=config_prompt.system,
        # a pooling model embeds the text as it is, unless asked for the chat template
        chat=config_prompt.chat if config_prompt.chat is not None else pooling is None,
        on_too_long=config_prompt.on_too_long, on_null=config_prompt.on_null,
        trust_remote_code=config.model.trust_remote_code,
        messages_column=config_prompt.messages_column,
        keep_messages=config.engine.kind == "http" and config.engine.endpoint == "chat",
        max_tokens_column=config_sampling.max_tokens_column,
        chat_template_kwargs=config_prompt.chat_template_kwargs,
        images=image_spec(config_prompt, config.input.path),
        chat_template_content_format=config_prompt.chat_template_content_format,
    )
    if config.steps is None and pooling is None and plan.blocks and (
            config.prompt.messages_column is None or config.prompt.system is not None):
        # (a messages column's rows, a Batch file's lines, are each their own conversation:
        # failing alike, they are still each their own error)
        _check_rows_render(config, plan, render)
    engine_options = (_http_engine_options(config) if config.engine.kind == "http" else {
        **vllm_engine_options(config.model, config.engine, max_model_len),
        **({"reasoning_parser": config.model.reasoning_parser,
            "chat_template_kwargs": config_prompt.chat_template_kwargs}
           if config.model.reasoning_parser else {}),
    })
    if images and config.engine.kind == "vllm" \
            and "limit_mm_per_prompt" not in config.engine.args:
        engine_options["args"] = {**engine_options.get("args", {}),
                                  "limit_mm_per_prompt": {"image": images}}
    s = config.sampling
    confidence = config.confidence_column()
    top_for_confidence = 0
    if confidence:  # a server allows what it allows: usually OpenAI's 20
        top_for_confidence = (confidence_top_k(structured.choice, SERVER_TOP_K_MAX)
                              if config.engine.kind == "http"
                              else confidence_top_k(structured.choice))
    if top_for_confidence > 20 and config.engine.kind == "vllm":
        engine_options["max_logprobs"] = top_for_confidence  # vLLM allows 20 by default
    sampling = SamplingSpec(
        max_tokens=s.max_tokens, temperature=s.temperature, top_p=s.top_p, top_k=s.top_k,
        min_tokens=s.min_tokens, seed=s.seed, stop=tuple(s.stop), ignore_eos=s.ignore_eos,
        repetition_penalty=s.repetition_penalty, presence_penalty=s.presence_penalty,
        frequency_penalty=s.frequency_penalty, stop_token_ids=tuple(s.stop_token_ids),
        key_column=config.input.id_column or columns.ORDINAL,
        structured=structured.engine_params() if structured else None, n=s.n,
        max_tokens_column=s.max_tokens_column, overrides_column=s.overrides_column,
        logprobs_column=config.logprobs_column(), logprobs=config.output.logprobs,
        confidence_column=confidence, confidence_top_k=top_for_confidence,
        logit_bias=tuple(sorted((s.logit_bias or {}).items())),
        reasoning_column=config.reasoning_column(),
        **adapter_sampling(config, config_prompt),
        count_images=config.steps is None and bool(config_prompt.images),
    )
    kind = config.engine.kind
    if pooling is not None and kind == "vllm":
        kind = "vllm_pooling"  # udfs/engines/pooling_engine.py; the HTTP engine does both
    # as recorded: no credentials, and as JSON keeps it (a resume compares it with the
    # record's: a logit_bias's token ids come back as strings)
    fingerprint = json.loads(json.dumps(scrub_record(_fingerprint(
        config, plan, max_model_len, structured, steps)), default=str))
    request_key = None
    if columns.REQUEST_KEY in config.generated_columns():
        step_columns = (step_key_columns(config, set(plan.schema.names))
                        if config.steps is not None else None)
        request_key = KeySpec.of(key_parts(fingerprint),
                                 key_columns(config, variables, step_columns or ()), step_columns)
    return JobPlan(config=config, input=plan, render=render,
                   engine=EngineSpec(kind, config.model.name, engine_options),
                   sampling=sampling, structured=structured, pooling=pooling, steps=steps,
                   fingerprint=fingerprint, request_key=request_key)


def _name_apart(schema: pa.Schema, earlier: dict, config: JobConfig) -> pa.Schema:
    """An input written by an earlier overnight job holds columns this job adds too
    (finish_reason, error...): this job reads those under the earlier job's prefix (its
    output column: ``rewrite_finish_reason``), so both jobs' columns are in the output."""
    prefix, added = earlier.get("prefix"), set(earlier.get("added", ()))
    mine = set(config.generated_columns())
    clashes = [f.name for f in schema if f.name in mine and f.name in added
               and f.name != prefix and f.name != config.input.id_column]
    if not clashes or not prefix:
        return schema
    taken = set(schema.names) | mine
    fields = []
    for fld in schema:
        if fld.name in clashes:
            name = f"{prefix}_{fld.name}"
            if name in taken:
                raise InputError(f"the input (an earlier overnight job's output) has columns "
                                 f"{fld.name!r} and {name!r}; this job would add "
                                 f"{fld.name!r} and cannot name the earlier one apart")
            fld = renamed(fld, name)
        fields.append(fld)
    return pa.schema(fields, metadata=schema.metadata)


def check_output_apart(input_path: str, plan: InputPlan, output: Location) -> None:
    """The output, its staging folder and its record must not be, hold or sit inside the
    input: ``--overwrite`` would delete the input, or the next run would read the job's own
    parts as input."""
    own = [output, output.sibling(".partial"), output.sibling(".overnight.json")]
    source = Location.of(input_path)
    folder = source if not _is_glob(source.path) and source.is_dir() else None
    pattern = glob_regex(source.path) if _is_glob(source.path) else None

    def where(loc: Location) -> str:
        return os.path.realpath(loc.path) if loc.local else str(loc)

    def inside(a: str, b: str) -> bool:
        return a == b or a.startswith(b.rstrip("/") + "/")

    for mine in own:
        if mine.local != source.local:
            continue
        path = where(mine)
        clash = next((f for f in plan.files if inside(where(f), path)), None)
        if clash is None and folder is not None and inside(path, where(folder)):
            clash = folder
        if clash is None and pattern is not None and (
                pattern.fullmatch(mine.path) or pattern.fullmatch(mine.path + "/part-0.parquet")
                or pattern.fullmatch(mine.path + "/part-0.jsonl")):
            clash = source
        if clash is not None:
            raise ConfigError(f"output.path {str(output)!r} overlaps the input ({str(clash)!r}): "
                              "the job would read or replace its own input; write the output "
                              "outside the input's folder")


def _is_glob(path: str) -> bool:
    return any(ch in path for ch in "*?[")


def vllm_engine_options(model, engine, max_model_len: int) -> dict:
    """The in-process engine's options (udfs/engines/vllm_engine.py) from the ``model`` and ``engine``
    sections, reasoning aside; a LoRA adapter each checked against the model
    (pipelines/plan/adapters.py). ``overnight serve`` starts its resident engine from them."""
    return {
        "max_model_len": max_model_len,
        "dtype": model.dtype,
        "tensor_parallel_size": model.tensor_parallel_size,
        "pipeline_parallel_size": model.pipeline_parallel_size,
        "trust_remote_code": model.trust_remote_code,
        **engine.model_dump(exclude={"kind", *RECOVERY_SETTINGS}),
        **(check_adapters(model) if model.adapters else {}),
    }


def _http_engine_options(config: JobConfig) -> dict:
    """The server must be up and serve the model, now, not hours into the job."""
    import os

    import httpx

    from udfs.engines.http_engine import Secret, list_models

    engine = config.engine
    api_key = None
    if engine.api_key_env:
        api_key = (os.environ.get(engine.api_key_env) or "").strip()
        if not api_key:
            raise ConfigError(f"engine.api_key_env: the environment variable "
                              f"{engine.api_key_env!r} is not set")
        if not api_key.isprintable() or " " in api_key:  # never shown: it is the secret
            raise ConfigError(f"engine.api_key_env: the key in {engine.api_key_env!r} holds "
                              "spaces or control characters; an API key is one printable word")
    served = engine.model or config.model.name
    shown = redact(engine.base_url)
    try:
        models = list_models(engine.base_url, api_key)
    except httpx.HTTPStatusError as exc:
        raise JobError(f"engine.base_url {shown}: GET /models answered "
                       f"{exc.response.status_code}"
                       + (" (check the API key)" if exc.response.status_code in (401, 403)
                          else "")) from None
    except (httpx.HTTPError, ValueError) as exc:
        raise JobError(f"engine.base_url {shown}: cannot reach the server "
                       f"({type(exc).__name__}: {one_line(exc, 160)})") from None
    if served not in models:
        raise JobError(f"engine.model {served!r} is not served at {shown}; it "
                       f"serves: {', '.join(map(str, models)) or 'nothing'}")
    return {**engine.model_dump(exclude={"kind", "model", "api_key_env", *RECOVERY_SETTINGS}),
            "served_model": served, "api_key": Secret(api_key) if api_key else None,
            "served_models": models}


def _structured(config: JobConfig) -> StructuredSpec | None:
    """The structured-output spec, its JSON Schema loaded and checked."""
    if config.structured is None:
        return None
    return structured_spec(config.structured, config.output.parsed_column)


def structured_spec(section, parsed_column: str, key: str = "structured",
                    arrays: bool = False) -> StructuredSpec:
    """A structured section as a spec, its JSON Schema loaded and checked; ``key`` names the
    section in an error."""
    schema = section.json_schema
    if isinstance(schema, str):
        try:
            schema = json.loads(Path(schema).read_text(encoding="utf-8"))
        except OSError as exc:
            raise ConfigError(f"{key}.json_schema: cannot read {schema!r}: "
                              f"{exc.strerror}") from None
        except json.JSONDecodeError as exc:
            raise ConfigError(f"{key}.json_schema: {schema} line {exc.lineno}: "
                              f"not valid JSON: {exc.msg}") from None
    spec = StructuredSpec(json_schema=schema,
                          choice=tuple(section.choice) if section.choice else None,
                          regex=section.regex, parsed_column=parsed_column)
    which = "json_schema" if schema is not None else "choice" if section.choice else "regex"
    try:
        spec.check(arrays)
    except SchemaError as exc:
        raise ConfigError(f"{key}.{which}: {exc}") from None
    return spec


def _compile(template: str, key: str = "prompt.template"):
    try:
        return compile_template(template)
    except TemplateError as exc:
        line = f" (template line {exc.lineno})" if exc.lineno else ""
        raise ConfigError(f"{key} does not parse{line}: {exc}") from None


# The most rows of the first block a template is tried on before a job starts
TEMPLATE_TRIALS = 20


def _check_template_renders(config: JobConfig, plan: InputPlan, variables: list[str]) -> None:
    """A template that fails on every row (an attribute the sandbox forbids, arithmetic on a
    text column) is the job's mistake, not the rows': say so now, in one line, rather than
    start an engine and write a row error for each row of the table. Tried on the first
    block's rows, up to TEMPLATE_TRIALS of them, skipping rows with a null where
    ``prompt.on_null`` makes that the row's own error. One row that renders, or fewer than 3
    tried, and the job goes on (a row that fails is kept with its error)."""
    if not plan.blocks:
        return
    prompt = config.prompt
    template, _ = compile_template(prompt.template)
    table = read_block(plan.blocks[0], plan.schema)
    key = config.input.id_column if config.input.id_column in table.column_names \
        else columns.ORDINAL
    keys = table.column(key).to_pylist()
    tried, first = 0, None
    for i, row in enumerate(table.select(variables).to_pylist()):
        if any(value is None for value in row.values()):
            if prompt.on_null == "error":
                continue
            row = PromptRenderer.fill_nulls(row)
        try:
            render_template(template, row, prompt.on_null)
            return
        except NullValue:  # a null inside a column: the row's own error, as above
            continue
        except Exception as exc:  # noqa: BLE001 - what the row would get as its error
            tried += 1
            first = first or (keys[i], one_line(exc, 200))
        if tried >= TEMPLATE_TRIALS:
            break
    if tried >= 3:
        raise ConfigError(f"prompt.template fails on each of the {tried} rows tried (the "
                          f"first block's), e.g. row {first[0]!r}: {first[1]}")


def _check_rows_render(config: JobConfig, plan: InputPlan, render: RenderSpec) -> None:
    """Every row tried fails to become a prompt with one and the same error (the model's
    chat template refusing the system message, a string-format template...): the job's
    mistake, one line now, not a row error for each row once an engine has started
    (udfs/stages/prompts.py: rows_fail_alike)."""
    key = config.input.id_column or columns.ORDINAL
    table = read_block(plan.blocks[0], plan.schema)
    failed = rows_fail_alike(render, table, key if key in table.column_names
                             else columns.ORDINAL, TEMPLATE_TRIALS)
    if failed is not None:
        raise ConfigError(f"prompt: each row tried (the first block's) fails to render the "
                          f"same way, e.g. {failed}")


def _check_images(config: JobConfig, plan: InputPlan) -> int:
    """A job with images (any prompt's prompt.images): its columns hold images, the model
    takes them; -> the most images a prompt may hold (0: a job without images)."""
    prompts = [p for p in config.prompts() if p.images]
    if not prompts:
        return 0
    if config.engine.kind == "http" and config.engine.endpoint != "chat":
        raise ConfigError("prompt.images with engine.kind http needs engine.endpoint: chat "
                          "(the images go to the server as data: URLs in the chat messages)")
    for prompt in prompts:
        check_image_columns(prompt, plan.schema)
    if config.engine.kind == "vllm":  # a server's model is the server's to say
        check_model_takes_images(config.model.name, config.model.trust_remote_code)
    sample = read_block(plan.blocks[0], plan.schema) if plan.blocks else None
    return max(max_images(p, sample) for p in prompts)


def _check_columns(config: JobConfig, plan: InputPlan, variables: list[str]) -> None:
    names = plan.schema.names
    missing = [v for v in variables if v not in names]
    if missing:
        raise InputError(f"prompt.template uses column {missing[0]!r}, which the input does "
                         f"not have; its columns are: {', '.join(names)}")
    id_column = config.input.id_column
    if id_column is not None:
        if id_column not in names:
            raise InputError(f"input.id_column {id_column!r} is not a column of the input; "
                             f"its columns are: {', '.join(names)}")
        if plan.ids.nulls:
            raise InputError(f"input.id_column {id_column!r} is null in {plan.ids.nulls} "
                             "row(s)")
        if plan.ids.nan_at is not None:  # NaN equals no other id, not even another NaN
            raise InputError(f"input.id_column {id_column!r} has NaN at row "
                             f"{plan.ids.nan_at} (counting from 0): an id must tell rows "
                             "apart, and NaN equals nothing, itself included")
        repeats, dupes = _repeated_ids(plan, id_column)
        if repeats:
            shown = ", ".join(repr(d) for d in dupes)
            raise InputError(f"input.id_column {id_column!r} is not unique: {repeats} "
                             f"value(s) repeat, e.g. {shown}")
    for key in ("max_tokens_column", "overrides_column"):
        column = getattr(config.sampling, key)
        if column is not None and column not in names:
            raise InputError(f"sampling.{key} {column!r} is not a column of the input; "
                             f"its columns are: {', '.join(names)}")
        if column is not None and not _COLUMN_TYPES[key](plan.schema.field(column).type):
            raise InputError(f"sampling.{key} {column!r} is {plan.schema.field(column).type}; "
                             f"it must hold {_COLUMN_KINDS[key]}")
    for prompt in config.prompts():
        column = prompt.adapter_column
        if column is not None and column not in names:
            raise InputError(f"prompt.adapter_column {column!r} is not a column of the input; "
                             f"its columns are: {', '.join(names)}")
        kind = plan.schema.field(column).type if column is not None else None
        if kind is not None and not (pa.types.is_string(kind) or pa.types.is_large_string(kind)
                                     or pa.types.is_null(kind)):
            raise InputError(f"prompt.adapter_column {column!r} is {kind}; it must hold "
                             "adapter names (strings)")
    clashes = [c for c in config.generated_columns() if c in names]
    if clashes:
        hint = (" (name your id column in input.id_column)" if clashes[0] == columns.ROW_ID
                else " (rename output.column)" if clashes[0] == config.output.column else "")
        raise InputError(f"the input already has a column {clashes[0]!r}, which the job "
                         f"would add{hint}")


_COLUMN_TYPES = {
    "max_tokens_column": lambda t: pa.types.is_integer(t) or pa.types.is_null(t),
    "overrides_column": lambda t: (pa.types.is_string(t) or pa.types.is_large_string(t)
                                   or pa.types.is_struct(t) or pa.types.is_null(t)),
}
_COLUMN_KINDS = {"max_tokens_column": "integers",
                 "overrides_column": "JSON objects (as text) or structs"}


def _repeated_ids(plan: InputPlan, id_column: str, shown: int = 5) -> tuple[int, list]:
    """How many ids repeat, and a few of them. The scan kept 8-byte hashes only; where some
    repeat, the input is read once more (each row decoded once) for the values behind the
    first few (two ids that merely share a hash pass: a 1-in-10^12 chance at 10M rows)."""
    suspects = sorted(plan.ids.repeated())
    import polars as pl

    from udfs.rows import to_polars  # as the scan hashed them (pipelines/read/scan.py: IdDigest)

    for first in range(0, len(suspects), 64):  # a further pass only if all 64 were flukes
        wanted = pl.Series(suspects[first:first + 64], dtype=pl.UInt64)
        counts: Counter = Counter()
        for unit in read_units(plan.blocks):
            for table in read_unit(unit, plan.schema):
                ids = to_polars.series(table.column(id_column)).drop_nulls()
                counts.update(map(_hashable, ids.filter(ids.hash(seed=0).is_in(wanted))
                                  .to_list()))
        found = [v for v, n in counts.items() if n > 1]
        if found:
            exact = len(suspects) <= 64  # else the hashes' count, all but surely right
            return (len(found) if exact else len(suspects)), found[:shown]
    return 0, []


def _hashable(value):
    return json.dumps(value, sort_keys=True, default=str) if isinstance(value, (list, dict)) \
        else value


def _resolve_model(config: JobConfig) -> int:
    """Check that the model's tokenizer loads and settle max_model_len: from the model's
    files where it is a local directory with a tokenizer.json (``_local_model``), else
    through transformers."""
    name, remote_code = config.model.name, config.model.trust_remote_code
    local = None if remote_code else _local_model(name)
    tokenizer = None
    if local is None:
        try:
            tokenizer = load_tokenizer(name, remote_code)
        except Exception as exc:  # transformers raises OSError, ValueError, HF errors...
            raise JobError(f"model.name {name!r}: cannot load its tokenizer: "
                           f"{one_line(exc, 300)}") from None
    chat = local.chat_template if local else bool(getattr(tokenizer, "chat_template", None))
    if any(p.messages_column for p in config.prompts()) and not chat:
        raise ConfigError(f"prompt.messages_column needs a chat model; {name!r} has no "
                          "chat template")
    if config.model.max_model_len is None and local and local.max_position_embeddings:
        return local.max_position_embeddings
    if config.model.max_model_len is not None and config.engine.kind == "vllm":
        # past the model's own limit vLLM refuses it, once an engine has started
        from pipelines.plan.images import read_model_config
        from pipelines.plan.max_model_len import check_max_model_len

        check_max_model_len(name, config.model.max_model_len,
                            read_model_config(name, remote_code),
                            pooling=config.task != "generate")
    # (without a length in config.json, transformers reads the config and the tokenizer)
    return resolve_max_model_len(name, config.model.max_model_len, remote_code, tokenizer)


def _check_engine_args(args: dict) -> None:
    """Each key of ``engine.args`` is one vllm.LLM takes (its own arguments, or
    EngineArgs' fields, where it sends the rest): a misspelt key failed only once an engine
    had started, minutes into a job. Where vLLM is not installed here (a job run on a
    cluster), the engine's own start says."""
    known = vllm_engine_args()
    unknown = [key for key in args if known is not None and key not in known]
    if unknown:
        import difflib

        close = difflib.get_close_matches(unknown[0], sorted(known), n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ConfigError(f"engine.args.{unknown[0]}: not an argument of vllm.LLM or its "
                          f"EngineArgs{hint}")


def _check_reasoning_parser(name: str) -> None:
    """model.reasoning_parser names one of vLLM's reasoning parsers (read from its source,
    as the engine's arguments are): a wrong name is one line listing them, before any
    engine starts."""
    known = vllm_reasoning_parsers()
    if known is not None and name not in known:
        import difflib

        close = difflib.get_close_matches(name, sorted(known), n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ConfigError(f"model.reasoning_parser {name!r} is not one of vLLM's reasoning "
                          f"parsers; {hint}vLLM has: {', '.join(sorted(known))}")


@functools.cache
def vllm_reasoning_parsers() -> frozenset[str] | None:
    """The names vLLM registers its reasoning parsers under (``vllm/reasoning/__init__.py``,
    ``_REASONING_PARSERS_TO_REGISTER``), read from its source, not imported; None where vLLM
    is not installed here or its source is laid out otherwise."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))
        tree = ast.parse((root / "reasoning" / "__init__.py").read_text())
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    for node in tree.body:
        targets = (node.targets if isinstance(node, ast.Assign)
                   else [node.target] if isinstance(node, ast.AnnAssign) else [])
        if any(isinstance(n, ast.Name) and n.id == "_REASONING_PARSERS_TO_REGISTER"
               for n in targets) and isinstance(node.value, ast.Dict):
            names = {k.value for k in node.value.keys if isinstance(k, ast.Constant)}
            return frozenset(names) or None
    return None


@functools.cache
def vllm_engine_args() -> frozenset[str] | None:
    """The keyword arguments vllm.LLM accepts, read from vLLM's source, not imported
    (``import vllm`` takes 7-9 s and torch with it); None where vLLM is not installed or its
    source is not laid out as expected."""
    import ast
    import importlib.util

    try:
        spec = importlib.util.find_spec("vllm")
        root = Path(next(iter(spec.submodule_search_locations)))
        trees = {name: ast.parse((root / path).read_text())
                 for name, path in (("LLM", "entrypoints/llm.py"),
                                    ("EngineArgs", "engine/arg_utils.py"))}
    except (AttributeError, StopIteration, TypeError, OSError, SyntaxError, ValueError):
        return None
    names = set()
    for cls, tree in trees.items():
        body = next((n.body for n in tree.body if isinstance(n, ast.ClassDef)
                     and n.name == cls), None)
        if body is None:
            return None
        for node in body:
            if cls == "EngineArgs" and isinstance(node, ast.AnnAssign) \
                    and isinstance(node.target, ast.Name):
                names.add(node.target.id)
            elif cls == "LLM" and isinstance(node, ast.FunctionDef) and node.name == "__init__":
                names.update(a.arg for a in node.args.args[1:] + node.args.kwonlyargs)
    return frozenset(names) if names else None


@dataclass(frozen=True)
class _LocalModel:
    chat_template: bool
    max_position_embeddings: int | None


def _local_model(name: str) -> _LocalModel | None:
    """What pre-flight needs of a local model directory, read from its files with the
    ``tokenizers`` library alone: the driver starts no engine, and transformers' AutoTokenizer
    imports torch with it (5 s and ~400 MiB of the driver, for a check). The tokenizer is
    loaded, so a broken one is still found here; the engine's replicas load it through
    transformers, as vLLM does. None where the name is no such directory (a hub name, a
    tokenizer without tokenizer.json, a file that is not JSON): transformers then loads it,
    and says what is wrong."""
    folder = Path(name)
    tokenizer_file, settings_file = folder / "tokenizer.json", folder / "tokenizer_config.json"
    if not (tokenizer_file.is_file() and (folder / "config.json").is_file()):
        return None
    try:
        settings = json.loads(settings_file.read_text()) if settings_file.is_file() else {}
        model = json.loads((folder / "config.json").read_text())
    except (OSError, ValueError):
        return None
    if not isinstance(settings, dict) or not isinstance(model, dict):
        return None
    from tokenizers import Tokenizer

    try:
        Tokenizer.from_file(str(tokenizer_file))
    except Exception as exc:  # noqa: BLE001 - the library's own errors: the file is bad
        raise JobError(f"model.name {name!r}: cannot load its tokenizer: "
                       f"{one_line(exc, 300)}") from None
    # where transformers finds a chat template: in tokenizer_config.json, or a file beside it
    chat = bool(settings.get("chat_template")) or any(
        (folder / f).is_file() for f in ("chat_template.jinja", "chat_template.json"))
    length = model.get("max_position_embeddings")
    return _LocalModel(chat, length if isinstance(length, int) and length > 0 else None)


def resolve_max_model_len(name: str, max_model_len: int | None = None,
                          trust_remote_code: bool = False, tokenizer=None) -> int:
    """The model's context length: as configured, else from its config or tokenizer."""
    if max_model_len is not None:
        return max_model_len
    try:
        from transformers import AutoConfig

        hf = AutoConfig.from_pretrained(name, trust_remote_code=trust_remote_code)
        length = getattr(hf, "max_position_embeddings", None)
    except Exception:
        length = None
    if not length and tokenizer is None:
        try:
            tokenizer = load_tokenizer(name, trust_remote_code)
        except Exception as exc:
            raise JobError(f"model {name!r}: cannot load it: "
                           f"{one_line(exc, 300)}") from None
    length = length or getattr(tokenizer, "model_max_length", None)
    if not length or length > 10_000_000:
        raise ConfigError(f"model.max_model_len: cannot tell {name!r}'s context length; set it")
    return int(length)


def _fingerprint(config: JobConfig, plan: InputPlan, max_model_len: int,
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
