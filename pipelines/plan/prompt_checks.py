"""Pre-flight of the prompt: its template parses, and does not fail alike on every row tried
(the job's mistake, said in one line before an engine starts, not a row error on each row).
"""

from __future__ import annotations

from pipelines.config import JobConfig
from pipelines.errors import ConfigError, one_line
from pipelines.read import InputPlan, read_block
from udfs import columns
from udfs.stages.prompts import PromptRenderer, RenderSpec, rows_fail_alike
from udfs.stages.templates import NullValue, TemplateError, compile_template, render_template


def compile_prompt(template: str, key: str = "prompt.template"):
    try:
        return compile_template(template)
    except TemplateError as exc:
        line = f" (template line {exc.lineno})" if exc.lineno else ""
        raise ConfigError(f"{key} does not parse{line}: {exc}") from None


# The most rows of the first block a template is tried on before a job starts
TEMPLATE_TRIALS = 20


def check_template_renders(config: JobConfig, plan: InputPlan, variables: list[str]) -> None:
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


def check_rows_render(config: JobConfig, plan: InputPlan, render: RenderSpec) -> None:
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
