"""Prompt heads: each row's prompt as token ids, hashed at a ladder of prefix lengths, so rows
that share a head sort next to each other, and the share of prompt tokens in shared heads can be
counted. Rendered in the driver as pre-flight renders (the chat template alone) and tokenized
with the model's ``tokenizer.json`` through the ``tokenizers`` library: no transformers, no torch.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import pyarrow as pa

from udfs.stages.prompts import PromptRenderer, RenderSpec

# Prefix lengths (tokens) a row's head is hashed at: rows equal to 512 tokens sort together,
# and within them those equal to 1024. The cache reuses whole KV blocks (16 tokens and up):
# the ladder starts there.
DEPTHS = (16, 32, 64, 128, 256, 512, 1024, 2048, 4096, 8192)
# A head worth grouping for: a shorter one (a template's first lines, a system prompt) stays in
# the cache whatever the order, as every row touches it
MIN_HEAD = 128
NO_PROMPT = np.uint64(2**64 - 1)  # a row that does not render: after every head, in input order


@dataclass
class Heads:
    """The head hashes of a table's rows (one row each, ``keys[i, d]`` the hash of its first
    ``DEPTHS[d]`` tokens, or of all of them where it has fewer) and their prompts' lengths."""

    keys: np.ndarray  # (rows, len(DEPTHS)) uint64
    lengths: np.ndarray  # (rows,) int64; 0 for a row that does not render

    def grouped_order(self) -> np.ndarray:
        """The rows' positions sorted by head, shortest shared prefix first, ties (and rows
        that do not render) in input order: a stable order, the same in every run."""
        rows = np.arange(len(self.lengths))
        return np.lexsort((rows, *self.keys.T[::-1]))

    def shared_tokens(self, order: np.ndarray | None = None) -> int:
        """Prompt tokens each row shares with the row before it in ``order`` (default: input
        order), at the ladder's resolution, in heads of ``MIN_HEAD`` tokens or more: what a
        cache holding one such head at a time saves."""
        order = np.arange(len(self.lengths)) if order is None else order
        if len(order) < 2:
            return 0
        keys, lengths = self.keys[order], self.lengths[order]
        # hashes chain: equal at a depth, equal at every shallower one
        depth = (keys[1:] == keys[:-1]).sum(axis=1)
        shared = np.where(depth > 0, np.asarray(DEPTHS)[np.maximum(depth - 1, 0)], 0)
        shared = np.minimum(shared, np.minimum(lengths[1:], lengths[:-1]))
        return int(shared[shared >= MIN_HEAD].sum())

    @property
    def prompt_tokens(self) -> int:
        return int(self.lengths.sum())


def head_keys(ids: list[int] | None) -> tuple[list[int], int]:
    """One prompt's hashes at each depth of the ladder, and its length."""
    if ids is None:
        return [int(NO_PROMPT)] * len(DEPTHS), 0
    data = np.asarray(ids, dtype=np.uint32).tobytes()
    digest, keys, done = hashlib.blake2b(digest_size=8), [], 0
    for depth in DEPTHS:
        end = min(depth, len(ids)) * 4
        digest.update(data[done:end])
        done = end
        keys.append(int.from_bytes(digest.copy().digest(), "little") & (2**64 - 2))
    return keys, len(ids)


class HeadReader:
    """Renders rows as the job will and tokenizes them; None where the model's files are not
    here to read (a model only a server holds, a tokenizer without ``tokenizer.json``)."""

    def __init__(self, spec: RenderSpec, folder: Path):
        from tokenizers import Tokenizer

        from udfs.stages.chat_content import TemplateOnly

        template = TemplateOnly(str(folder))
        self.renderer = PromptRenderer(spec, tokenizer=template, placeholder=lambda n: "<image>")
        self.tokenizer = Tokenizer.from_file(str(folder / "tokenizer.json"))

    @classmethod
    def for_model(cls, spec: RenderSpec) -> HeadReader | None:
        folder = model_folder(spec.tokenizer)
        if folder is None:
            return None
        try:
            return cls(spec, folder)
        except Exception:  # noqa: BLE001 - a tokenizer or template only transformers reads
            return None

    def heads(self, table: pa.Table) -> Heads:
        """Every row's head hashes and prompt length."""
        names = self.renderer.variables
        values = {name: table.column(name).to_pylist() for name in names}
        rows = [{name: values[name][i] for name in names} for i in range(table.num_rows)]
        texts = self.renderer.render_texts(rows)
        ids: list[list[int] | None] = [None] * len(texts)
        for chat in (True, False):
            todo = [i for i, t in enumerate(texts) if t is not None and t[1] is chat]
            if todo:
                encoded = self.tokenizer.encode_batch([texts[i][0] for i in todo],
                                                      add_special_tokens=not chat)
                for i, enc in zip(todo, encoded):
                    ids[i] = enc.ids
        found = [head_keys(row) for row in ids]
        keys = np.array([k for k, _ in found], dtype=np.uint64).reshape(len(found), len(DEPTHS))
        return Heads(keys, np.array([n for _, n in found], dtype=np.int64))


def model_folder(name: str) -> Path | None:
    """The folder of the model's tokenizer files: the model's own folder, or its snapshot in
    the Hugging Face cache (read, never downloaded)."""
    folder = Path(name)
    if (folder / "tokenizer.json").is_file():
        return folder
    try:
        from huggingface_hub import try_to_load_from_cache

        found = try_to_load_from_cache(name, "tokenizer.json")
    except Exception:  # noqa: BLE001 - not a hub name either
        return None
    return Path(found).parent if isinstance(found, str) else None

