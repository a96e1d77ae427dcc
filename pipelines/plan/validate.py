"""``overnight validate``: the pre-flight checks, plus every prompt rendered and counted.

Runs the job's own renderer over the whole input on this machine, block by block (no Ray, no
engine), and reports what the run would see: prompt lengths, the rows that will fail and why,
and a few prompts as the model will read them.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field

import numpy as np
import pyarrow.compute as pc

from pipelines.config import JobConfig
from pipelines.errors import one_line
from pipelines.order.grouped import found_in, plan_line
from pipelines.order.heads import Heads, head_keys
from pipelines.plan.preflight import plan_job
from pipelines.plan.specs import JobPlan
from pipelines.read import blocks_at_once, read_block
from pipelines.storage import redact
from udfs import columns
from udfs.stages.pooler import PairRenderer
from udfs.stages.prompts import PromptRenderer

EXAMPLES = 3


@dataclass
class ValidationReport:
    plan: JobPlan
    rows: int = 0
    lengths: list[int] = field(default_factory=list)
    errors: Counter = field(default_factory=Counter)
    error_examples: dict[str, list[str]] = field(default_factory=dict)
    skipped: int = 0
    samples: list[str] = field(default_factory=list)
    reuse: str | None = None  # with output.reuse: the rows it would carry over, and why not
    heads: list = field(default_factory=list)  # each rendered row's head hashes and length

    def percentile(self, q: float) -> int:
        ordered = sorted(self.lengths)
        return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else 0

    @property
    def block_rows(self) -> int:
        return max((b.num_rows for b in self.plan.input.blocks), default=0)

    def blocks_and_batch_size(self) -> str:
        """How the blocks relate to ``resources.batch_size`` where they are smaller than it:
        a small table is cut finer to be committed more often, and an engine still takes as
        many rows at once (pipelines/read/sizes.py: plan_block_rows, blocks_at_once)."""
        resources, blocks = self.plan.config.resources, self.plan.input.blocks
        if not blocks or self.block_rows >= resources.batch_size:
            return ""
        at_once = blocks_at_once(resources.blocks_in_flight, resources.batch_size,
                                 self.block_rows, len(blocks))
        held = min(at_once * self.block_rows, self.plan.input.num_rows)
        return (f" (fewer than resources.batch_size: {resources.batch_size}, so that a table "
                f"this small is committed in {len(blocks)} parts; an engine still holds "
                f"up to {held} rows at once)")

    def lines(self) -> list[str]:
        p = self.plan
        out = [f"input: {len(p.input.files)} {p.input.format} file(s), {self.rows} rows, "
               f"{len(p.input.blocks)} blocks of up to {self.block_rows} rows, each committed "
               f"as it is done{self.blocks_and_batch_size()}",
               f"model: {p.config.model.name} (max_model_len {p.render.max_model_len}, "
               + (f"task {p.config.task})" if p.pooling else
                  f"max_tokens {p.render.max_tokens})")]
        if p.engine.kind == "http":
            o = p.engine.options
            out.append(f"server: {redact(o['base_url'])} serves "
                       f"{', '.join(o['served_models'])}; "
                       f"the job uses {o['served_model']!r} ({o['endpoint']} endpoint)")
        else:
            out.append(f"dtype: {_dtype_line(p.config.model.dtype)}")
        if self.lengths:
            out.append("prompt tokens: " + ", ".join(
                f"p{int(q * 100)} {self.percentile(q)}" for q in (0.5, 0.9, 0.99))
                + f", max {max(self.lengths)}"
                + (" (the text's; the engine adds each image's tokens)"
                   if p.render.images is not None and p.render.images.columns else ""))
        if self.skipped:
            out.append(f"will skip: {self.skipped} rows (prompt too long, on_too_long: skip)")
        for kind, n in self.errors.most_common():
            out.append(f"will fail: {n} rows {kind}, e.g. "
                       + "; ".join(self.error_examples[kind]))
        if not self.errors:
            out.append("will fail: no row")
        if self.heads and p.pooling is None:
            keys = np.array([k for k, _ in self.heads], dtype=np.uint64)
            found = found_in(Heads(keys, np.array([n for _, n in self.heads], dtype=np.int64)))
            out.append(plan_line(p.config, p, found))
        if self.reuse:
            out.append(self.reuse)
        for i, text in enumerate(self.samples):
            out.append(f"--- prompt {i + 1} ---\n{text}")
        return out


def _dtype_line(configured: str) -> str:
    """What the engine will compute in: ``auto`` on a CPU is decided here (udfs/engines/platform.py);
    on a GPU vLLM takes the model's own."""
    if configured != "auto":
        return configured
    from udfs.engines.platform import auto_dtype

    return (f"auto: {auto_dtype('cpu')} where the engine runs on this machine's CPU; on a "
            "GPU, the model's own dtype")


