"""The pooling actor: ``task: embed | score | classify``, one ``pool`` call per block.

The predictor's shape (udfs/stages/predictor.py) for a model that returns numbers instead of text:
it renders each block's prompts itself (``PromptRenderer``; for ``score``, ``PairRenderer``
renders the query and the document and tokenizes them as a pair), sends the rows that
rendered to the engine as one batch, through the same ``Recovery`` (engine death, poison rows,
stalls), and writes

- embed: one ``fixed_size_list<float32>[dim]`` column, the vector;
- score: one ``float32`` column;
- classify: the top label (a string column), and one ``float32`` column of probability per
  label, ``prob_<label>``: a user filters with ``pl.col("prob_spam") > 0.9`` and sorts by it,
  where a list column would need ``.list.get(i)`` and the label's position.

The writer's metadata columns stay (``prompt_tokens``; ``finish_reason`` null or ``skipped``;
``completion_tokens`` null; ``error_kind``, ``error``), so counting, resume, ``--retry-errors``
and the report work as they do for generation.
"""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass

import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind, FinishReason
from udfs.engines.engine import EngineSpec, PoolingRequest, build_engine
from udfs.stages.memory import release_free_memory
from udfs.stages.replica import replica_label
from udfs.stages.prompts import PromptRenderer, RenderSpec
from udfs.stages.templates import compile_template, render_template
from udfs.engines.recovery import Recovery

TASKS = ("embed", "score", "classify")


@dataclass(frozen=True)
class PoolingSpec:
    """What the pooler writes; small and picklable, sent to each replica."""

    task: str  # one of TASKS
    output_column: str
    labels: tuple[str, ...] = ()  # classify: the model's labels, in output order
    # embed: the vector's length, fixed for the column type; None: a list column of any
    # length (a Batch file, whose lines may each ask for their own ``dimensions``)
    size: int | None = None
    normalize: bool | None = None  # embed: None is the model's default (normalized)
    dimensions: int | None = None  # embed: a Matryoshka model's shorter vector
    # A column of JSON objects: this row's {"dimensions": N} (Batch files use it)
    overrides_column: str | None = None


def probability_column(label: str) -> str:
    return f"{columns.PROBABILITY_PREFIX}{label}"


def output_columns(spec: PoolingSpec) -> list[str]:
    """The columns a pooling task adds before the metadata columns."""
    if spec.task == "classify":
        return [spec.output_column, *(probability_column(label) for label in spec.labels)]
    return [spec.output_column]


class PairRenderer(PromptRenderer):
    """score: ``template`` renders the query, ``pair_template`` the document; the two are
    tokenized as a pair, ``tokenizer(text=query, text_pair=document)``, as vLLM's
    cross-encoder path does (with the model's separator tokens, and token types where the
    tokenizer makes them). Too long: ``truncate`` cuts the document's end."""

    def __init__(self, spec: RenderSpec, pair_template: str):
        super().__init__(spec)
        self.pair, pair_variables = compile_template(pair_template)
        self.variables = sorted(set(self.variables) | set(pair_variables))
        self._extra: list[tuple[int | None, str | None]] = []

    def __call__(self, batch: pa.Table) -> pa.Table:
        self._extra = []
        out = super().__call__(batch)
        starts, texts = zip(*self._extra) if self._extra else ((), ())
        return (out.append_column(columns.PAIR_START, pa.array(starts, pa.int32()))
                .append_column(columns.PAIR_TEXTS, pa.array(texts, pa.string())))

    def render_row(self, row: dict, max_tokens: int | None = None):
        result = self._render_pair(row)
        start = texts = None
        if len(result) == 2:  # rendered: the encoding and the two texts
            encoding, texts = result
            ids = list(encoding["input_ids"])
            types = encoding.get("token_type_ids")
            if types and 1 in types:
                start = list(types).index(1)
            result = (ids, len(ids), None, None, None)
        self._extra.append((start, json.dumps(texts) if texts else None))
        return result

    def _render_pair(self, row: dict):
        row, null = self.nulls_handled(row)
        if null is not None:
            return None, None, None, ErrorKind.NULL_FIELD, null
        try:
            query, document = (render_template(self.template, row, self.spec.on_null),
                               render_template(self.pair, row, self.spec.on_null))
            encoding = self.tokenizer(text=query, text_pair=document)
        except Exception as exc:  # a template error on this row's values: the row's problem
            return None, None, None, ErrorKind.RENDER, f"template failed on this row: {exc}"
        length, budget = len(encoding["input_ids"]), self.budget
        if length <= budget:
            return encoding, (query, document)
        if self.spec.on_too_long == "truncate":
            try:  # (the texts are the server's; a job that truncates runs in process)
                encoding = self.tokenizer(text=query, text_pair=document, max_length=budget,
                                          truncation="only_second")
                if len(encoding["input_ids"]) <= budget:
                    return encoding, (query, document)
            except Exception:  # noqa: BLE001 - the query alone is too long: as below
                pass
        if self.spec.on_too_long == "skip":
            return None, length, FinishReason.SKIPPED, None, None
        return None, length, None, ErrorKind.PROMPT_TOO_LONG, (
            f"the pair has {length} tokens; max_model_len is {self.spec.max_model_len}")


class _Pooling:
    """The engine as Recovery calls it: its ``pool`` in ``generate``'s place (a poison row's
    result from Recovery carries only ``error`` and ``error_kind``, as a pooling result)."""

    def __init__(self, engine):
        self.generate = engine.pool


