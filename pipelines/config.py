"""The job config: one validated pydantic model, loaded from YAML in one place.

Unknown keys are errors that name the key; every error is reported as one line.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Literal

import yaml
from pydantic import (BaseModel, ConfigDict, Field, ValidationError, field_validator,
                      model_validator)

from pipelines.errors import ConfigError
from udfs import columns


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class InputConfig(_Strict):
    path: str = Field(description="A Parquet or JSONL file, a directory of them, or a glob.")
    format: Literal["auto", "parquet", "jsonl"] = Field(
        "auto", description="File format; 'auto' goes by the file extension."
    )
    id_column: str | None = Field(
        None, description="A unique column that identifies a row; without it a row_id is added."
    )


class ModelConfig(_Strict):
    name: str = Field(description="A Hugging Face model name or a local model directory.")
    max_model_len: int | None = Field(
        None, gt=0, description="Context length (prompt + output); default: the model's own."
    )
    dtype: str = Field("auto", description="Weights dtype: auto, float32, bfloat16, float16.")
    tensor_parallel_size: int = Field(1, ge=1, description="GPUs each engine spreads over.")
    pipeline_parallel_size: int = Field(
        1, ge=1, description="Pipeline stages per engine; an engine holds tensor_parallel_size "
        "x pipeline_parallel_size GPUs, reserved together on one node.")
    trust_remote_code: bool = Field(False, description="Allow the model's own Python code.")


class _EngineRecovery(_Strict):
    """What happens when an engine dies (udfs/recovery.py): it is replaced, its blocks
    retried, rows that kill engines isolated."""

    max_restarts: int = Field(
        32, ge=0, description="Engine deaths a job survives (each replaced, its blocks "
        "retried); one more stops the job. Isolating a poison row costs up to ~9 deaths.")
    stall_timeout_s: float = Field(
        600.0, gt=0, description="An in-process engine that holds unfinished requests but "
        "finishes no step for this long counts as dead: replaced, its blocks retried.")


class VLLMEngineConfig(_EngineRecovery):
    kind: Literal["vllm"] = "vllm"
    kv_cache_memory_bytes: int | None = Field(
        None, gt=0,
        description="KV-cache size in bytes; required on CPU (default there: 1 GiB), "
        "on a GPU vLLM sizes it from gpu_memory_utilization.",
    )
    gpu_memory_utilization: float = Field(0.9, gt=0, le=1)
    enforce_eager: bool | None = Field(
        None, description="Skip graph capture / torch.compile; default: true on CPU."
    )
    multiprocessing: bool | None = Field(
        None,
        description="Run the engine core in its own process (vLLM's default); "
        "default: true on a GPU, false on CPU where the two processes fight for cores.",
    )
    cpu_threads: int | None = Field(
        None, gt=0,
        description="On CPU: the engine's compute threads; default: the node's cores shared "
        "among the replicas on it (Ray would give each actor as many threads as the whole "
        "CPUs it reserved).",
    )
    structured_outputs: dict[str, Any] = Field(
        default_factory=lambda: {"backend": "guidance", "disable_any_whitespace": True},
        description="vLLM's structured_outputs_config. The default, guidance without "
        "whitespace, keeps JSON compact and valid where vLLM's default lets a weak model pad "
        "it with whitespace until max_tokens.",
    )
    args: dict[str, Any] = Field(
        default_factory=dict, description="Further keyword arguments passed verbatim to vllm.LLM."
    )


class HTTPEngineConfig(_EngineRecovery):
    """Any OpenAI-compatible server as the engine (vllm serve, SGLang, llama.cpp, Ollama)."""

    kind: Literal["http"]
    base_url: str = Field(description="The server's API root, e.g. http://127.0.0.1:8000/v1.")
    model: str | None = Field(
        None, description="The name the server serves the model under; default: model.name "
        "(which still names the tokenizer, loaded locally to count and check prompts).")
    endpoint: Literal["completions", "chat"] = Field(
        "completions", description="completions: send the prompt as token ids, exactly as "
        "the in-process engine would; chat: send messages, the server applies its template.")
    api_key_env: str | None = Field(
        None, description="The environment variable holding the API key (never logged).")
    max_concurrency: int = Field(64, ge=1, description="Requests in flight per replica.")
    timeout_s: float = Field(600.0, gt=0, description="Per-request timeout.")
    max_retries: int = Field(5, ge=0, description="Retries of a connection error, 429 or 5xx.")
    backoff_s: float = Field(1.0, gt=0, description="First retry delay; doubles each retry.")


EngineConfig = Annotated[VLLMEngineConfig | HTTPEngineConfig, Field(discriminator="kind")]


class PromptConfig(_Strict):
    template: str | None = Field(
        None, description="Jinja template over the row's columns, e.g. 'Title: {{ title }}'."
    )
    messages_column: str | None = Field(
        None, description="Instead of a template: a column holding each row's chat "
        "messages, a list of {role, content} (or that list as a JSON string), for "
        "conversations assembled upstream; a plain string there is a raw prompt, sent "
        "without the chat template.")
    pair_template: str | None = Field(
        None, description="task: score: the second text of each pair (the document; "
        "template is the query), a Jinja template over the row's columns.")
    system: str | None = Field(None, description="System message (chat models).")
    chat: bool | None = Field(
        None, description="Apply the model's chat template when it has one; default: yes "
        "for task: generate, no for a pooling task (the text is embedded as it is).")
    on_too_long: Literal["error", "skip", "truncate"] = Field(
        "error",
        description="A prompt that cannot fit max_model_len with max_tokens: mark the row "
        "with an error, skip it (no generation, no error), or cut tokens from its middle.",
    )
    on_null: Literal["error", "empty"] = Field(
        "error", description="A null in a template column: a row error, or an empty string."
    )

    @model_validator(mode="after")
    def _template_or_messages(self) -> PromptConfig:
        if (self.template is None) == (self.messages_column is None):
            raise ValueError("give exactly one of template, messages_column")
        return self


class SamplingConfig(_Strict):
    temperature: float = Field(1.0, ge=0, le=2, description="0 is greedy; vLLM allows "
                               "at most 2.")
    top_p: float = Field(1.0, gt=0, le=1)
    top_k: int | None = Field(None, ge=1)
    max_tokens: int = Field(256, gt=0)
    max_tokens_column: str | None = Field(
        None, description="A column holding each row's own max_tokens (at most max_tokens; "
        "null: max_tokens).")
    overrides_column: str | None = Field(
        None, description="A column of JSON objects overriding sampling per row: "
        "temperature, top_p, seed, stop, n, json_schema (Batch files use it).")
    n: int = Field(1, ge=1, description="Samples per input row: one output row each, with a "
                   "sample_index; each sample's seed derives from the job seed and the row id.")
    min_tokens: int = Field(0, ge=0)
    seed: int = Field(0, description="Job seed; each row's seed derives from it and the row id.")
    stop: list[str] = Field(default_factory=list)
    ignore_eos: bool = Field(False, description="Generate exactly max_tokens (benchmarks).")
    repetition_penalty: float = Field(
        1.0, gt=0, le=2, description="vLLM's repetition penalty: above 1 discourages "
        "tokens already in the prompt or output; 1 is off.")
    presence_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI's presence "
                                    "penalty; 0 is off.")
    frequency_penalty: float = Field(0.0, ge=-2, le=2, description="OpenAI's frequency "
                                     "penalty; 0 is off.")
    stop_token_ids: list[int] = Field(
        default_factory=list, description="Token ids that end a generation, beside EOS.")


class StructuredConfig(_Strict):
    json_schema: dict[str, Any] | str | None = Field(
        None, description="A JSON Schema (inline, or the path of a .json file); the output "
        "is parsed into a struct column typed by it.")
    choice: list[str] | None = Field(None, description="The allowed outputs, e.g. labels.")
    regex: str | None = Field(None, description="A regex the whole output must match.")

    @model_validator(mode="after")
    def _exactly_one(self) -> StructuredConfig:
        given = [k for k in ("json_schema", "choice", "regex") if getattr(self, k) is not None]
        if len(given) != 1:
            raise ValueError("give exactly one of json_schema, choice, regex"
                             + (f" (got {', '.join(given)})" if given else ""))
        return self


STEP_NAME = r"^[A-Za-z_][A-Za-z0-9_]*$"


class StepConfig(_Strict):
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

    @model_validator(mode="after")
    def _generates_or_filters(self) -> StepConfig:
        if self.prompt is None:
            if self.where is None:
                raise ValueError("a step needs a prompt (it generates) or a where (it filters)")
            given = [k for k in ("sampling", "structured", "column", "explode")
                     if k in self.model_fields_set]
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

    def added_columns(self) -> list[str]:
        """The columns the step adds, in output order."""
        c = self.output_column
        if c is None:
            return []
        added = [c, *(columns.step_column(c, m) for m in columns.STEP_META)]
        if self.structured is not None and self.structured.json_schema is not None:
            added.insert(1, columns.step_column(c, "text"))
        if self.explode or self.sampling.n > 1:
            added.insert(0, columns.step_column(c, "index"))
        return added


class OutputConfig(_Strict):
    path: str = Field(description="Output directory of Parquet parts (created by the job).")
    column: str = Field("generated", description="Name of the generated-text column.")
    parsed_column: str = Field(
        "parsed", description="With structured.json_schema: the struct column of parsed values.")
    normalize: bool = Field(
        True, description="task: embed: L2-normalize each vector (vLLM's default); false: "
        "the model's pooled output as it is.")
    dimensions: int | None = Field(
        None, gt=0, description="task: embed: a Matryoshka model's shorter vectors, of this "
        "length; default: the model's own.")
    labels: list[str] | None = Field(
        None, min_length=1, description="task: classify: names for the model's outputs, in "
        "order; default: the model's id2label. Each label has a column prob_<label>.")
    dedupe: bool = Field(
        False, description="Drop a sample whose text repeats an earlier sample of the same "
        "input row (with sampling.n > 1); the summary says how many.")
    logprobs: int | None = Field(
        None, ge=0, le=20, description="Add a column (logprobs_column) holding each "
        "generated token, its logprob and this many most likely alternatives; 0: the "
        "tokens' own logprobs only. Under structured output these are after the grammar's "
        "mask (the allowed tokens share all the probability).")
    logprobs_column: str = Field("logprobs", description="Name of the logprobs column.")
    confidence_column: str | None = Field(
        "confidence", description="With structured.choice: a column with the probability "
        "of the chosen label among the allowed labels, read from the same generation's "
        "logprobs; null for none.")
    keep_dropped: bool = Field(
        False, description="A job with steps: also write the rows a step's filter dropped, "
        "with the step's name in a column dropped_by (default: not written, counted).")
    file_size_mb: float = Field(
        128, gt=0, description="The finished output's files are about this size (MiB on "
        "disk), in input order: the job's parts are compacted into them at the end.")


class ResourcesConfig(_Strict):
    replicas: int | Literal["auto"] = Field(
        "auto", description="Engines to run (1 or more); auto = GPUs / tensor_parallel_size "
        "(1 on CPU)."
    )
    batch_size: int = Field(256, gt=0, description="Rows per block and per output part.")
    blocks_in_flight: int = Field(
        4, ge=1, description="Blocks each engine holds at once, so it never drains between "
        "blocks: a new block's requests join the running batch as soon as it arrives.")
    address: str | None = Field(
        None, description="An existing Ray cluster to run on: 'auto', 'HOST:PORT' or "
        "'ray://HOST:10001'; default: a Ray started for the job on this machine. The project's "
        "code is shipped to the workers (Ray runtime env); the engine must be installed there.")
    accelerator_type: str | None = Field(
        None, description="Pin engines to one kind of accelerator, e.g. A100, H100, MI300X "
        "(Ray's accelerator_type).")

    @field_validator("replicas")
    @classmethod
    def _an_engine_at_least(cls, value):
        """0 (or fewer) engines passed as a count: the run divided by it once it had
        started, and left its staging folder behind."""
        if value != "auto" and value < 1:
            raise ValueError("must be 1 or more, or auto")
        return value


class PricePerMTok(_Strict):
    input: float = Field(ge=0, description="Price per million prompt tokens.")
    output: float = Field(ge=0, description="Price per million output tokens.")


class ReportConfig(_Strict):
    price_per_mtok: PricePerMTok | None = Field(
        None, description="A hosted batch API's prices, to say in the run report what the "
        "same tokens would have cost there (no built-in price list: it would go stale).")


POOLING_TASKS = ("embed", "score", "classify")
# the output column a task writes unless output.column names another
DEFAULT_COLUMN = {"embed": "embedding", "score": "score", "classify": "label"}


class JobConfig(_Strict):
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
        "one engine: generate, judge, filter (udfs/steps.py).")
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
                                           "logprobs_column", "confidence_column")
                  if k in _changed(self.output)]
        if wrong:
            raise ValueError(f"{wrong[0]} does not apply to a job with steps; give each "
                             "step its own (steps[].sampling, steps[].structured, "
                             "steps[].column)")
        names, taken = set(), set(columns.GENERATED) | {columns.DROPPED_BY, columns.ROW_ID}
        for i, step in enumerate(self.steps):
            if step.name in names:
                raise ValueError(f"steps[{i}].name {step.name!r} is used by an earlier step")
            names.add(step.name)
            for name in step.added_columns():
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
    def _truncation_needs_tokens(self) -> JobConfig:
        # the server applies the chat template to whole messages: a prompt cut to fit as
        # tokens cannot be sent as messages
        chat = self.engine.kind == "http" and self.engine.endpoint == "chat"
        if chat and any(p.on_too_long == "truncate" for p in self.prompts()):
            raise ValueError("prompt.on_too_long: truncate needs engine.endpoint: completions "
                             "(with endpoint: chat the server gets whole messages); or use "
                             "on_too_long: error or skip")
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
        taken = [*columns.GENERATED, self.output.column, self.output.parsed_column]
        for key in ("logprobs_column", "confidence_column"):
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

    def confidence_column(self) -> str | None:
        """The confidence column, with structured.choice."""
        choice = self.structured is not None and self.structured.choice is not None
        return self.output.confidence_column if choice else None

    def generated_columns(self) -> list[str]:
        """The columns the job adds to every source row, in output order."""
        if self.steps is not None:
            added = [c for step in self.steps for c in step.added_columns()]
            added += [columns.DROPPED_BY] * self.output.keep_dropped + list(columns.GENERATED)
            return ([columns.ROW_ID] if self.input.id_column is None else []) + added
        if self.task != "generate":
            return self._pooling_columns()
        added = [self.output.column, *columns.GENERATED]
        if self.structured is not None and self.structured.json_schema is not None:
            added.insert(1, self.output.parsed_column)
        for scores in (self.confidence_column(), self.logprobs_column()):
            if scores is not None:
                added.insert(added.index(columns.FINISH_REASON), scores)
        if self.sampling.n > 1 or self.sampling.overrides_column:
            added.insert(0, columns.SAMPLE_INDEX)
        if self.input.id_column is None:
            added.insert(0, columns.ROW_ID)
        return added


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


def _format_validation_error(err: ValidationError, source: str) -> str:
    first = err.errors()[0]
    loc = list(first["loc"])
    if loc[:1] == ["engine"] and len(loc) > 1 and loc[1] in ("vllm", "http"):
        del loc[1]  # the union's tag, not a key the user wrote
    key = ".".join(str(p) for p in loc) or "(top level)"
    if first["type"] == "extra_forbidden":
        what = "unknown key"
    elif first["type"] == "missing":
        what = "required key is missing"
    else:
        what = first["msg"]
        if "input" in first and not isinstance(first["input"], dict):
            what += f" (got {first['input']!r})"
    more = f" (and {len(err.errors()) - 1} more)" if len(err.errors()) > 1 else ""
    if first["type"] == "value_error":  # our own checks: their message names the keys
        what = what.removeprefix("Value error, ")
        if not loc:
            return f"{source}: {what}{more}"
    return f"{source}: {key}: {what}{more}"


def parse_override(text: str) -> tuple[list[str], Any]:
    """'sampling.max_tokens=32' -> (['sampling', 'max_tokens'], 32); the value is YAML."""
    key, sep, raw = text.partition("=")
    if not sep or not key.strip():
        raise ConfigError(f"--set {text!r}: expected KEY=VALUE, e.g. sampling.max_tokens=32")
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError as exc:
        raise ConfigError(f"--set {key}: value is not valid YAML: {exc.problem}") from None
    return key.strip().split("."), value


def apply_overrides(raw: dict, overrides: list[str]) -> dict:
    for text in overrides:
        path, value = parse_override(text)
        node = raw
        for depth, part in enumerate(path):
            if isinstance(node, list):  # steps.1.sampling.max_tokens: a list's item by index
                if not part.isdigit() or int(part) >= len(node):
                    raise ConfigError(f"--set {'.'.join(path)}: {'.'.join(path[:depth])} has "
                                      f"{len(node)} item(s); {part!r} is not one of their "
                                      "indices")
                part = int(part)
            if depth == len(path) - 1:
                node[part] = value
                break
            child = node[part] if isinstance(node, list) else node.setdefault(part, {})
            if not isinstance(child, (dict, list)):
                raise ConfigError(f"--set {'.'.join(path)}: {path[depth]!r} is not a section")
            node = child
    return raw


def load_config(
    source: str | Path | dict, overrides: list[str] | tuple[str, ...] = ()
) -> JobConfig:
    """Load a job config from a YAML path or a dict, apply ``--set`` overrides, validate."""
    if isinstance(source, dict):
        raw, name = dict(source), "config"
    else:
        name = str(source)
        try:
            text = Path(source).read_text(encoding="utf-8")
        except FileNotFoundError:
            raise ConfigError(f"{name}: no such config file") from None
        except (OSError, UnicodeDecodeError) as exc:
            raise ConfigError(f"{name}: cannot read: {exc}") from None
        try:
            raw = yaml.safe_load(text)
        except yaml.YAMLError as exc:
            mark = getattr(exc, "problem_mark", None)
            where = f" line {mark.line + 1}" if mark else ""
            raise ConfigError(f"{name}{where}: not valid YAML: {getattr(exc, 'problem', exc)}") from None
        if not isinstance(raw, dict):
            raise ConfigError(f"{name}: expected a mapping of sections (input, model, ...)")
    raw = apply_overrides(_deep_copy(raw), list(overrides))
    try:
        return JobConfig.model_validate(raw)
    except ValidationError as err:
        raise ConfigError(_format_validation_error(err, name)) from None


def _deep_copy(raw):
    if isinstance(raw, dict):
        return {k: _deep_copy(v) for k, v in raw.items()}
    return [_deep_copy(v) for v in raw] if isinstance(raw, list) else raw