def validate_job(config: JobConfig) -> ValidationReport:
    plan = plan_job(config)
    renderer = (PairRenderer(plan.render, plan.config.prompt.pair_template)
                if plan.pooling and plan.pooling.task == "score" else PromptRenderer(plan.render))
    report = ValidationReport(plan=plan)
    key = config.input.id_column or columns.ORDINAL
    for block in plan.input.blocks:
        table = renderer(read_block(block, plan.input.schema))
        report.rows += table.num_rows
        if columns.PROMPT_TOKEN_IDS in table.column_names:  # the heads rows share
            report.heads.extend(head_keys(ids) for ids in
                                table.column(columns.PROMPT_TOKEN_IDS).to_pylist())
        keys = table.column(key).to_pylist()
        for i, (n, kind, error, reason) in enumerate(zip(
                table.column(columns.PROMPT_TOKENS).to_pylist(),
                table.column(columns.ERROR_KIND).to_pylist(),
                table.column(columns.ERROR).to_pylist(),
                table.column(columns.FINISH_REASON).to_pylist())):
            if n is not None:
                report.lengths.append(n)
            if kind is not None:
                report.errors[kind] += 1
                examples = report.error_examples.setdefault(kind, [])
                if len(examples) < EXAMPLES:
                    examples.append(f"row {keys[i]!r}: {error}")
            elif reason == columns.FinishReason.SKIPPED:
                report.skipped += 1
        if len(report.samples) < EXAMPLES:
            # rows that rendered: a row with an error shows above, among "will fail"
            ok = pc.and_(table.column(columns.PROMPT_TOKENS).is_valid(),
                         table.column(columns.ERROR_KIND).is_null())
            shown = table.filter(ok)
            rows = shown.select(renderer.variables).to_pylist()
            images = (shown.column(columns.PROMPT_IMAGES).to_pylist()
                      if columns.PROMPT_IMAGES in shown.column_names else [None] * len(rows))
            for row, found in list(zip(rows, images))[: EXAMPLES - len(report.samples)]:
                # each image as the chat template's placeholder, which the engine expands
                try:
                    report.samples.append(renderer.render_text(renderer.fill_nulls(row),
                                                               renderer.images_count(found)))
                except Exception as exc:  # noqa: BLE001 - rendered once: a row's, not ours
                    report.samples.append(f"(this row does not render again: "
                                          f"{one_line(exc, 200)})")
    report.reuse = _reuse_line(plan)
    return report


def _reuse_line(plan: JobPlan) -> str | None:
    """With output.reuse: how many rows the run would carry over (pipelines/reuse/carry.py)."""
    from pipelines.reuse.find import plan_reuse, reuse_source

    c = plan.config
    if plan.request_key is None or not (c.output.reuse or c.output.reuse_from):
        return None
    source = reuse_source(c)
    if source is None:
        return f"reuse: no earlier output at {c.output.path} yet; every row is generated"
    return plan_reuse(plan, source).line()
