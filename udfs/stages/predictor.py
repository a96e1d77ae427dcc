"""The predictor actor: one engine per replica, one ``generate`` call per block.

Given a ``RenderSpec`` it renders each block's prompts first (udfs/stages/prompts.py), in its own
process: a job's actors are then the engine's and the writer's, with one tokenizer loaded, not
two (a separate renderer actor cost memory and a share of a small machine's CPU while the
engine ran). Rows the renderer marked (an error, or skipped) pass through untouched; the rest
go to the engine as one batch. A request the engine rejects becomes that row's error.
"""

from __future__ import annotations

import hashlib
import json
import threading
import time
from dataclasses import dataclass

import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind
from udfs.engines.engine import (EngineSpec, GenerationRequest, Sampling,
                                 build_engine, sampling_values)
from udfs.rows.logprobs import LOGPROBS_TYPE, label_confidence, truncate_top
from udfs.rows.tool_calls import TOOL_CALLS_TYPE, call_problem, read_spec, row_spec
from udfs.stages.memory import release_free_memory
from udfs.stages.prompts import PromptRenderer, RenderSpec
from udfs.stages.replica import replica_label
from udfs.stages.row_overrides import RowOverrides
from udfs.engines.recovery import Recovery


@dataclass(frozen=True, kw_only=True)
class SamplingSpec(Sampling):
    """Per-job sampling settings (by name): the Sampling fields every row starts from, and the
    columns its generation reads and writes."""

    max_tokens: int
    seed: int = 0  # the job's: each row's seed derives from it and the row's key
    key_column: str = columns.ORDINAL  # the id column, when the input has one
    structured: dict | None = None  # see GenerationRequest.structured
    n: int = 1  # samples per row: the output has n rows per input row
    max_tokens_column: str | None = None  # each row's own cap, at most max_tokens
    # A column of JSON objects: this row's temperature, top_p, seed, stop, n, json_schema
    # and the rest of RowOverrides' fields
    overrides_column: str | None = None
    # The logprobs column (udfs/rows/logprobs.py), when set: each row's tokens with ``logprobs``
    # top alternatives (a row's overrides may set its own, or null for none)
    logprobs_column: str | None = None
    logprobs: int | None = None
    # With structured choice: the column of the chosen label's confidence, and the top
    # alternatives it needs (udfs/logprobs.confidence_top_k)
    confidence_column: str | None = None
    confidence_top_k: int = 0
    # With a reasoning parser (a thinking model): the column of each row's thinking; its
    # answer is the output column, its thinking tokens columns.REASONING_TOKENS
    reasoning_column: str | None = None
    budget_key: str = "sampling.max_tokens"  # where the config sets max_tokens, for errors
    # LoRA adapters (model.adapters): the names the engine holds, the one a row without its
    # own runs on (None: the base model), and the column that names each row's
    adapters: tuple[str, ...] = ()
    adapter: str | None = None
    adapter_column: str | None = None
    # prompt.images in a one-step job: each row's image count and image tokens as columns
    count_images: bool = False
    # Tools (udfs/rows/tool_calls.py): the job's tool spec (JSON), or the column of each row's;
    # the column of the calls each row made
    tools: str | None = None
    tools_column: str | None = None
    tool_calls_column: str | None = None
    # A table job's calls checked (a call the choice needs, declared names, arguments that
    # match): a row whose calls fail is its parse_error, its text kept. A Batch file's are
    # answered as vLLM's server answers them
    check_tool_calls: bool = False
    # A named choice: the output column holds the call's arguments, which structured output's
    # parser reads into the parsed column
    arguments_as_text: bool = False


def no_answer(result, budget_key: str = "sampling.max_tokens") -> str:
    """A thinking model's row without an answer, in one line: why, and what to do."""
    if result.finish_reason == "length":
        # a job of steps is run again whole (--retry-errors runs a one-step job's rows only)
        again = (f"--set {budget_key}=N --overwrite" if budget_key.startswith("steps.")
                 else f"--retry-errors --set {budget_key}=N")
        return (f"no answer: the thinking used all {result.completion_tokens} tokens of "
                "max_tokens (which covers thinking and answer); run it again with a larger "
                f"budget: {again}")
    return f"no answer: the model ended while thinking (finish_reason {result.finish_reason})"


def _checked(value: str | None) -> str | None:
    """A row's tools value as checked JSON; None where it has none, or one the renderer has
    already made the row's error."""
    try:
        return row_spec(value)
    except ValueError:
        return None


