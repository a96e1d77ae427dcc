"""Pre-flight of a job of several steps: each step checked against the columns it will see.

A step sees the source columns and the columns of the steps before it. Its template's
variables and its filter's columns must be among them, its filter must be a condition on them
(it is evaluated once here on an empty table of their types, so a type error is found now,
not hours into the job), and its structured output must be usable. Each step becomes a
``StepSpec`` (udfs/stages/steps.py) with its own ``RenderSpec`` and ``SamplingSpec``.

Filters are polars SQL expressions (``pl.sql_expr``): SQL's small language of comparisons,
AND/OR/NOT, IN, LIKE, arithmetic and functions such as ``length``, which users know; polars
evaluates it vectorized over a block, on the columns it names only, and it reads a struct's
field by a dot (``judge.score >= 4``). A row's values are data it reads, never code it runs.
A row whose values the filter cannot be evaluated on (``CAST(rating AS INTEGER)`` over a
rating of "good") is kept with that error (``filter_error``), not dropped: the job goes on.
"""

from __future__ import annotations

import pyarrow as pa

from pipelines.plan.adapters import adapter_sampling
from pipelines.config import JobConfig, StepConfig
from pipelines.errors import ConfigError, InputError, did_you_mean, one_line
from pipelines.plan.images import image_spec
from pipelines.plan.specs import section_sampling
from udfs import columns
from udfs.rows import to_polars
from udfs.rows.parsers import StructuredSpec
from udfs.stages.predictor import SamplingSpec
from udfs.stages.prompts import RenderSpec
from udfs.stages.templates import TemplateError, compile_template
from udfs.stages.steps import KEY, PARSED, StepSpec, step_types


def plan_steps(config: JobConfig, schema: pa.Schema, max_model_len: int,
               structured_spec, sample: pa.Table | None = None) -> tuple[StepSpec, ...]:
    """The steps as specs; ConfigError / InputError naming the step and key on a problem.
    ``structured_spec(section, parsed_column, key)`` is pre-flight's own check of a
    structured section; ``sample``: the input's first block, a filter on source columns is
    tried on."""
    fields = {f.name: f.type for f in schema if not f.name.startswith(columns.INTERNAL_PREFIX)}
    source = set(fields)
    specs = []
    for i, step in enumerate(config.steps):
        where = f"steps[{i}] ({step.name})"
        if step.where is not None:
            names = _check_where(step.where, fields, where)
            if sample is not None and set(names) <= source:
                _try_where(step.where, sample, where, config.input.id_column)
        if step.prompt is None:
            specs.append(StepSpec(name=step.name, where=step.where))
            continue
        _check_prompt(step, fields, where, config)
        if step.sampling.max_tokens >= max_model_len:
            # (named as --set takes it: steps.0.sampling..., and each step's is its own)
            raise ConfigError(f"{where}: sampling.max_tokens {step.sampling.max_tokens} leaves "
                              f"no room for a prompt in max_model_len {max_model_len}; lower "
                              f"it (e.g. --set steps.{i}.sampling.max_tokens="
                              f"{max(1, max_model_len // 2)}) or raise model.max_model_len")
        structured = _step_structured(step, where, structured_spec)
        spec = _step_spec(config, i, step, max_model_len, structured)
        specs.append(spec)
        fields.update(step_types(spec))
    return tuple(specs)


def _step_structured(step: StepConfig, where: str, structured_spec) -> StructuredSpec | None:
    """A step's structured output, checked; an exploded step's must be a JSON array."""
    if step.structured is None:
        return None
    structured = structured_spec(step.structured, PARSED, f"{where}: structured", arrays=True)
    if step.explode and step.structured.json_schema is not None and \
            structured.json_schema.get("type") != "array":
        raise ConfigError(f"{where}: explode needs structured.json_schema of type "
                          f"array (got {structured.json_schema.get('type')!r})")
    return structured


