"""The whole job: its sections, and the checks that span them (a pooling task's columns, a
step's references to the steps before it, the settings one engine kind does not take).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field, model_validator

from pipelines.config.engine import EngineConfig, VLLMEngineConfig
from pipelines.config.sections import (InputConfig, ModelConfig, OutputConfig, PromptConfig,
                                       ReportConfig, ResourcesConfig, SamplingConfig, Strict,
                                       StructuredConfig)
from pipelines.config.steps import StepConfig
from udfs import columns


POOLING_TASKS = ("embed", "score", "classify")
# the output column a task writes unless output.column names another
DEFAULT_COLUMN = {"embed": "embedding", "score": "score", "classify": "label"}


class JobConfig(Strict):
    task: Literal["generate", "embed", "score", "classify"] = Field(
        "generate", description="generate: text from a prompt; embed: a vector per row; "
        "score: a float per pair of texts (a cross-encoder or reward model); classify: the "
        "top label and a probability per label (a sequence-classification model).")
    input: InputConfig
    model: ModelConfig
    prompt: PromptConfig | None = Field(
        None, description="The job's prompt; a job of several steps gives each step its own.")
    steps: list[StepConfig] | None = Field(
        None, min_length=1, description="A job of several steps, run in order on each row by "
        "one engine: generate, judge, filter (udfs/stages/steps.py).")
    sampling: SamplingConfig = SamplingConfig()
    output: OutputConfig
    structured: StructuredConfig | None = None
    engine: EngineConfig = VLLMEngineConfig()
    resources: ResourcesConfig = ResourcesConfig()
    report: ReportConfig = ReportConfig()

    @model_validator(mode="before")
    @classmethod
    def _engine_kind_defaults_to_vllm(cls, raw):
        if isinstance(raw, dict) and isinstance(raw.get("engine"), dict):
            raw = {**raw, "engine": {"kind": "vllm", **raw["engine"]}}
        return raw

    @model_validator(mode="before")
    @classmethod
    def _task_names_its_column(cls, raw):
        task = raw.get("task") if isinstance(raw, dict) else None
        output = raw.get("output") if isinstance(raw, dict) else None
        if task in DEFAULT_COLUMN and isinstance(output, dict) and "column" not in output:
            raw = {**raw, "output": {**output, "column": DEFAULT_COLUMN[task]}}
        return raw

    @model_validator(mode="after")
    def _prompt_or_steps(self) -> JobConfig:
        if (self.prompt is None) == (self.steps is None):
            raise ValueError("give exactly one of prompt (a job of one step) and steps")
        if self.steps is None:
            if self.output.keep_dropped:
                raise ValueError("output.keep_dropped applies to a job with steps (only a "
                                 "step's filter drops rows); remove it")
            return self
        if self.task != "generate":
            raise ValueError(f"steps does not apply to task: {self.task} (steps generate)")
        wrong = [f"sampling.{k}" for k in _changed(self.sampling)]
        wrong += ["structured"] * (self.structured is not None)
        wrong += [f"output.{k}" for k in ("column", "parsed_column", "dedupe", "logprobs",
                                           "logprobs_column", "confidence_column",
                                           "reasoning_column")
                  if k in _changed(self.output)]
        if wrong:
            raise ValueError(f"{wrong[0]} does not apply to a job with steps; give each "
                             "step its own (steps[].sampling, steps[].structured, "
                             "steps[].column)")
        names, taken = set(), set(columns.GENERATED) | {columns.DROPPED_BY, columns.ROW_ID}
        thinking = self.model.reasoning_parser is not None
        if thinking:
            taken.add(columns.REASONING_TOKENS)
        for i, step in enumerate(self.steps):
            if step.name in names:
                raise ValueError(f"steps[{i}].name {step.name!r} is used by an earlier step")
            names.add(step.name)
            for name in step.added_columns(thinking):
                if name in taken:
                    raise ValueError(f"steps[{i}] ({step.name}) would add a column {name!r}, "
                                     "which the job already has; name the step or its "
                                     "column another way")
                taken.add(name)
        if all(step.prompt is None for step in self.steps):
            raise ValueError("steps: no step has a prompt (the job would generate nothing)")
        return self

    @model_validator(mode="after")
    def _pooling_settings_apply(self) -> JobConfig:
        """Settings that cannot apply to the task: one line naming the first, not ignored."""
        if self.steps is not None:
            return self
        task = self.task
        wrong = []
        if task != "generate":
            # (embed: a row's own dimensions may come from sampling.overrides_column)
            wrong += [f"sampling.{k}" for k in _changed(self.sampling)
                      if not (task == "embed" and k == "overrides_column")]
            wrong += ["structured"] * (self.structured is not None)
            wrong += [f"output.{k}" for k in ("parsed_column", "dedupe", "logprobs",
                                               "logprobs_column", "confidence_column")
                      if k in _changed(self.output)]
            wrong += [f"prompt.{k}" for k in ("messages_column", "system")
                      if getattr(self.prompt, k) is not None]
        if task != "score" and self.prompt.pair_template is not None:
            wrong.append("prompt.pair_template")
        if task != "embed":
            wrong += [f"output.{k}" for k in ("normalize", "dimensions")
                      if k in _changed(self.output)]
        if task != "classify" and self.output.labels is not None:
            wrong.append("output.labels")
        if wrong:
            what = ("no text is generated" if task != "generate"
                    else "it is for another task")
            raise ValueError(f"{wrong[0]} does not apply to task: {task} ({what}); remove it")
        if task == "score" and self.prompt.pair_template is None:
            raise ValueError("task: score needs prompt.pair_template (the document side; "
                             "prompt.template is the query side)")
        if task != "generate" and self.engine.kind == "http" and (
                self.engine.endpoint == "chat" or task == "score"
                and self.prompt.on_too_long == "truncate"):
            key = ("engine.endpoint: chat" if self.engine.endpoint == "chat"
                   else "prompt.on_too_long: truncate")
            raise ValueError(f"{key} does not apply to task: {task} through a server (it "
                             "pools token ids, and tokenizes a pair itself); remove it")
        return self

    @model_validator(mode="after")
    def _reasoning_applies(self) -> JobConfig:
        """A reasoning parser splits generated text: one line where there is none to split,
        or where overnight cannot split it yet."""
        if self.model.reasoning_parser is None:
            if "reasoning_column" in _changed(self.output):
                raise ValueError("output.reasoning_column needs model.reasoning_parser")
            return self
        if self.task != "generate":
            raise ValueError(f"model.reasoning_parser does not apply to task: {self.task} "
                             "(no text is generated); remove it")
        if self.engine.kind == "http":
            raise ValueError("model.reasoning_parser does not apply to engine.kind: http yet: "
                             "start the server with --reasoning-parser, and read its answer "
                             "as the server sends it")
        return self

    @model_validator(mode="after")
    def _adapters_apply(self) -> JobConfig:
        """LoRA adapters: declared where they are used, with what the engine needs."""
        names = self.model.adapters or {}
        uses = [(f"steps[{i}].adapter", step.adapter) for i, step in enumerate(self.steps or ())
                if step.adapter is not None]
        for key, name in uses:
            if name not in names:
                raise ValueError(f"{key} {name!r} is not one of model.adapters"
                                 + (f" ({', '.join(names)})" if names else " (none are given)"))
        column = next((p.adapter_column for p in self.prompts() if p.adapter_column), None)
        if column is not None and not names:
            raise ValueError("prompt.adapter_column needs model.adapters (the adapters its "
                             "values name)")
        if not names:
            return self
        if self.task != "generate":
            raise ValueError(f"model.adapters does not apply to task: {self.task} (LoRA "
                             "adapters here are for generation)")
        if self.engine.kind == "vllm":
            missing = next((n for n, path in names.items() if not path), None)
            if missing is not None:
                raise ValueError(f"model.adapters.{missing}: give the adapter's directory "
                                 "(the engine loads it)")
        return self

    @model_validator(mode="after")
    def _truncation_needs_tokens(self) -> JobConfig:
        # the server applies the chat template to whole messages: a prompt cut to fit as
        # tokens cannot be sent as messages
        chat = self.engine.kind == "http" and self.engine.endpoint == "chat"
        if chat and any(p.chat_template_kwargs for p in self.prompts()):
            raise ValueError("prompt.chat_template_kwargs needs engine.endpoint: completions "
                             "(with endpoint: chat the server applies its own template)")
        if chat and any(p.on_too_long == "truncate" for p in self.prompts()):
            raise ValueError("prompt.on_too_long: truncate needs engine.endpoint: completions "
                             "(with endpoint: chat the server gets whole messages); or use "
                             "on_too_long: error or skip")
        return self

    @model_validator(mode="after")
    def _reuse_applies(self) -> JobConfig:
        """output.reuse: what a row's request key covers today (pipelines/reuse/carry.py)."""
        if not (self.output.reuse or self.output.reuse_from):
            return self
        what = (f"task: {self.task}" if self.task != "generate"
                else "output.dedupe (a row's samples are carried over whole)"
                if self.output.dedupe else None)
        if what is not None:
            key = "output.reuse_from" if self.output.reuse_from else "output.reuse"
            raise ValueError(f"{key} does not apply to {what} yet; run it without reuse")
        return self

    @model_validator(mode="after")
    def _tools_apply(self) -> JobConfig:
        """Tools go with a one-step generate job; a named choice is the job's structure."""
        for i, prompt in enumerate(p for p in self.prompts() if p is not None):
            tools = prompt.tools is not None or prompt.tools_column is not None
            if tools and self.steps is not None:
                raise ValueError(f"steps[{i}].prompt.tools: tools in a job of steps are not "
                                 "supported yet; run the tool step as a job of its own")
        if self.prompt is None or self.prompt.tools is None:
            return self
        if self.task != "generate":
            raise ValueError(f"prompt.tools does not apply to task: {self.task}; remove it")
        if self.structured is not None and self.prompt.forced_tool() is not None:
            raise ValueError("structured does not go with a named prompt.tool_choice, which "
                             "holds the output to the function's parameters; remove one")
        return self

    @model_validator(mode="after")
    def _output_column_free(self) -> JobConfig:
        if self.output.column in columns.GENERATED:
            raise ValueError(
                f"output.column {self.output.column!r} is reserved; choose another name"
            )
        if self.output.parsed_column in (*columns.GENERATED, self.output.column):
            raise ValueError(f"output.parsed_column {self.output.parsed_column!r} is taken; "
                             "choose another name")
        taken = [*columns.GENERATED, columns.REASONING_TOKENS, self.output.column,
                 self.output.parsed_column]
        for key in ("logprobs_column", "confidence_column", "reasoning_column",
                    "tool_calls_column"):
            name = getattr(self.output, key)
            if name is not None and name in taken:
                raise ValueError(f"output.{key} {name!r} is taken; choose another name")
            taken.append(name)
        return self

    def prompts(self) -> list[PromptConfig]:
        """The job's prompt, or each generating step's."""
        if self.steps is None:
            return [self.prompt]
        return [step.prompt for step in self.steps if step.prompt is not None]

    def logprobs_column(self) -> str | None:
        """The logprobs column, when the job writes one: asked for, or rows may ask."""
        return self.output.logprobs_column if self.output.logprobs is not None else None

    def reasoning_column(self) -> str | None:
        """The thinking's column, with a reasoning parser."""
        return self.output.reasoning_column if self.model.reasoning_parser else None

    def tool_calls_column(self) -> str | None:
        """The tool calls' column, in a job whose rows have tools."""
        tools = self.prompt is not None and (self.prompt.tools is not None
                                             or self.prompt.tools_column is not None)
        return self.output.tool_calls_column if tools else None

    def parses_output(self) -> bool:
        """Whether output.parsed_column is written: structured.json_schema, or a named
        tool_choice whose function has parameters (its arguments, parsed)."""
        if self.structured is not None and self.structured.json_schema is not None:
            return True
        forced = self.prompt.forced_tool() if self.prompt is not None else None
        return bool(forced and forced["parameters"])

    def confidence_column(self) -> str | None:
        """The confidence column, with structured.choice."""
        choice = self.structured is not None and self.structured.choice is not None
        return self.output.confidence_column if choice else None

    def generated_columns(self) -> list[str]:
        """The columns the job adds to every source row, in output order."""
        if self.steps is not None:
            thinking = self.model.reasoning_parser is not None
            added = [c for step in self.steps for c in step.added_columns(thinking)]
            totals = list(columns.GENERATED)
            if thinking:  # the row's thinking tokens over its steps
                totals.insert(totals.index(columns.COMPLETION_TOKENS) + 1,
                              columns.REASONING_TOKENS)
            added += [columns.DROPPED_BY] * self.output.keep_dropped + totals
            return [*([columns.ROW_ID] if self.input.id_column is None else []), *added,
                    columns.REQUEST_KEY]
        if self.task != "generate":
            return self._pooling_columns()
        added = [self.output.column, *columns.GENERATED]
        if self.parses_output():
            added.insert(1, self.output.parsed_column)
        if self.tool_calls_column() is not None:
            added.insert(added.index(columns.FINISH_REASON), self.tool_calls_column())
        if self.reasoning_column() is not None:  # the thinking after the answer's columns
            added.insert(added.index(columns.FINISH_REASON), self.reasoning_column())
            added.insert(added.index(columns.COMPLETION_TOKENS) + 1, columns.REASONING_TOKENS)
        if self.prompt.images:  # before error_kind: after the token counts
            at = added.index(columns.ERROR_KIND)
            added[at:at] = [columns.IMAGE_COUNT, columns.IMAGE_TOKENS]
        for scores in (self.confidence_column(), self.logprobs_column()):
            if scores is not None:
                added.insert(added.index(columns.FINISH_REASON), scores)
        if self.sampling.n > 1 or self.sampling.overrides_column:
            added.insert(0, columns.SAMPLE_INDEX)
        if self.input.id_column is None:
            added.insert(0, columns.ROW_ID)
        return [*added, columns.REQUEST_KEY]


    def _pooling_columns(self) -> list[str]:
        """embed and score: one column; classify: the top label, then prob_<label> per label
        (output.labels, which pre-flight fills in from the model when not set)."""
        added = [self.output.column, *columns.GENERATED]
        if self.task == "classify":
            added[1:1] = [columns.PROBABILITY_PREFIX + label
                          for label in self.output.labels or ()]
        if self.input.id_column is None:
            added.insert(0, columns.ROW_ID)
        return added


def _changed(section: BaseModel) -> list[str]:
    """The keys of a section set to something other than their default. Not
    ``model_fields_set``: a config dumped and loaded again (``model_dump``) sets every key."""
    fields = type(section).model_fields
    return sorted(k for k, f in fields.items()
                  if getattr(section, k) != f.get_default(call_default_factory=True))
