"""A job of steps: each step a prompt (and its sampling, structure, filters) over the rows the
steps before it left, on the job's one engine.
"""

from __future__ import annotations

from pydantic import Field, model_validator

from pipelines.config.sections import PromptConfig, SamplingConfig, Strict, StructuredConfig
from udfs import columns


STEP_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class StepConfig(Strict):
    """One step of a job of several (``steps:``): a generation with its own prompt, sampling,
    structured output and column; or, with only ``where``, a filter."""

    name: str = Field(pattern=STEP_NAME, description="The step's name: the report's, and "
                      "its output column's unless ``column`` names another.")
    where: str | None = Field(
        None, description="Only rows for which this condition holds go on to this step; the "
        "rest are dropped here. A polars SQL expression over the columns so far, e.g. "
        "\"judge.score >= 4\" (a struct's field by a dot), \"length(answer) > 20\".")
    prompt: PromptConfig | None = Field(
        None, description="The step's prompt, over the source columns and earlier steps' "
        "columns (a structured step's fields as {{ judge.score }}); none: a filter step.")
    sampling: SamplingConfig = SamplingConfig()
    structured: StructuredConfig | None = None
    column: str | None = Field(
        None, description="The step's output column; default: the step's name.")
    explode: bool = Field(
        False, description="With a structured.json_schema of type array: one row per "
        "element, the element in the step's column and its position in <column>_index.")
    adapter: str | None = Field(
        None, description="The LoRA adapter (one of model.adapters) the step runs on, "
        "unless its prompt.adapter_column names another; default: model.adapter, or the "
        "base model.")

    @model_validator(mode="after")
    def _generates_or_filters(self) -> StepConfig:
        if self.prompt is None:
            if self.where is None:
                raise ValueError("a step needs a prompt (it generates) or a where (it filters)")
            given = [k for k in ("sampling", "structured", "column", "explode")
                     if k in self.model_fields_set] + ["adapter"] * (self.adapter is not None)
            if given:
                raise ValueError(f"{given[0]} does not apply to a step without a prompt (a "
                                 "filter step generates nothing)")
            return self
        if self.prompt.pair_template is not None:
            raise ValueError("prompt.pair_template does not apply to a step (task: score)")
        for key in ("overrides_column", "max_tokens_column"):
            if getattr(self.sampling, key) is not None:
                raise ValueError(f"sampling.{key} does not apply to a step (a job with steps "
                                 "takes its sampling from each step's config)")
        if self.explode and (self.structured is None or self.structured.json_schema is None):
            raise ValueError("explode needs structured.json_schema (of type array)")
        return self

    @property
    def output_column(self) -> str | None:
        return None if self.prompt is None else (self.column or self.name)

    def added_columns(self, thinking: bool = False) -> list[str]:
        """The columns the step adds, in output order. ``thinking`` (the job's model has a
        reasoning parser): its thinking, C_reasoning, after its answer, and the thinking's
        tokens, C_reasoning_tokens, after its completion tokens."""
        c = self.output_column
        if c is None:
            return []
        added = [c, *(columns.step_column(c, m) for m in columns.STEP_META)]
        if thinking:
            added.insert(1, columns.step_column(c, columns.STEP_REASONING))
            added.append(columns.step_column(c, columns.REASONING_TOKENS))
        if self.structured is not None and self.structured.json_schema is not None:
            added.insert(1, columns.step_column(c, "text"))
        if self.explode or self.sampling.n > 1:
            added.insert(0, columns.step_column(c, "index"))
        return added
