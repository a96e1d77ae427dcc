"""Prompt rendering: one row's columns -> a Jinja template -> the chat template -> token ids.

Rendering happens on the CPU before the engine sees a row, so that a row that cannot become a
prompt (a null in a template column, a prompt that cannot fit the context) is marked with an
error here and never costs engine time. Templates run in Jinja's sandbox (udfs/stages/templates.py);
a messages column is read as chat messages in udfs/stages/row_messages.py.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import pyarrow as pa

from udfs import columns
from udfs.rows import images
from udfs.stages.chat_content import (ContentError, image_placeholder, resolve_content_format,
                               string_content)
from udfs.columns import ErrorKind, FinishReason
from udfs.rows.images import ImageSpec
from udfs.rows.tool_calls import read_spec, row_spec
from udfs.stages import row_messages
from udfs.stages.chat_tools import normalize_tool_messages
from udfs.stages.templates import NullValue, compile_template, render_template
from udfs.transformers_imports import skip_scikit_learn


@dataclass(frozen=True)
class RenderSpec:
    """What the renderer needs; small and picklable, sent to each Ray worker."""

    template: str | None
    tokenizer: str  # model name or path
    max_model_len: int
    max_tokens: int
    system: str | None = None
    chat: bool = True
    on_too_long: str = "error"
    on_null: str = "error"
    trust_remote_code: bool = False
    messages_column: str | None = None  # instead of a template: the row's chat messages
    # Also keep each row's chat messages (JSON), for an engine that applies the chat template
    # itself (the HTTP engine's chat endpoint); the token ids still decide length and errors.
    keep_messages: bool = False
    max_tokens_column: str | None = None  # a row's own max_tokens: its prompt may use the rest
    # the chat template's own switches (enable_thinking...), as vLLM's chat path passes them
    chat_template_kwargs: dict | None = None
    # prompt.images: the columns of each row's images, which go into its user message before
    # the text; a messages column's image_url parts are images too, wherever they stand
    images: ImageSpec | None = None
    # how the chat template reads a message's content (udfs/stages/chat_content.py): "auto" as
    # vLLM's chat path tells it from the template, or "string" / "openai"
    chat_template_content_format: str = "auto"
    # Tools the chat template lists (udfs/rows/tool_calls.py: a tool spec's JSON), as vLLM's
    # chat path passes them: the job's, or a column of each row's own (null: the job's)
    tools: str | None = None
    tools_column: str | None = None


def load_tokenizer(name: str, trust_remote_code: bool = False):
    skip_scikit_learn()  # the replica's first import of transformers' models: here
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(name, trust_remote_code=trust_remote_code)


class PromptRenderer:
    """``map_batches`` callable: adds the prompt's token ids, its length and any row error.
    Whatever fails for one row (its template, the model's chat template, its images, the
    tokenizer) is that row's error, never the block's."""

    def __init__(self, spec: RenderSpec, tokenizer=None, placeholder=None):
        """``tokenizer``: the model's, loaded unless given (pre-flight gives the chat template
        alone: udfs/stages/chat_content.py, TemplateOnly); ``placeholder``: n -> the n-th image's
        text in a string-format template (default: vLLM's model class's)."""
        self.spec = spec
        if spec.messages_column is not None:
            self.template, self.variables = None, [spec.messages_column]
        else:
            self.template, self.variables = compile_template(spec.template)
        if spec.tools_column is not None and spec.tools_column not in self.variables:
            self.variables = [*self.variables, spec.tools_column]
        self.tokenizer = tokenizer or load_tokenizer(spec.tokenizer, spec.trust_remote_code)
        self.use_chat = spec.chat and bool(getattr(self.tokenizer, "chat_template", None))
        self.content_format = resolve_content_format(
            _chat_template(self.tokenizer), spec.chat_template_content_format) \
            if self.use_chat else "string"
        self._image_mark = placeholder
        self.budget = spec.max_model_len - spec.max_tokens
        self.image_columns = spec.images.columns if spec.images is not None else ()

    def __call__(self, batch: pa.Table) -> pa.Table:
        values = {name: batch.column(name).to_pylist() for name in self.variables}
        caps = (batch.column(self.spec.max_tokens_column).to_pylist()
                if self.spec.max_tokens_column else [None] * batch.num_rows)
        rows = [{name: values[name][i] for name in self.variables}
                for i in range(batch.num_rows)]
        found = self.images_of(batch, rows)
        rendered = self.render_rows(rows, caps, found)
        token_ids, lengths, reasons, kinds, errors = (list(c) for c in zip(*rendered)) \
            if rendered else ([], [], [], [], [])
        if self.spec.keep_messages:
            counts = [self.images_count(f) for f in found or [None] * len(rows)]
            messages = [self._messages_json(row, count) if ids is not None else None
                        for row, ids, count in zip(rows, token_ids, counts)]
            batch = batch.append_column(columns.PROMPT_MESSAGES, pa.array(messages, pa.string()))
        if found is not None:  # the images of each prompt, loaded where the engine takes them
            batch = batch.append_column(columns.PROMPT_IMAGES, pa.array(
                [f if ids is not None and isinstance(f, list) else None
                 for f, ids in zip(found, token_ids)], columns.PROMPT_IMAGES_TYPE))
        return (batch
                .append_column(columns.PROMPT_TOKEN_IDS, pa.array(token_ids, pa.list_(pa.int32())))
                .append_column(columns.PROMPT_TOKENS, pa.array(lengths, pa.int64()))
                .append_column(columns.FINISH_REASON, pa.array(reasons, pa.string()))
                .append_column(columns.ERROR_KIND, pa.array(kinds, pa.string()))
                .append_column(columns.ERROR, pa.array(errors, pa.string())))

    def _messages_json(self, row: dict, count: int) -> str | None:
        """The row's chat messages as JSON (rendered before, so they render again)."""
        try:
            return json.dumps(self.render_messages(self.fill_nulls(row), count))
        except Exception:  # noqa: BLE001 - never the block's end: the row keeps its ids
            return None

    def images_of(self, batch: pa.Table, rows: list[dict]) -> list[list[dict] | str] | None:
        """Each row's image sources, in the order its prompt holds them, or the one line of
        why they cannot be (the row's image_error); None where the job has no images."""
        if self.image_columns:
            values = {name: batch.column(name).to_pylist() for name in self.image_columns}
            return [self._column_images({n: values[n][i] for n in self.image_columns})
                    for i in range(batch.num_rows)]
        if self.template is None and self.spec.images is not None:  # image_url parts
            found = []
            for row in rows:
                try:
                    found.append(self.prompt(row)[2] if row[self.spec.messages_column]
                                 is not None else [])
                except Exception:  # noqa: BLE001 - rendering says why, as the row's error
                    found.append([])
            return found if any(found) else None
        return None

    def images_count(self, found: list[dict] | str | None) -> int:
        """The images prompt.images columns add before a row's text (a messages column's
        stand where its parts put them)."""
        return len(found) if isinstance(found, list) and self.image_columns else 0

    def _column_images(self, values: dict) -> list[dict] | str:
        found = []
        for name, value in values.items():
            try:
                one = images.sources(value)
            except ValueError as exc:
                return f"column {name!r}: {exc}"
            if not one and self.spec.on_null == "error":
                return f"column {name!r} is null in this row (prompt.on_null: empty sends " \
                    "the prompt without it)"
            found += one
        return found

    def prompt(self, row: dict, images_count: int = 0) -> tuple[str | None, list[dict] | None,
                                                               list[dict]]:
        """The row's prompt, rendered once: (a raw prompt, sent as it is, None, []) or (None,
        chat messages: the system message, then the rendered template or the row's own, the
        image sources its messages' image_url parts hold). ``images_count``: the row's images
        from prompt.images columns, placed before the template's text."""
        found: list[dict] = []
        if self.template is None:
            value = row_messages.decoded(row[self.spec.messages_column])
            if isinstance(value, str):
                return value, None, found
            messages, found = row_messages.messages(value)
        else:
            user = render_template(self.template, row, self.spec.on_null)
            if not self.use_chat:
                if images_count:
                    raise ValueError("images need the model's chat template, which places "
                                     "them (prompt.chat is off, or the model has none)")
                return user, None, found
            content = row_messages.user_content(user, images_count)
            messages = [{"role": "user", "content": content}]
        if self.spec.system and messages[0]["role"] != "system":
            messages.insert(0, {"role": "system", "content": self.spec.system})
        return None, messages, found

    def render_messages(self, row: dict, images_count: int = 0) -> list[dict]:
        """The row as chat messages (a raw prompt as one user message)."""
        raw, messages, _ = self.prompt(row, images_count)
        return messages if raw is None else [{"role": "user", "content": raw}]

    def render_text(self, row: dict, images_count: int = 0) -> str:
        """The prompt as the engine will see it, before tokenization (an image as the chat
        template's placeholder, which the engine expands into the image's tokens)."""
        return self._text(*self.prompt(row, images_count)[:2], self.row_tools(row))

    def row_tools(self, row: dict) -> list[dict] | None:
        """The tools a row's chat template lists (None: none): its column's, else the job's."""
        value = row.get(self.spec.tools_column) if self.spec.tools_column else None
        spec = read_spec(row_spec(value) if value else self.spec.tools)
        return spec["tools"] if spec is not None else None

    def _text(self, raw: str | None, messages: list[dict] | None,
              tools: list[dict] | None = None) -> str:
        if raw is not None:
            return raw
        # tools only where a row has them: a template may tell "no tools" from an empty list
        extra = {"tools": tools} if tools is not None else {}
        return self.tokenizer.apply_chat_template(self.for_template(messages), tokenize=False,
                                                  add_generation_prompt=True, **extra,
                                                  **(self.spec.chat_template_kwargs or {}))

    def for_template(self, messages: list[dict]) -> list[dict]:
        """The messages as the chat template reads them, as vLLM's chat path hands them over
        (udfs/stages/chat_content.py): "openai", each content a list of parts (a text a text part);
        "string", each content one string, an image's placeholder in it (a string-format
        template given a list once stopped the job: "can only concatenate str (not list)")."""
        out, taken = [], 0
        for message in messages:
            content = message["content"]
            if content is None:  # an assistant's turn of tool calls alone
                content = [] if self.content_format == "openai" else ""
            if self.content_format == "openai":
                if isinstance(content, str):
                    content = [{"type": "text", "text": content}]
            elif isinstance(content, list):
                content = string_content(content, self.image_mark, taken)
                taken += sum(part.get("type") == "image" for part in message["content"])
            out.append({**message, "content": content})
        if any("tool_calls" in m or m["role"] == "tool" for m in out):  # a tool conversation
            out = normalize_tool_messages(out, self.content_format)
        return out

    def image_mark(self, n: int) -> str:
        """The n-th image's placeholder in a string-format template's text."""
        if self._image_mark is None:
            self._image_mark = image_placeholder(self.spec.tokenizer,
                                                 self.spec.trust_remote_code)
        return self._image_mark(n)

    @staticmethod
    def fill_nulls(row: dict) -> dict:
        """on_null: empty -> nulls as empty strings (render_row has refused them otherwise)."""
        return {k: ("" if v is None else v) for k, v in row.items()}

    def nulls_handled(self, row: dict) -> tuple[dict | None, str | None]:
        """(the row the template sees, None), or (None, the error naming its first null
        column) where on_null is error."""
        nulls = [name for name, value in row.items()
                 if value is None and name != self.spec.tools_column]
        if not nulls:
            return row, None
        if self.spec.on_null == "error":
            return None, f"column {nulls[0]!r} is null in this row"
        return self.fill_nulls(row), None

    def tokenize(self, text: str, chat: bool) -> list[int]:
        # A chat template writes its own special tokens (BOS...): adding them again would
        # change the prompt from what vLLM's chat path sends.
        return self.tokenizer.encode(text, add_special_tokens=not chat)

    def render_row(self, row: dict, max_tokens: int | None = None, found=None):
        """-> (token ids to generate from or None, prompt length, finish_reason, error_kind,
        error) for one row; ``max_tokens``: the row's own, when lower than the job's;
        ``found``: its images (images_of)."""
        text = self._render_text(row, found)
        if isinstance(text, tuple):  # the row cannot become a prompt
            return text
        try:
            ids = self.tokenize(*text)
        except Exception as exc:  # noqa: BLE001 - a text the tokenizer refuses: the row's
            return None, None, None, ErrorKind.RENDER, f"template failed on this row: {exc}"
        return self._result(ids, found, max_tokens)

    def _result(self, ids: list[int], found, max_tokens: int | None) -> tuple:
        """The row's result for its token ids; an error on the way is the row's."""
        try:
            return self._placed(ids, found) or self._fit(ids, max_tokens)
        except Exception as exc:  # noqa: BLE001 - whatever it is, this row's alone
            return None, len(ids), None, ErrorKind.RENDER, _line(
                f"the prompt's images cannot be placed on this row: {exc}")

    def render_rows(self, rows: list[dict], caps: list[int | None],
                    found: list[list[dict] | str] | None = None) -> list[tuple]:
        """``render_row`` of each row, the texts tokenized in one batch call. A fast
        tokenizer's batch call releases the GIL while it runs (and may use spare cores): the
        engine's own thread in this process is not held up behind a block's rendering, which
        a call per row, holding the GIL, did. A subclass that renders rows its own way
        (``render_row``) keeps it."""
        if type(self).render_row is not PromptRenderer.render_row:
            return [self._guarded(row, cap) for row, cap in zip(rows, caps)]
        found = found or [None] * len(rows)
        results: list = [self._render_text(row, images) for row, images in zip(rows, found)]
        for chat in (True, False):
            todo = [i for i, r in enumerate(results) if isinstance(r, list) and r[1] is chat]
            if not todo:
                continue
            try:
                encoded = self.tokenize_batch([results[i][0] for i in todo], chat)
            except Exception:  # noqa: BLE001 - one text the tokenizer refuses: row by row
                encoded = [None] * len(todo)
            for i, ids in zip(todo, encoded):
                results[i] = (self._result(ids, found[i], caps[i])
                              if ids is not None else self.render_row(rows[i], caps[i], found[i]))
        return results

    def render_texts(self, rows: list[dict]) -> list[tuple[str, bool] | None]:
        """Each row's prompt text and whether it is chat (tokenized without special tokens),
        or None where the row cannot become a prompt (its error is the engine's to give)."""
        out = []
        for row in rows:
            result = self._render_text(row)
            out.append((result[0], result[1]) if isinstance(result, list) else None)
        return out

    def _guarded(self, row: dict, cap: int | None) -> tuple:
        """A subclass's ``render_row``, whatever it raises this row's render_error."""
        try:
            return self.render_row(row, cap)
        except Exception as exc:  # noqa: BLE001 - one row's, never the block's
            return None, None, None, ErrorKind.RENDER, _line(f"template failed on this row: "
                                                             f"{exc}")

    def _placed(self, ids: list[int], found) -> tuple | None:
        """None where the prompt's token ids hold one image placeholder per image; else the
        row's image_error. A row's text holding the model's own image token (``<image>``)
        would take an image's place, or leave one without a place (vLLM then fails)."""
        if not isinstance(found, list) or not found:
            return None
        run = self.placeholder_ids()
        if not run:
            return None
        held = sum(1 for i in range(len(ids) - len(run) + 1) if ids[i:i + len(run)] == run)
        if held == len(found):
            return None
        token = self.tokenizer.decode(run).strip()
        return (None, len(ids), None, ErrorKind.IMAGE,
                f"the prompt holds {held} image placeholders ({token!r}) for {len(found)} "
                f"image(s): the row's text holds the model's image token, which is not "
                "allowed in a text")

    def placeholder_ids(self) -> list[int]:
        """The token ids the chat template writes for one image: found once, by rendering a
        message with and without an image part (a string-format template: the placeholder
        vLLM puts in the text, as the tokenizer reads it)."""
        if getattr(self, "_image_run", None) is None and self.content_format == "string" \
                and self.use_chat:
            self._image_run = self.tokenizer.encode(self.image_mark(1),
                                                    add_special_tokens=False)
        if getattr(self, "_image_run", None) is None:
            def ids(content):
                return self.tokenize(self._text(None, [{"role": "user", "content": content}]),
                                     False)

            text = {"type": "text", "text": "x"}
            a, b = ids([{"type": "image"}, text]), ids([text])
            head = next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))
            tail = 0
            while tail < len(b) - head and a[len(a) - 1 - tail] == b[len(b) - 1 - tail]:
                tail += 1
            self._image_run = a[head:len(a) - tail]
        return self._image_run

    def tokenize_batch(self, texts: list[str], chat: bool) -> list[list[int]]:
        """``tokenize`` of each text, in one call: the same ids."""
        backend = getattr(self.tokenizer, "_tokenizer", None)  # a fast tokenizer's own
        # (not where its tokenizer.json pads or truncates: all-MiniLM-L6-v2's pads every
        # text to 128 with zeros, which encode() leaves to the caller)
        if backend is not None and hasattr(backend, "encode_batch") \
                and backend.padding is None and backend.truncation is None:
            # encode_batch_fast (tokenizers >= 0.21) does not compute character offsets,
            # which nothing here reads: the same ids for less CPU, which the engine's
            # process shares
            encode = getattr(backend, "encode_batch_fast", backend.encode_batch)
            return [e.ids for e in encode(texts, add_special_tokens=not chat)]
        return self.tokenizer(texts, add_special_tokens=not chat)["input_ids"]

    def _render_text(self, row: dict, found: list[dict] | str | None = None):
        """[the prompt's text, whether it is chat] for a row, or the row's result (a tuple, as
        ``render_row``'s) when it cannot become a prompt (a null, a template that fails, an
        image column that holds no image). ``found``: the row's image sources (images_of)."""
        if isinstance(found, str):
            return None, None, None, ErrorKind.IMAGE, found
        count = self.images_count(found)
        row, null = self.nulls_handled(row)
        if null is not None:
            return None, None, None, ErrorKind.NULL_FIELD, null
        try:
            raw, messages, _ = self.prompt(row, count)
        except NullValue as exc:  # a null inside a column, printed: as a column's null
            return None, None, None, ErrorKind.NULL_FIELD, str(exc)
        except Exception as exc:  # a template error on this row's values: the row's problem
            return None, None, None, ErrorKind.RENDER, _line(f"template failed on this row: "
                                                             f"{exc}")
        try:
            tools = self.row_tools(row)
        except ValueError as exc:  # a tools column's value that is not a tool spec
            return None, None, None, ErrorKind.RENDER, _line(f"{self.spec.tools_column}: {exc}")
        try:
            text = self._text(raw, messages, tools)
        except ContentError as exc:  # the row's text holds more image placeholders
            return None, None, None, ErrorKind.IMAGE, _line(str(exc))
        except Exception as exc:  # noqa: BLE001 - the model's chat template, on this row
            return None, None, None, ErrorKind.RENDER, _line(
                f"the model's chat template failed on this row: {_reason(exc)}")
        # vLLM's chat path tokenizes a multimodal model's prompt with its special tokens
        # added (its processor's default), a text model's without
        images = bool(self.image_columns) or bool(found)
        return [text, raw is None and not images]

    def _fit(self, ids: list[int], max_tokens: int | None = None):
        """The row's result for its token ids: as they are, cut, skipped or an error."""
        budget = self.budget
        if max_tokens is not None:
            budget = self.spec.max_model_len - max(1, min(max_tokens, self.spec.max_tokens))
        if len(ids) <= budget:
            return ids, len(ids), None, None, None
        if self.spec.on_too_long == "truncate" and budget > 0:
            head = budget // 2
            ids = ids[:head] + ids[len(ids) - (budget - head):]
            return ids, len(ids), None, None, None
        if self.spec.on_too_long == "skip":
            return None, len(ids), FinishReason.SKIPPED, None, None
        return None, len(ids), None, ErrorKind.PROMPT_TOO_LONG, (
            f"prompt has {len(ids)} tokens; max_model_len {self.spec.max_model_len} "
            f"- max_tokens {self.spec.max_model_len - budget} leaves {budget}")