def _step_spec(config: JobConfig, i: int, step: StepConfig, max_model_len: int,
               structured: StructuredSpec | None) -> StepSpec:
    """A generating step's spec: its own prompt, sampling and structured output."""
    p, s = step.prompt, step.sampling
    render = RenderSpec(
        template=p.template, tokenizer=config.model.name, max_model_len=max_model_len,
        max_tokens=s.max_tokens, system=p.system, chat=p.chat if p.chat is not None else True,
        on_too_long=p.on_too_long, on_null=p.on_null,
        trust_remote_code=config.model.trust_remote_code, messages_column=p.messages_column,
        keep_messages=config.engine.kind == "http" and config.engine.endpoint == "chat",
        chat_template_kwargs=p.chat_template_kwargs,
        images=image_spec(p, config.input.path),
        chat_template_content_format=p.chat_template_content_format)
    sampling = SamplingSpec(
        max_tokens=s.max_tokens, **section_sampling(s), key_column=KEY,
        structured=structured.engine_params() if structured else None, n=s.n,
        # a thinking model's: the step's thinking in C_reasoning (udfs/stages/steps.py)
        reasoning_column=(columns.step_column(step.output_column, columns.STEP_REASONING)
                          if config.model.reasoning_parser else None),
        budget_key=f"steps.{i}.sampling.max_tokens",
        **adapter_sampling(config, p, step.adapter))
    return StepSpec(name=step.name, column=step.output_column, where=step.where,
                    render=render, sampling=sampling, structured=structured,
                    explode=step.explode, fan_out=step.explode or s.n > 1)


def _check_prompt(step: StepConfig, fields: dict, where: str, config: JobConfig) -> None:
    if step.prompt.messages_column is not None:
        variables = [step.prompt.messages_column]
    else:
        try:
            _, variables = compile_template(step.prompt.template)
        except TemplateError as exc:
            line = f" (template line {exc.lineno})" if exc.lineno else ""
            raise ConfigError(f"{where}: prompt.template does not parse{line}: {exc}") from None
    missing = [v for v in variables if v not in fields]
    if missing:
        thinking = config.model.reasoning_parser is not None
        later = [s.name for s in config.steps if missing[0] in s.added_columns(thinking)]
        why = (f"a column of step {later[0]!r}, which comes later" if later
               else "not a column of the input or of an earlier step"
               + did_you_mean(missing[0], fields))
        raise InputError(f"{where}: prompt uses {missing[0]!r}: {why}; the step can use: "
                         f"{', '.join(fields)}")


def _check_where(expression: str, fields: dict, where: str) -> list[str]:
    """The filter parses, names only columns it can see, and is a condition on them."""
    import polars as pl

    try:
        expr = pl.sql_expr(expression)
        names = expr.meta.root_names()
    except Exception as exc:  # polars' SQL parser: SQLSyntaxError, SQLInterfaceError...
        raise ConfigError(f"{where}: where {expression!r} does not parse: "
                          f"{one_line(exc)}") from None
    missing = [n for n in names if n not in fields]
    if missing:
        raise InputError(f"{where}: where uses {missing[0]!r}, which is not a column of the "
                         f"input or of an earlier step{did_you_mean(missing[0], fields)}; it "
                         f"can use: {', '.join(fields)}")
    unreadable = next((n for n in names if to_polars.as_text(fields[n])), None)
    if unreadable is not None:
        raise InputError(f"{where}: where uses {unreadable!r}, a {fields[unreadable]} column, "
                         "which the filter (polars) can read only as text; write it as "
                         "decimal128 (up to 38 digits), a float or a string")
    empty = to_polars.frame(pa.schema([(n, fields[n]) for n in names]).empty_table()) \
        if names else pl.DataFrame()
    try:
        kind = empty.select(expr).to_series().dtype if names else None
    except (Exception, pl.exceptions.PanicException) as exc:  # a type error: "judge > 4"
        # on a struct, say
        raise ConfigError(f"{where}: where {expression!r} cannot be evaluated on these "
                          f"columns: {one_line(exc)}") from None
    if kind is not None and kind != pl.Boolean:
        raise ConfigError(f"{where}: where {expression!r} is a {kind}, not a condition "
                          "(true or false for each row)")
    return names


FILTER_TRIALS = 20  # the most rows of the first block a filter on source columns is tried on


def _try_where(expression: str, sample: pa.Table, where: str, id_column: str | None) -> None:
    """A filter that cannot be evaluated on any row tried (``CAST(rating AS INTEGER)`` where
    every rating is a word) is the job's mistake, not the rows': say so now, in one line,
    rather than start an engine and give each row of the table a filter_error. One row it
    holds or not for, or fewer than 3 tried, and the job goes on."""
    from udfs.stages.where import where_mask

    rows = sample.slice(0, FILTER_TRIALS)
    _, failed = where_mask(rows, expression)
    if rows.num_rows >= 3 and len(failed) == rows.num_rows:
        key = id_column if id_column in rows.column_names else columns.ORDINAL
        first = rows.column(key)[0].as_py()
        raise ConfigError(f"{where}: where {expression!r} cannot be evaluated on any of the "
                          f"{rows.num_rows} rows tried (the first block's), e.g. row "
                          f"{first!r}: {failed[0]}")
