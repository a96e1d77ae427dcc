"""The prepared table: a Batch file read once, streaming, into a Parquet table of runnable
requests (the job's input) and a file of the error lines of those that cannot run."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq

from pipelines.batchfile import embeddings
from pipelines.batchfile.envelopes import error_line, jsonl
from pipelines.batchfile.lines import (CUSTOM_ID, KIND, LINE, MAX_TOKENS, MODEL, PROMPT, SCHEMA,
                                       TOOLS, Reject, numbered_lines, parse_request)

# requests per row group of the prepared table, and their bytes at most (an embeddings line
# may hold 2,048 inputs): memory stays flat, here and where the table is read
CHUNK, CHUNK_BYTES = 10_000, 64 << 20


@dataclass
class Prepared:
    """What ``prepare`` made of a request file: its two files and their counts."""

    table: Path  # the prepared requests (Parquet)
    errors: Path  # lines that cannot run (JSONL, in line order)
    requests: int
    rejected: int
    max_tokens: int  # the largest a request asks for: the job's cap
    task: str = "generate"  # or "embed": a file of /v1/embeddings lines
    tools: int = 0  # the requests with tools


def prepare(requests: Path, work: Path, default_max_tokens: int | None,
            max_model_len: int, prompt_lengths=None, adapter_of=None,
            fmt: str = "openai", tool_parser: str | None = None) -> Prepared:
    """Read the request file once, streaming: runnable requests to Parquet, the rest to the
    error file (both in line order). With ``default_max_tokens`` None, a request without
    max_tokens gets the room its prompt leaves in the context, as the hosted API's and vLLM's
    defaults: ``prompt_lengths(prompts)`` counts the prompts' tokens (``prompt_counter``).
    ``adapter_of`` (a job with LoRA adapters, ``model_resolver``): a request's ``model`` ->
    the adapter it runs on (None: the base model); a model it does not serve is the
    request's error. ``tool_parser``: the job's model.tool_parser (a request whose
    tool_choice needs one is the request's error without it)."""
    table, errors = work / "requests.parquet", work / "rejected.jsonl"
    tmp_table, tmp_errors = work / ".requests.parquet.tmp", work / ".rejected.jsonl.tmp"
    seen: set[str] = set()
    count = rejected = tools = 0
    family = None  # embeddings, or chat/completions: the first runnable line's
    with pq.ParquetWriter(tmp_table, SCHEMA) as writer, \
            open(tmp_errors, "w", encoding="utf-8") as bad:
        groups = _RowGroups(writer, max_model_len, prompt_lengths)
        for number, raw in numbered_lines(requests):
            try:
                row = _request_row(raw, default_max_tokens, max_model_len, fmt, adapter_of,
                                   seen, family, tool_parser)
            except Reject as exc:
                bad.write(jsonl(error_line(number, exc.custom_id, exc.code, exc.message)))
                rejected += 1
                continue
            seen.add(row[CUSTOM_ID])
            family = family or _family(row[KIND])
            groups.add({**row, LINE: number}, len(raw))
            count += 1
            tools += row.get(TOOLS) is not None
        groups.flush()
    os.replace(tmp_table, table)
    os.replace(tmp_errors, errors)
    return Prepared(table, errors, count, rejected, groups.top or default_max_tokens or 1,
                    task="embed" if family == embeddings.KIND else "generate", tools=tools)


def _request_row(raw: bytes, default_max_tokens: int | None, max_model_len: int, fmt: str,
                 adapter_of, seen: set[str], family: str | None,
                 tool_parser: str | None = None) -> dict:
    """One line's row of the prepared table; Reject where it cannot run: the line's own
    error, a model the job does not serve, a ``custom_id`` an earlier line ran under, or an
    endpoint other than the file's (``family``, the first runnable line's)."""
    try:
        row = parse_request(raw.decode("utf-8"), default_max_tokens, max_model_len, fmt,
                            tool_parser)
    except UnicodeDecodeError:
        raise Reject("invalid_json", "not valid UTF-8") from None
    if adapter_of is not None and row[KIND] != embeddings.KIND:
        try:
            row[MODEL] = adapter_of(row[MODEL])
        except Reject as caught:
            caught.custom_id = row[CUSTOM_ID]
            raise
    if row[CUSTOM_ID] in seen:
        reject = Reject("duplicate_custom_id", f"custom_id {row[CUSTOM_ID]!r} was used by "
                        "an earlier line, which runs; this one does not")
    elif family is not None and _family(row[KIND]) != family:
        reject = Reject("invalid_url", f"{family} and other requests cannot share a file (a "
                        "batch has one endpoint, as the Batch API's); put these lines in a "
                        "file of their own")
    else:
        return row
    reject.custom_id = row[CUSTOM_ID]
    raise reject


class _RowGroups:
    """The prepared table's rows, written a row group at a time (``CHUNK`` rows, or
    ``CHUNK_BYTES`` of their lines), so memory stays flat; ``top``: the largest max_tokens."""

    def __init__(self, writer: pq.ParquetWriter, max_model_len: int, prompt_lengths):
        self.writer = writer
        self.max_model_len, self.prompt_lengths = max_model_len, prompt_lengths
        self.rows: list[dict] = []
        self.size = self.top = 0  # size: the bytes of the lines in ``rows``

    def add(self, row: dict, size: int) -> None:
        self.rows.append(row)
        self.top = max(self.top, row[MAX_TOKENS] or 0)
        self.size += size
        if len(self.rows) >= CHUNK or self.size >= CHUNK_BYTES:
            self.flush()

    def flush(self) -> None:
        """The rows held written as one row group, those without max_tokens given theirs."""
        if self.rows:
            self.top = max(self.top, _fill_room(self.rows, self.max_model_len,
                                                self.prompt_lengths))
            self.writer.write_table(pa.Table.from_pylist(self.rows, SCHEMA))
            self.rows, self.size = [], 0


def _fill_room(rows: list[dict], max_model_len: int, prompt_lengths) -> int:
    """The rows without max_tokens given the room their prompts leave (at least 1: a prompt
    that fills the context is then the job's ``prompt_too_long``, in the job's own words);
    returns the largest of those."""
    todo = [row for row in rows if row[MAX_TOKENS] is None]
    if not todo:
        return 0
    lengths = prompt_lengths([row[PROMPT] for row in todo], [row.get(TOOLS) for row in todo])
    for row, length in zip(todo, lengths):
        # a prompt the renderer refuses (no length) fails the same way in the job
        row[MAX_TOKENS] = 1 if length is None else max(1, max_model_len - length)
    return max(row[MAX_TOKENS] for row in todo)


def prompt_counter(model: str, max_model_len: int, trust_remote_code: bool = False):
    """``prompts -> token counts`` as the job will count them: its own renderer (the
    prepared table's prompt column through the model's chat template), loaded once."""
    from udfs.stages.prompts import PromptRenderer, RenderSpec

    renderer = None

    def count(prompts: list[str], tools: list[str | None] | None = None) -> list[int | None]:
        nonlocal renderer
        if renderer is None:
            renderer = PromptRenderer(RenderSpec(
                template=None, tokenizer=model, max_model_len=max_model_len, max_tokens=1,
                trust_remote_code=trust_remote_code, messages_column=PROMPT,
                tools_column=TOOLS))
        tools = tools or [None] * len(prompts)
        rendered = renderer.render_rows([{PROMPT: p, TOOLS: t} for p, t in zip(prompts, tools)],
                                        [None] * len(prompts))
        return [length for _, length, *_ in rendered]  # None: the renderer refused it

    return count


def model_resolver(served: str, model: str, adapters) -> callable:
    """A request's ``model`` -> its LoRA adapter (None: the base model), as ``vllm serve
    --lora-modules`` routes it: an adapter's name runs on it; the served model's name, its
    path or no model on the base; any other name is the request's ``model_not_found``."""
    names = tuple(adapters)

    def adapter_of(name: str | None) -> str | None:
        if name in names:
            return name
        if name is None or name in (served, model):
            return None
        raise Reject("model_not_found", f"body.model {name!r} is neither the served model "
                     f"({served!r}) nor one of its adapters ({', '.join(names)})")

    return adapter_of


def _family(kind: str) -> str:
    return embeddings.KIND if kind == embeddings.KIND else "chat/completions"
