"""What a run did, in numbers: the summary ``run_job`` returns, prints and keeps in the
job record."""

from __future__ import annotations

import json
from dataclasses import dataclass, field

from pipelines.reuse.find import steps_carried
from pipelines.write import add_steps
from udfs.columns import ErrorKind


@dataclass
class RunSummary:
    rows: int = 0  # output rows: input rows x samples (sampling.n), less any deduped
    input_rows: int = 0
    rows_total: int = 0
    rows_resumed: int = 0  # written by an earlier, interrupted run of the same job
    rows_reused: int = 0  # carried over from an earlier output (output.reuse)
    reuse: dict | None = None  # with output.reuse: what was carried over (pipelines/reuse/carry.py)
    skipped: int = 0
    errors: dict[str, int] = field(default_factory=dict)
    prompt_tokens: int = 0
    completion_tokens: int = 0
    parts: int = 0
    seconds: float = 0.0
    output: str = ""
    structured: bool = False
    deduped: int | None = None  # with output.dedupe: duplicate samples dropped
    recovery: dict | None = None  # engine restarts, retried blocks, isolated rows
    steps: list[dict] | None = None  # a job with steps: each step's counts (rows, tokens)
    keep_dropped: bool = False  # output.keep_dropped: rows a step dropped are written, not ok
    report: dict | None = None  # the run report (pipelines/report/run_report.py), once committed
    report_path: str | None = None

    @property
    def dropped(self) -> int:
        """Rows a step dropped that were written (output.keep_dropped): a step's skipped rows
        are dropped rows too, so they count once, as in the run report."""
        if not (self.keep_dropped and self.steps):
            return 0
        return sum(step.get("dropped", 0) for step in self.steps)

    @property
    def rows_ok(self) -> int:
        return self.rows - max(self.skipped, self.dropped) - sum(self.errors.values())

    def add_part(self, record: dict) -> None:
        self.parts += 1
        self.input_rows += record["input_rows"]
        self.rows += record["rows"]
        self.skipped += record["skipped"]
        self.prompt_tokens += record["prompt_tokens"]
        self.completion_tokens += record["completion_tokens"]
        for kind, n in json.loads(record["errors"]).items():
            self.errors[kind] = self.errors.get(kind, 0) + n
        if record.get("steps") is not None:
            self.steps = add_steps(self.steps or [], record["steps"])

    @property
    def rows_generated(self) -> int:
        """Rows the engine generated for (a parse error comes after generation)."""
        return self.rows_ok + self.errors.get(ErrorKind.PARSE, 0)

    def notes(self) -> list[str]:
        """What only some jobs have to say: structured-output validity, dedupe, resume."""
        out = []
        if self.rows_resumed:
            out.append(f"resumed: {self.rows_resumed} rows were written by an earlier run")
        if self.reuse is not None:
            r = self.reuse
            out.append(f"reused: {r['reused']} rows carried over from {r['source']}"
                       f"{steps_carried(r)} "
                       f"({r['prompt_tokens_saved'] + r['completion_tokens_saved']} tokens "
                       f"not generated again), {r['generated']} generated, {r['dropped']} "
                       "earlier rows no longer asked for")
        if self.structured:
            valid = self.rows_generated - self.errors.get(ErrorKind.PARSE, 0)
            out.append(f"structured output: {valid}/{self.rows_generated} valid "
                       f"({100 * valid / max(self.rows_generated, 1):.1f}%)")
        if self.deduped is not None:
            out.append(f"dedupe: {self.deduped} duplicate samples dropped")
        return out

    def lines(self) -> list[str]:
        errs = ", ".join(f"{k} {v}" for k, v in sorted(self.errors.items())) or "none"
        dropped = f"{self.dropped} dropped by a step, " if self.dropped else ""
        return [f"rows: {self.rows} written ({self.rows_ok} ok, {self.skipped} skipped, {dropped}"
                f"{sum(self.errors.values())} with errors: {errs})",
                *self.notes(),
                f"tokens: {self.prompt_tokens} in, {self.completion_tokens} out",
                f"time: {self.seconds:.1f} s; output: {self.output}"]

    def counts(self) -> dict:
        """The numbers kept in the job record."""
        return {k: v for k, v in self.__dict__.items() if k not in ("report", "report_path")}
