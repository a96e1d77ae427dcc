"""The sections of a job's config, one pydantic model each: ``input``, ``model``, ``prompt``,
``sampling``, ``structured``, ``output``, ``resources``, ``report``. Every field's description is
the config reference's text (docs/gen_reference.py builds the reference from it).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import (BaseModel, ConfigDict, Field, field_validator, model_serializer,
                      model_validator)


class Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


def left_out_at_default(out, defaults: dict):
    """A section's dump without the settings ``defaults`` names where they hold their default."""
    if isinstance(out, dict):
        for key, default in defaults.items():
            if key in out and out[key] == default:
                del out[key]
    return out


class InputConfig(Strict):
    path: str = Field(description="A Parquet or JSONL file, a directory of them, or a glob.")
    format: Literal["auto", "parquet", "jsonl"] = Field(
        "auto", description="File format; 'auto' goes by the file extension."
    )
    id_column: str | None = Field(
        None, description="A unique column that identifies a row; without it a row_id is added."
    )


class ModelConfig(Strict):
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
    reasoning_parser: str | None = Field(
        None, description="A thinking model's reasoning parser, one of vLLM's (deepseek_r1, "
        "qwen3, openai_gptoss, ...): output.column then holds the answer only, "
        "output.reasoning_column the thinking, reasoning_tokens their count; structured "
        "output applies to the answer, after the thinking, as in vLLM. A row whose thinking "
        "used all of max_tokens (which covers thinking and answer) has no answer: its "
        "error_kind is no_answer, its thinking kept (--retry-errors with a larger max_tokens "
        "runs it again).")
    tool_parser: str | None = Field(
        None, description="The model's tool-call parser, one of vLLM's (hermes, llama3_json, "
        "mistral, ...), as vllm serve --tool-call-parser: needed for tool_choice auto, "
        "required or a named function (prompt.tools, a Batch line's tools); checked against "
        "vLLM's list before any engine starts. Not with serve's resident engine.")
    adapters: dict[str, str | None] | None = Field(
        None, description="LoRA adapters on this model, by name: {de: path/to/adapter, ...}, "
        "each a local directory in PEFT's format (adapter_config.json and its weights), "
        "checked against the model before any engine starts. Rows pick one by name "
        "(prompt.adapter_column, model.adapter, a step's adapter); Batch files by their "
        "model. With engine.kind: http the names are sent as the request's model, and the "
        "server holds the adapters (vllm serve --lora-modules): a path may be null.")
    adapter: str | None = Field(
        None, description="The adapter (one of model.adapters) every row runs on, unless "
        "its prompt.adapter_column names another; default: the base model.")
    max_lora_rank: Literal[1, 8, 16, 32, 64, 128, 256, 320, 512] | None = Field(
        None, description="vLLM's max_lora_rank; default: the smallest that holds every "
        "adapter's rank.")
    max_loras: int | None = Field(
        None, ge=1, description="Adapters an engine batch may mix (vLLM's max_loras); "
        "default: all of model.adapters. On a CPU engine it is always every adapter and one "
        "spare slot: vLLM's CPU LoRA kernels give a base-model request the last slot's "
        "adapter when every slot is taken.")
    max_cpu_loras: int | None = Field(
        None, ge=1, description="Adapters an engine keeps loaded in host memory (vLLM's "
        "max_cpu_loras); default: all of model.adapters.")

    @model_serializer(mode="wrap")
    def _new_left_out(self, dump):
        return left_out_at_default(dump(self), {"tool_parser": None})  # (as PromptConfig's)

    @model_validator(mode="after")
    def _adapters(self) -> ModelConfig:
        names = self.adapters or {}
        for name in names:
            if not name or not name.strip() or name != name.strip():
                raise ValueError(f"model.adapters: {name!r} is not a usable adapter name")
            if name == self.name:
                raise ValueError(f"model.adapters: {name!r} is the base model's name")
        if self.adapter is not None and self.adapter not in names:
            raise ValueError(f"model.adapter {self.adapter!r} is not one of model.adapters"
                             + (f" ({', '.join(names)})" if names else " (none are given)"))
        if not names:
            given = [k for k in ("max_lora_rank", "max_loras", "max_cpu_loras")
                     if getattr(self, k) is not None]
            if given:
                raise ValueError(f"model.{given[0]} needs model.adapters")
        return self