def rows_fail_alike(spec: RenderSpec, table: pa.Table, key: str, trials: int = 20,
                    least: int = 3) -> str | None:
    """Where each of the first ``trials`` rows of ``table`` that can render (a null the row's
    own error aside) fails to, with one and the same error, and at least ``least`` did: that
    error, with the first such row's key ("row 'P01': the model's chat template failed on
    this row: ..."); else None. Rendered as the job renders them, with the chat template
    alone (``TemplateOnly``: no tokenizer, no torch); a model whose chat template is not in
    its folder is not tried here. A string-format template's image placeholder stands in as
    ``<image>`` (vLLM's own needs vLLM imported)."""
    from udfs.stages.chat_content import TemplateOnly

    template = TemplateOnly(spec.tokenizer)
    if spec.chat and template.chat_template is None:
        return None  # (its tokenizer may hold one pre-flight cannot see)
    try:
        renderer = PromptRenderer(spec, tokenizer=template, placeholder=lambda n: "<image>")
    except Exception:  # noqa: BLE001 - a template pre-flight checks elsewhere
        return None
    sample = table.slice(0, trials)
    rows = [{name: sample.column(name)[i].as_py() for name in renderer.variables}
            for i in range(sample.num_rows)]
    found = renderer.images_of(sample, rows) or [None] * len(rows)
    keys = sample.column(key).to_pylist()
    errors = []
    for i, (row, sources) in enumerate(zip(rows, found)):
        result = renderer._render_text(row, sources)
        if isinstance(result, list):
            return None  # a row renders: the others' errors are their own
        if result[3] == ErrorKind.RENDER:
            errors.append((keys[i], result[4]))
    if len(errors) < least or len({error for _, error in errors}) != 1:
        return None
    if template.missing_names:
        # a name the chat template found undefined here: one transformers may define (a
        # tokenizer class's default bos_token), so the real tokenizer may render every row
        return None
    return f"row {errors[0][0]!r}: {errors[0][1]}"


def _chat_template(tokenizer) -> str | None:
    """The tokenizer's default chat template's text (a tokenizer may hold several, by name)."""
    try:
        return tokenizer.get_chat_template()
    except Exception:  # noqa: BLE001 - none, or named ones without a default
        template = getattr(tokenizer, "chat_template", None)
        return template if isinstance(template, str) else None


def _reason(exc: BaseException) -> str:
    """What a template said: its own ``raise_exception`` message, or the error's."""
    return str(exc) or type(exc).__name__


def _line(text: str, limit: int = 500) -> str:
    """A row's error in one line."""
    return " ".join(text.split())[:limit]