def _call_id(key, sample_index: int, call: int) -> str:
    """A tool call's id, the same in every run: its row's key, sample and place."""
    digest = hashlib.blake2b(repr((key, sample_index, call)).encode(), digest_size=12)
    return "call_" + digest.hexdigest()


def row_seed(job_seed: int, key, sample_index: int = 0) -> int:
    """A stable 31-bit seed per row and sample, the same in every run and on every replica."""
    digest = hashlib.blake2b(repr((job_seed, key, sample_index)).encode(), digest_size=8)
    return int.from_bytes(digest.digest(), "big") & 0x7FFFFFFF


@dataclass
class _Samples:
    """A block's rows as the engine takes them (one per sample), each with its overrides and
    adapter, and the rows not to generate: refused overrides, an adapter the job lacks."""

    table: pa.Table
    overrides: list[dict]
    adapters: list[str | None]
    refused: dict[int, str]
    unknown: dict[int, str]
    samples: list[int]  # each row's sample index
    counts: list[int] | None = None  # each row's samples in all; None: rows not expanded


@dataclass
class _Outcomes:
    """Each row's output columns, as ``Predictor`` fills them in from the engine's results."""

    text: list
    completion: list
    finish: list
    kinds: list
    errors: list
    reasoning: list
    reasoning_tokens: list
    prompt_tokens: list | None = None  # set where the engine counts an image's tokens
    tool_calls: list | None = None  # with tools: each row's calls


def _column_or_nones(batch: pa.Table, name: str) -> list:
    return batch.column(name).to_pylist() if name in batch.column_names \
        else [None] * batch.num_rows