class Pooler:
    """``map_batches`` callable class for pooling tasks: builds the engine in ``__init__``
    from a picklable spec, as the predictor does."""

    def __init__(self, engine: EngineSpec, pooling: PoolingSpec, render: RenderSpec,
                 pair_template: str | None = None, health: str | None = None,
                 stall_timeout_s: float | None = None):
        where = replica_label()
        self.recovery = Recovery(health, stall_timeout_s)
        self.renderer = (PairRenderer(render, pair_template) if pooling.task == "score"
                         else PromptRenderer(render))
        self.render_lock = threading.Lock()  # a fast tokenizer is not shared mid-call
        self.engine = build_engine(engine)
        self.recovery.watch(self.engine)
        threads = getattr(self.engine, "cpu_threads", None)
        dtype = getattr(self.engine, "dtype", None)
        self.replica = json.dumps({**where, **({"cpu_threads": threads} if threads else {}),
                                   **({"dtype": dtype} if dtype else {})})
        self.spec = pooling
        self.ready_at = time.time()

    def _requests(self, batch: pa.Table, todo: list[int]) -> list[PoolingRequest]:
        ids = batch.column(columns.PROMPT_TOKEN_IDS).to_pylist()
        starts = texts = [None] * batch.num_rows
        if self.spec.task == "score":
            starts = batch.column(columns.PAIR_START).to_pylist()
            texts = batch.column(columns.PAIR_TEXTS).to_pylist()
        dims = self._dimensions(batch)
        return [PoolingRequest(task=self.spec.task, prompt_token_ids=ids[i], pair_start=starts[i],
                               texts=tuple(json.loads(texts[i])) if texts[i] else None,
                               normalize=self.spec.normalize, dimensions=dims[i])
                for i in todo]

    def _dimensions(self, batch: pa.Table) -> list[int | None]:
        column = self.spec.overrides_column
        if column is None:
            return [self.spec.dimensions] * batch.num_rows
        out = []
        for value in batch.column(column).to_pylist():
            found = json.loads(value).get("dimensions") if value else None
            out.append(found if found is not None else self.spec.dimensions)
        return out

    def __call__(self, batch: pa.Table) -> pa.Table:
        block = (batch.column(columns.ORDINAL)[0].as_py()
                 if batch.num_rows and columns.ORDINAL in batch.column_names else -1)
        with self.render_lock:
            batch = self.renderer(batch)
        token_ids = batch.column(columns.PROMPT_TOKEN_IDS)
        todo = [i for i in range(batch.num_rows) if token_ids[i].is_valid]
        results = self.recovery.generate(_Pooling(self.engine), block,
                                         self._requests(batch, todo))
        rows = batch.num_rows
        values: list[list[float] | None] = [None] * rows
        kinds = batch.column(columns.ERROR_KIND).to_pylist()
        errors = batch.column(columns.ERROR).to_pylist()
        for i, result in zip(todo, results):
            problem = result.error or self._check(result.values)
            if problem is not None:
                kinds[i] = result.error_kind or ErrorKind.ENGINE
                errors[i] = problem
            else:
                values[i] = result.values
        finish = batch.column(columns.FINISH_REASON)
        prompt_tokens = batch.column(columns.PROMPT_TOKENS)
        batch = batch.drop_columns([c for c in batch.column_names if c in _RENDERED])
        rows_of = lambda value, type_: pa.array([value] * rows, type_)  # noqa: E731
        release_free_memory()
        batch = (batch
                 .append_column(columns.REPLICA, rows_of(self.replica, pa.string()))
                 .append_column(columns.READY_AT, rows_of(self.ready_at, pa.float64()))
                 .append_column(columns.DONE_AT, rows_of(time.time(), pa.float64())))
        for name, column in self._outputs(values).items():
            batch = batch.append_column(name, column)
        return (batch
                .append_column(columns.FINISH_REASON, finish)
                .append_column(columns.PROMPT_TOKENS, prompt_tokens)
                .append_column(columns.COMPLETION_TOKENS, pa.nulls(rows, pa.int64()))
                .append_column(columns.ERROR_KIND, pa.array(kinds, pa.string()))
                .append_column(columns.ERROR, pa.array(errors, pa.string())))

    def _check(self, values: list[float]) -> str | None:
        """A result that cannot fill its columns is that row's error, never a broken part."""
        want = (len(self.spec.labels) if self.spec.task == "classify"
                else 1 if self.spec.task == "score" else self.spec.size)
        if want is not None and len(values) != want:
            return f"the engine returned {len(values)} values; the output column holds {want}"
        return None

    def _outputs(self, values: list[list[float] | None]) -> dict[str, pa.Array]:
        spec = self.spec
        if spec.task == "embed":
            flat = pa.array(values, pa.list_(pa.float32()))
            if spec.size is None:
                return {spec.output_column: flat}
            return {spec.output_column: flat.cast(pa.list_(pa.float32(), spec.size))}
        if spec.task == "score":
            return {spec.output_column: pa.array([v[0] if v else None for v in values],
                                                 pa.float32())}
        top = [spec.labels[max(range(len(v)), key=v.__getitem__)] if v else None
               for v in values]
        out = {spec.output_column: pa.array(top, pa.string())}
        for k, label in enumerate(spec.labels):
            out[probability_column(label)] = pa.array([v[k] if v else None for v in values],
                                                      pa.float32())
        return out

    def close(self) -> None:
        self.engine.close()


_RENDERED = {columns.PROMPT_TOKEN_IDS, columns.PROMPT_MESSAGES, columns.PAIR_START,
             columns.PAIR_TEXTS, columns.FINISH_REASON, columns.PROMPT_TOKENS,
             columns.ERROR_KIND, columns.ERROR}