class PromptConfig(Strict):
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
    chat_template_kwargs: dict[str, Any] | None = Field(
        None, description="The chat template's own switches, passed to it as vLLM's chat "
        "path passes them, e.g. {enable_thinking: false} for a thinking model that should "
        "answer at once.")
    chat_template_content_format: Literal["auto", "string", "openai"] = Field(
        "auto", description="How the chat template reads a message's content, as vLLM's "
        "LLM.chat takes it: auto tells it from the template (vLLM's detection); string hands "
        "it one text, each image's placeholder in it; openai a list of text and image parts.")
    adapter_column: str | None = Field(
        None, description="A column naming each row's LoRA adapter (one of model.adapters); "
        "null: model.adapter, or the base model. A name the job does not declare is that "
        "row's error (unknown_adapter).")
    images: list[str] | None = Field(
        None, description="Columns holding each row's images, for a vision-language model: "
        "bytes (a binary column, or a struct with bytes and path, as Hugging Face datasets "
        "writes), a path (local or on an object store; relative to the table's folder), a "
        "data: URL, or a list of these. They go into the user message before the template's "
        "text, in this order (a messages_column's image_url parts stand where they are "
        "instead). An image that cannot be used is that row's image_error.")
    max_images: int | None = Field(
        None, ge=1, description="The most images one row's prompt may hold (vLLM's "
        "limit_mm_per_prompt); default: the number of prompt.images columns, or the most a "
        "row of the table's first block holds.")
    max_image_pixels: int = Field(
        50_000_000, gt=0, description="An image of more pixels (width x height) is its row's "
        "image_error, as a decompression bomb would be, before it is decoded.")
    fetch_image_urls: bool = Field(
        False, description="Fetch images given as http(s) URLs; off, such an image is its "
        "row's image_error.")
    tools: list[dict[str, Any]] | None = Field(
        None, description="Functions the model may call, in OpenAI's shape: [{type: "
        "function, function: {name, description, parameters: a JSON Schema}}]; the chat "
        "template lists them, and each row's calls go in output.tool_calls_column "
        "(docs/guide/tools.md).")
    tool_choice: str | dict[str, Any] | None = Field(
        None, description="With tools: auto (the model may call; needs model.tool_parser), "
        "required (at least one call), none (no call), or a function's name: that function "
        "is called, its arguments held to its parameters' schema and parsed into "
        "output.parsed_column as structured output is. Default: auto.")
    parallel_tool_calls: bool | None = Field(
        None, description="With tools: false keeps only a row's first call (required: the "
        "grammar allows one). Default: true.")
    tools_column: str | None = Field(
        None, description="A column of each row's own tools, as JSON {tools, tool_choice, "
        "parallel_tool_calls} (a Batch file's lines; null: prompt.tools).")

    @model_serializer(mode="wrap")
    def _auto_left_out(self, dump):
        """Settings added later are left out of a dump (the job's fingerprint, its record)
        at their defaults: an output written before they existed is the same job's."""
        return left_out_at_default(dump(self), {
            "chat_template_content_format": "auto", "tools": None, "tool_choice": None,
            "parallel_tool_calls": None, "tools_column": None})

    @model_validator(mode="after")
    def _template_or_messages(self) -> PromptConfig:
        if (self.template is None) == (self.messages_column is None):
            raise ValueError("give exactly one of template, messages_column")
        if self.tools is None:
            given = [k for k in ("tool_choice", "parallel_tool_calls")
                     if getattr(self, k) is not None]
            if given:
                raise ValueError(f"{given[0]} needs tools (the functions the "
                                 "model may call)")
        else:
            self.tool_spec()  # checked here: a bad tool is one line before any engine starts
        if self.images is not None:
            if not self.images or len(set(self.images)) != len(self.images):
                raise ValueError("prompt.images: a list of distinct column names")
            if self.messages_column is not None:
                raise ValueError("prompt.images goes with a template; a messages_column "
                                 "holds its images as image_url parts")
        return self

    def tool_spec(self) -> str | None:
        """prompt.tools, tool_choice and parallel_tool_calls as the renderer and the engine
        read them (udfs/rows/tool_calls.py); None without tools. ValueError names the key."""
        from udfs.rows.tool_calls import tool_spec

        if self.tools is None:
            return None
        return tool_spec(self.tools, self.tool_choice, self.parallel_tool_calls)

    def forced_tool(self) -> dict | None:
        """The function prompt.tool_choice names ({name, parameters}), or None."""
        from udfs.rows.tool_calls import forced_name, parameters_of, read_spec

        spec = read_spec(self.tool_spec())
        name = forced_name(spec) if spec is not None else None
        return None if name is None else {"name": name, "parameters": parameters_of(spec, name)}