class Predictor:
    """``map_batches`` callable class: builds the engine in ``__init__`` from a picklable spec.
    Without ``render``, its input is a ``PromptRenderer``'s output."""

    def __init__(self, engine: EngineSpec, sampling: SamplingSpec, output_column: str,
                 render: RenderSpec | None = None, health: str | None = None,
                 stall_timeout_s: float | None = None):
        where = replica_label()  # before the engine takes its placement group's GPUs
        # engine death, poison rows and stalls (udfs/engines/recovery.py); past the restart bound
        # this refuses before an engine is built
        self.recovery = Recovery(health, stall_timeout_s)
        self.renderer = PromptRenderer(render) if render is not None else None
        # blocks arrive on several threads at once; a fast tokenizer is not to be shared
        # across threads mid-call
        self.render_lock = threading.Lock()
        self.engine = build_engine(engine)
        self.recovery.watch(self.engine)
        threads = getattr(self.engine, "cpu_threads", None)  # a CPU engine's compute threads
        dtype = getattr(self.engine, "dtype", None)
        caching = getattr(self.engine, "prefix_caching", None)  # an in-process vLLM engine's
        self.replica = json.dumps({**where, **({"cpu_threads": threads} if threads else {}),
                                   **({"dtype": dtype} if dtype else {}),
                                   **({"prefix_caching": caching} if caching is not None
                                      else {})})
        self.sampling = sampling
        self.output_column = output_column
        self.ready_at = time.time()

    def sharing(self, sampling: SamplingSpec, output_column: str,
                render: RenderSpec) -> Predictor:
        """Another step's predictor on this one's engine (udfs/stages/steps.py): its own prompt and
        sampling; the same engine, recovery, render lock and replica."""
        other = object.__new__(type(self))
        other.__dict__.update(self.__dict__)
        other.renderer = PromptRenderer(render)
        other.sampling, other.output_column = sampling, output_column
        return other

    def _adapters(self, batch: pa.Table) -> tuple[list[str | None], dict[int, str]]:
        """Each row's LoRA adapter (None: the base model), and the rows that name one the
        job does not declare, with why."""
        s = self.sampling
        rows = batch.num_rows
        if s.adapter_column is None:
            return [s.adapter] * rows, {}
        names, unknown = [], {}
        for i, value in enumerate(batch.column(s.adapter_column).to_pylist()):
            if value is None:
                names.append(s.adapter)
            elif value in s.adapters:
                names.append(value)
            else:
                names.append(None)
                unknown[i] = (f"{s.adapter_column}: {str(value)[:80]!r} is not one of the "
                              f"job's adapters ({', '.join(s.adapters)})")
        return names, unknown

    def _request(self, token_ids: list[int], key, sample: int, max_tokens: int | None,
                 messages: str | None, overrides: dict,
                 adapter: str | None = None, images: list[dict] | None = None,
                 tools: str | None = None) -> GenerationRequest:
        s = self.sampling
        cap = s.max_tokens if max_tokens is None else max(1, min(max_tokens, s.max_tokens))
        schema = overrides.get("json_schema")
        top = max(self._top(overrides) or 0, s.confidence_top_k)
        return GenerationRequest(
            prompt_token_ids=token_ids, max_tokens=cap,
            **self._row_sampling(overrides, key, sample),
            logprobs=top if self._top(overrides) is not None or s.confidence_top_k else None,
            structured={"json": schema} if schema is not None else s.structured,
            messages=json.loads(messages) if messages is not None else None,
            # its own prompt's ({} for none: not the engine's, which are the first step's)
            chat_template_kwargs=(self.renderer.spec.chat_template_kwargs or {}
                                  if self.renderer is not None else None),
            adapter=adapter,
            images=tuple(images or ()),
            image_spec=self.renderer.spec.images if images and self.renderer else None,
            tools=tools,
        )

    def _row_sampling(self, overrides: dict, key, sample: int) -> dict:
        """A row's Sampling fields: its overrides over the job's, with a seed per sample."""
        s = self.sampling
        values = {**s.sampling_fields, **sampling_values(overrides)}
        seed = overrides.get("seed")
        if seed is not None:  # the request's own seed: each sample a different one
            seed = (seed + sample) & 0x7FFFFFFF
        elif values["temperature"] > 0:  # greedy needs no seed, and an unseeded request is cheaper
            seed = row_seed(s.seed, key, sample)
        top_k = values["top_k"]
        return {**values, "seed": seed, "top_k": top_k if top_k and top_k > 0 else None}

    def _top(self, overrides: dict) -> int | None:
        """The top alternatives this row's logprobs column asks for; None: no column."""
        if self.sampling.logprobs_column is None:
            return None
        return overrides["logprobs"] if "logprobs" in overrides else self.sampling.logprobs

    def _scores(self, todo: list[int], results: list, overrides: list[dict],
                rows: int) -> list[tuple[str, pa.Array]]:
        """The logprobs and confidence columns, as the job asks for them."""
        s, added = self.sampling, []
        if s.logprobs_column is not None:
            values = [None] * rows
            for i, result in zip(todo, results):
                top = self._top(overrides[i])
                if top is not None and result.error is None:
                    values[i] = truncate_top(result.logprobs, top)
            added.append((s.logprobs_column, pa.array(values, LOGPROBS_TYPE)))
        if s.confidence_column is not None:
            labels = (s.structured or {}).get("choice") or ()
            values = [None] * rows
            for i, result in zip(todo, results):
                if result.error is None and result.text is not None:
                    # the answer's own tokens: a thinking model's thinking comes before it
                    values[i] = label_confidence(labels, result.text,
                                                 result.logprobs[result.answer_start:])
            added.append((s.confidence_column, pa.array(values, pa.float64())))
        return added

    def __call__(self, batch: pa.Table, key=None) -> pa.Table:
        # which block this is, for isolating poison rows (a user's own pipeline may have no
        # ordinals, and runs without that); ``key``: a step's own (udfs/stages/steps.py)
        block = key if key is not None else (
            batch.column(columns.ORDINAL)[0].as_py()
            if batch.num_rows and columns.ORDINAL in batch.column_names else -1)
        if self.renderer is not None:
            with self.render_lock:
                batch = self.renderer(batch)
        rows = self._samples(batch)
        images = _column_or_nones(rows.table, columns.PROMPT_IMAGES)
        todo, results = self._generate(rows, images, block)
        outcomes = self._outcomes(rows, todo, results, images)
        return self._output(rows, todo, results, outcomes, images)

    def _samples(self, batch: pa.Table) -> _Samples:
        """The block's rows with their overrides and adapters; one row per sample where the
        job may ask for several (the source columns repeated)."""
        overrides, refused = self._overrides(batch)
        adapters, unknown = self._adapters(batch)
        ns = [o.get("n", self.sampling.n) for o in overrides]
        if not (any(n != 1 for n in ns) or self.sampling.overrides_column is not None):
            return _Samples(batch, overrides, adapters, refused, unknown, [0] * batch.num_rows)
        take = [i for i, n in enumerate(ns) for _ in range(n)]
        return _Samples(
            batch.take(take), [overrides[i] for i in take], [adapters[i] for i in take],
            {new: refused[old] for new, old in enumerate(take) if old in refused},
            {new: unknown[old] for new, old in enumerate(take) if old in unknown},
            [k for n in ns for k in range(n)], [ns[i] for i in take])

    def _generate(self, rows: _Samples, images: list, block) -> tuple[list[int], list]:
        """The rows that go to the engine (``todo``: their places) and the engine's results."""
        batch = rows.table
        token_ids = batch.column(columns.PROMPT_TOKEN_IDS).to_pylist()
        for i in (*rows.refused, *rows.unknown):
            token_ids[i] = None  # not generated: the row's error says why
        keys = batch.column(self.sampling.key_column).to_pylist()
        caps = (batch.column(self.sampling.max_tokens_column).to_pylist()
                if self.sampling.max_tokens_column else [None] * batch.num_rows)
        messages = _column_or_nones(batch, columns.PROMPT_MESSAGES)
        tools = self.tools_of(batch)
        todo = [i for i, ids in enumerate(token_ids) if ids is not None]
        results = self.recovery.generate(self.engine, block, [
            self._request(token_ids[i], keys[i], rows.samples[i], caps[i], messages[i],
                          rows.overrides[i], rows.adapters[i], images[i], tools[i])
            for i in todo])
        return todo, results

    def tools_of(self, batch: pa.Table) -> list[str | None]:
        """Each row's tool spec (JSON; None: no tools): its column's, else the job's."""
        s = self.sampling
        if s.tools_column is not None:
            return [_checked(value) or s.tools
                    for value in batch.column(s.tools_column).to_pylist()]
        return [s.tools] * batch.num_rows

    def _outcomes(self, rows: _Samples, todo: list[int], results: list,
                  images: list) -> _Outcomes:
        """Each row's text and counts, or its error: a render error found first stands, then
        refused overrides or an unknown adapter, then the engine's."""
        batch, n = rows.table, rows.table.num_rows
        out = _Outcomes(text=[None] * n, completion=[None] * n,
                        finish=batch.column(columns.FINISH_REASON).to_pylist(),
                        kinds=batch.column(columns.ERROR_KIND).to_pylist(),
                        errors=batch.column(columns.ERROR).to_pylist(),
                        reasoning=[None] * n, reasoning_tokens=[None] * n)
        kinds, errors = out.kinds, out.errors
        for i, message in rows.refused.items():
            if kinds[i] is None:  # a render error found first stands
                kinds[i], errors[i] = ErrorKind.OVERRIDES, f"{self.sampling.overrides_column}: " \
                    f"{message}"
        for i, message in rows.unknown.items():
            if kinds[i] is None:
                kinds[i], errors[i] = ErrorKind.ADAPTER, message
        thinking = self.sampling.reasoning_column is not None
        if columns.PROMPT_IMAGES in batch.column_names:  # the engine counts an image's tokens
            out.prompt_tokens = batch.column(columns.PROMPT_TOKENS).to_pylist()
        for i, result in zip(todo, results):
            if out.prompt_tokens is not None and images[i] and result.prompt_tokens is not None:
                out.prompt_tokens[i] = result.prompt_tokens
            if result.error is not None:
                kinds[i], errors[i] = result.error_kind or ErrorKind.ENGINE, result.error
                continue
            out.text[i], out.finish[i], out.completion[i] = (result.text, result.finish_reason,
                                                             result.completion_tokens)
            if thinking:
                out.reasoning[i], out.reasoning_tokens[i] = (result.reasoning,
                                                             result.reasoning_tokens)
                # it thought and did not answer (a call is an answer): retried with room
                if result.text is None and not result.tool_calls:
                    kinds[i] = ErrorKind.NO_ANSWER
                    errors[i] = no_answer(result, self.sampling.budget_key)
        if self.sampling.tool_calls_column is not None:
            self._tool_outcomes(rows, todo, results, out)
        return out

    def _tool_outcomes(self, rows: _Samples, todo: list[int], results: list,
                       out: _Outcomes) -> None:
        """Each row's tool calls, with ids of its own (the same in every run); in a table
        job, a row whose calls do not answer its tools is its parse_error, text kept."""
        s = self.sampling
        keys = rows.table.column(s.key_column).to_pylist()
        specs = self.tools_of(rows.table)
        out.tool_calls = [None] * rows.table.num_rows
        for i, result in zip(todo, results):
            if result.error is not None or result.tool_calls is None:
                continue
            calls = [{**call, "id": _call_id(keys[i], rows.samples[i], n)}
                     for n, call in enumerate(result.tool_calls)]
            out.tool_calls[i] = calls
            if s.arguments_as_text and calls:
                out.text[i] = calls[0]["arguments"]
            if s.check_tool_calls and out.kinds[i] is None:
                try:
                    problem = call_problem(read_spec(specs[i]), calls)
                except Exception as exc:  # noqa: BLE001 - a schema the checker cannot walk
                    problem = f"the tool calls could not be checked: {type(exc).__name__}"
                if problem is not None:
                    if result.finish_reason == "length":  # the usual cause: say so
                        problem += (f" (the output was cut at max_tokens, "
                                    f"{result.completion_tokens} tokens)")
                    out.kinds[i], out.errors[i] = ErrorKind.PARSE, problem

    def _output(self, rows: _Samples, todo: list[int], results: list, out: _Outcomes,
                images: list) -> pa.Table:
        """The block as it goes on: the prompt's working columns dropped, the outcomes'
        columns added."""
        batch, n = rows.table, rows.table.num_rows
        if out.prompt_tokens is not None:
            if self.sampling.count_images:
                batch = self._image_counts(batch, images, out.prompt_tokens)
            batch = batch.set_column(batch.schema.get_field_index(columns.PROMPT_TOKENS),
                                     columns.PROMPT_TOKENS,
                                     pa.array(out.prompt_tokens, pa.int64()))
        batch = batch.drop_columns([c for c in (columns.PROMPT_TOKEN_IDS, columns.PROMPT_MESSAGES,
                                                columns.PROMPT_IMAGES, columns.FINISH_REASON,
                                                columns.ERROR_KIND, columns.ERROR)
                                    if c in batch.column_names])
        if rows.counts is not None:
            batch = (batch
                     .append_column(columns.SAMPLE_INDEX, pa.array(rows.samples, pa.int32()))
                     .append_column(columns.SAMPLES, pa.array(rows.counts, pa.int32())))
        rows_of = lambda value, type_: pa.array([value] * n, type_)  # noqa: E731
        for name, values in self._scores(todo, results, rows.overrides, n):
            batch = batch.append_column(name, values)
        if self.sampling.tool_calls_column is not None:
            batch = batch.append_column(self.sampling.tool_calls_column, pa.array(
                out.tool_calls or [None] * n, TOOL_CALLS_TYPE))
        if self.sampling.reasoning_column is not None:
            batch = (batch.append_column(self.sampling.reasoning_column,
                                         pa.array(out.reasoning, pa.string()))
                     .append_column(columns.REASONING_TOKENS,
                                    pa.array(out.reasoning_tokens, pa.int64())))
        cached = [None] * n
        for i, result in zip(todo, results):
            cached[i] = getattr(result, "cached_tokens", None)
        release_free_memory()
        return (batch
                .append_column(columns.CACHED_TOKENS, pa.array(cached, pa.int64()))
                .append_column(columns.REPLICA, rows_of(self.replica, pa.string()))
                .append_column(columns.READY_AT, rows_of(self.ready_at, pa.float64()))
                .append_column(columns.DONE_AT, rows_of(time.time(), pa.float64()))
                .append_column(self.output_column, pa.array(out.text, pa.string()))
                .append_column(columns.FINISH_REASON, pa.array(out.finish, pa.string()))
                .append_column(columns.COMPLETION_TOKENS, pa.array(out.completion, pa.int64()))
                .append_column(columns.ERROR_KIND, pa.array(out.kinds, pa.string()))
                .append_column(columns.ERROR, pa.array(out.errors, pa.string())))

    def _image_counts(self, batch: pa.Table, images: list, engine_counts: list) -> pa.Table:
        """The image_count and image_tokens columns: a row's images, and the tokens the engine
        counted in its prompt beyond the rendered text's (each image's placeholder there
        replaced by the image's tokens); null where the engine did not take the row."""
        rendered = batch.column(columns.PROMPT_TOKENS).to_pylist()
        per_image = len(self.renderer.placeholder_ids()) if self.renderer is not None else 0
        count = [len(found) if found is not None else None for found in images]
        tokens = [engine - text + n * per_image
                  if found and engine is not None and text is not None and engine != text
                  else (0 if found is not None and not found else None)
                  for found, n, engine, text in zip(images, count, engine_counts, rendered)]
        return (batch.append_column(columns.IMAGE_COUNT, pa.array(count, pa.int32()))
                .append_column(columns.IMAGE_TOKENS, pa.array(tokens, pa.int64())))

    def _overrides(self, batch: pa.Table) -> tuple[list[dict], dict[int, str]]:
        """Each row's sampling overrides, and the rows whose overrides are not valid (they
        run as one sample, not generated, with that error)."""
        column = self.sampling.overrides_column
        if column is None:
            return [{} for _ in range(batch.num_rows)], {}
        struct = pa.types.is_struct(batch.schema.field(column).type)
        parsed, refused = [], {}
        for i, value in enumerate(batch.column(column).to_pylist()):
            try:
                parsed.append(RowOverrides.of(value, struct))
            except ValueError as exc:
                parsed.append({})
                refused[i] = str(exc)
        return parsed, refused

    def close(self) -> None:
        self.engine.close()