class SamplingConfig(Strict):
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
    logit_bias: dict[int, float] | None = Field(
        None, description="Added to a token's logit at every step, by token id, as OpenAI's "
        "logit_bias: -100 bans a token, 100 forces it.")

    @field_validator("logit_bias")
    @classmethod
    def _a_bias_within_100(cls, value):
        for token, bias in (value or {}).items():
            if not -100 <= bias <= 100:
                raise ValueError(f"token {token}: {bias} is not within -100 and 100")
        return value


class StructuredConfig(Strict):
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


class OutputConfig(Strict):
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
    reasoning_column: str = Field(
        "reasoning", description="With model.reasoning_parser: the column of each row's "
        "thinking (null where the model did not think); reasoning_tokens counts it.")
    tool_calls_column: str = Field(
        "tool_calls", description="With prompt.tools: the column of each row's tool calls, a "
        "list of {id, name, arguments (JSON text)}.")
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
    reuse: bool = Field(
        False, description="A re-run over a changed table: carry over the rows of the earlier "
        "output at output.path whose request is unchanged (their request_key), generate the "
        "rest; the new output is the new table's rows in its order (docs/guide/reuse.md).")
    reuse_from: str | None = Field(
        None, description="Reuse the rows of this earlier output instead (a folder, local or "
        "on an object store: yesterday's snapshot); implies reuse.")

    @model_serializer(mode="wrap")
    def _new_left_out(self, dump):
        return left_out_at_default(dump(self), {"tool_calls_column": "tool_calls"})


class ResourcesConfig(Strict):
    replicas: int | Literal["auto"] = Field(
        "auto", description="Engines to run (1 or more); auto = GPUs / tensor_parallel_size "
        "(1 on CPU)."
    )
    batch_size: int = Field(256, gt=0, description="Rows per block and per output part.")
    blocks_in_flight: int = Field(
        4, ge=1, description="Blocks each engine holds at once, so it never drains between "
        "blocks: a new block's requests join the running batch as soon as it arrives.")
    # (a bool: YAML reads an unquoted on / off as true / false)
    group_by_prefix: bool | Literal["auto"] = Field(
        "auto", description="Run rows that share a prompt head (a system prompt and examples, "
        "a document asked several questions) one after another, so the engine's prefix cache "
        "computes each head once; the output keeps the input's order and values. auto: where "
        "it puts a tenth of the prompt tokens or more next to a head they share, beyond input "
        "order; true: wherever any do; false: input order.")
    address: str | None = Field(
        None, description="An existing Ray cluster to run on: 'auto', 'HOST:PORT' or "
        "'ray://HOST:10001'; default: a Ray started for the job on this machine. The project's "
        "code is shipped to the workers (Ray runtime env); the engine must be installed there.")
    accelerator_type: str | None = Field(
        None, description="Pin engines to one kind of accelerator, e.g. A100, H100, MI300X "
        "(Ray's accelerator_type).")

    @model_serializer(mode="wrap")
    def _new_left_out(self, dump):
        return left_out_at_default(dump(self), {"group_by_prefix": "auto"})

    @field_validator("group_by_prefix", mode="before")
    @classmethod
    def _auto_or_a_bool(cls, value):
        """auto, or true / false, however YAML or --set spelled them (on, off, yes, no)."""
        if isinstance(value, str) and value.lower() in ("on", "off", "true", "false", "yes",
                                                        "no"):
            return value.lower() in ("on", "true", "yes")
        if value == "auto" or isinstance(value, bool):
            return value
        raise ValueError("must be auto, true or false")

    @field_validator("replicas")
    @classmethod
    def _an_engine_at_least(cls, value):
        """0 (or fewer) engines passed as a count: the run divided by it once it had
        started, and left its staging folder behind."""
        if value != "auto" and value < 1:
            raise ValueError("must be 1 or more, or auto")
        return value


class PricePerMTok(Strict):
    input: float = Field(ge=0, description="Price per million prompt tokens.")
    output: float = Field(ge=0, description="Price per million output tokens.")


class ReportConfig(Strict):
    price_per_mtok: PricePerMTok | None = Field(
        None, description="A hosted batch API's prices, to say in the run report what the "
        "same tokens would have cost there (no built-in price list: it would go stale).")
