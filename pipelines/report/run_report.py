"""The run report: what a job produced, what failed, how long it took, what it would have cost.

Written at the end of every run as ``OUTPUT.report.json`` beside the output (not inside it: the
output directory holds Parquet parts only, so that ``pl.read_parquet(OUTPUT)`` reads it), printed
as a short table (report_text.py), and rendered as a small HTML page by ``overnight report
OUTPUT --html FILE`` (report_html.py).

Row and token numbers are counted from the committed output itself; times come from the run's
part records (which replica generated each block, when its engine was ready, when the block was
done), so a report rebuilt later from the output alone has every number but the times.
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from pipelines.errors import OutputError
from pipelines.storage import Location, scrub_record
from pipelines.write import OutputStore, list_parts
from udfs import columns

EXAMPLES = 3  # example ids per error kind
HISTOGRAM_BINS = 20


def report_path(output: str | Path | Location) -> Location:
    return Location.of(output).sibling(".report.json")


def build_report(output: str | Path, record: dict, *, timings: dict | None = None,
                 times: RunTimes | None = None, samples: list[dict] | None = None,
                 stats: list[dict] | None = None) -> dict:
    """The report of a committed output. ``record`` is the job record (config, fingerprint);
    ``timings`` ({started, planned, ray_ready, finished}, Unix seconds) and ``times`` (this
    run's part records from the writer, added up) add the time split and the throughput;
    ``samples`` (the replicas' live token counts over time) the throughput over time.
    ``stats``: each output file's counts (pipelines/write/compact.py), as the compaction returned
    them; without them they are counted from the output, a file at a time."""
    from pipelines.write.compact import output_stats

    config = record.get("config", {})
    key = (config.get("input") or {}).get("id_column") or columns.ROW_ID
    output = Location.of(output)
    if stats is None:
        stats = output_stats(output, key)
    errors = _errors_by_kind(stats)
    steps = _steps(stats)
    report = _counted(output, record, stats, errors, steps)
    if steps:  # a job with steps: each step's rows in and out, dropped, errors, tokens, time
        report["steps"] = steps
    report.update(_model_sections(output, config, stats, errors, report))
    report["cost"] = _cost((config.get("report") or {}).get("price_per_mtok"), report["tokens"])
    summary = record.get("summary") or {}
    reuse = summary.get("reuse") or record.get("reuse")
    if reuse:  # output.reuse: the rows carried over, and what generating them would cost
        report["reuse"] = _reuse(reuse, (config.get("report") or {}).get("price_per_mtok"))
    if timings and times is not None:
        _add_times(report, timings, times, samples)
        if timings.get("grouped") and "prefix_cache" in report:  # pipelines/order/grouped.py
            report["prefix_cache"]["grouped_by_prefix"] = timings["grouped"]
    report["sample_rows"] = _sample_rows(output, config, key)
    report["output_column"] = (config.get("output") or {}).get("column", "generated")
    return report


def _errors_by_kind(stats: list[dict]) -> dict[str, dict]:
    """The output files' error counts by kind, added up, with a few example ids of each."""
    errors: dict[str, dict] = {}
    for file in stats:
        for kind, n in json.loads(file["errors"]).items():
            entry = errors.setdefault(kind, {"count": 0, "examples": []})
            entry["count"] += n
            entry["examples"].extend(file["error_examples"].get(kind, []))
    return {kind: {"count": e["count"], "examples": [_plain(v) for v in
                                                     e["examples"][:EXAMPLES]]}
            for kind, e in sorted(errors.items())}


def _counted(output: Location, record: dict, stats: list[dict], errors: dict,
             steps: list[dict]) -> dict:
    """The sections every report has: the job's model and sampling, its rows, files and tokens
    as counted from the output files, and the engines' recovery."""
    config = record.get("config", {})
    rows = sum(f["rows"] for f in stats)
    failed = sum(e["count"] for e in errors.values())
    skipped = sum(f["skipped"] for f in stats)
    values = {column: _merged([f["values"][column] for f in stats])
              for column in (columns.PROMPT_TOKENS, columns.COMPLETION_TOKENS)}
    summary = record.get("summary") or {}
    # rows a step dropped, written with output.keep_dropped: not ok (a step's skipped rows
    # are dropped rows too, counted once)
    kept_dropped = (sum(s["dropped"] for s in steps)
                    if steps and (config.get("output") or {}).get("keep_dropped") else 0)
    return {
        "output": str(output),
        "created": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "fingerprint": record.get("fingerprint_hash"),
        "model": {**(config.get("model") or {}),
                  "max_model_len": (record.get("fingerprint") or {}).get("model", {}).get(
                      "max_model_len"),
                  "engine": config.get("engine")},
        "sampling": config.get("sampling"),
        "rows": {"input": record.get("rows_total"), "output": rows,
                 "ok": rows - failed - max(skipped, kept_dropped), "skipped": skipped,
                 "dropped": kept_dropped,
                 "errors": failed, "resumed": summary.get("rows_resumed", 0),
                 "errors_by_kind": errors},
        "files": {"count": len(stats), "largest_rows": max((f["rows"] for f in stats),
                                                           default=0)},
        "tokens": {"prompt": _stats(values[columns.PROMPT_TOKENS]),
                   "output": _stats(values[columns.COMPLETION_TOKENS])},
        "histogram": {"output_tokens": _histogram(values[columns.COMPLETION_TOKENS])},
        "recovery": summary.get("recovery") or {},
    }


def _model_sections(output: Location, config: dict, stats: list[dict], errors: dict,
                    report: dict) -> dict:
    """The sections only some models have: a thinking model's reasoning, the images the
    prompts held, the rows and tokens by LoRA adapter."""
    sections = {}
    rows = report["rows"]["output"]
    if (config.get("model") or {}).get("reasoning_parser"):
        # a thinking model: its output tokens split, thinking and answer (the hosted cost
        # counts both, as hosted APIs bill them), and the rows it thought away
        thinking = sum(f.get("reasoning_tokens", 0) for f in stats)
        out = report["tokens"]["output"]["total"]
        no_answer = errors.get(columns.ErrorKind.NO_ANSWER, {}).get("count", 0)
        sections["reasoning"] = {"reasoning_tokens": thinking, "answer_tokens": out - thinking,
                                 "no_answer_rows": no_answer,
                                 "no_answer_share": round(no_answer / rows, 4) if rows else 0.0}
    if (config.get("prompt") or {}).get("images"):  # the images the prompts held
        sections["images"] = {"images": sum(f.get(columns.IMAGE_COUNT, 0) for f in stats),
                              "image_tokens": sum(f.get(columns.IMAGE_TOKENS, 0)
                                                  for f in stats)}
    if (config.get("model") or {}).get("adapters"):
        sections["adapters"] = adapter_counts(output, config)
    return sections


def _add_times(report: dict, timings: dict, times: RunTimes,
               samples: list[dict] | None) -> None:
    """This run's time split and throughput, and the throughput over time as sampled."""
    report.update(_times(timings, times))
    if samples:  # the throughput as the replicas generated it, not as parts landed
        report["samples"] = [{"t": round(s["t"] - timings["started"], 2),
                              "tokens": s["tokens"]} for s in samples]
        # engines waiting for blocks, summed over replicas: a starved engine shows here
        report["time"]["engine_idle_s"] = round(samples[-1].get("idle_s", 0), 2)


BASE = "(base model)"  # the report's name for rows on no adapter


def adapter_counts(output: Location, config: dict) -> dict:
    """Rows generated and tokens by LoRA adapter: {name: {rows, prompt_tokens,
    completion_tokens}}, the base model as BASE. Each generation (the job's, or each step's,
    under its own columns) is grouped by its adapter column, or counted under its default;
    read a file at a time, the few columns it needs only."""
    model = config.get("model") or {}
    generations = []  # (adapter column, default, prompt tokens, completion tokens, finish)
    if config.get("steps"):
        for step in config["steps"]:
            if step.get("prompt") is None:
                continue
            c = step.get("column") or step["name"]
            generations.append((step["prompt"].get("adapter_column"),
                                step.get("adapter") or model.get("adapter"),
                                *(columns.step_column(c, m) for m in (
                                    columns.PROMPT_TOKENS, columns.COMPLETION_TOKENS,
                                    columns.FINISH_REASON))))
    else:
        generations.append(((config.get("prompt") or {}).get("adapter_column"),
                            model.get("adapter"), columns.PROMPT_TOKENS,
                            columns.COMPLETION_TOKENS, columns.FINISH_REASON))
    counts: dict[str, dict] = {}
    for part in list_parts(output)[0]:
        with (output / part.name).open() as handle:
            names = pq.read_schema(handle).names
            wanted = {c for g in generations for c in (g[0], *g[2:]) if c and c in names}
            table = pq.read_table(handle, columns=sorted(wanted))
        for column, default, prompt, completion, finish in generations:
            if finish not in table.column_names:
                continue
            ran = table.filter(pc.is_valid(table.column(finish)))
            fallback = pa.scalar(default or BASE, pa.string())
            names_ = (pc.fill_null(pc.cast(ran.column(column), pa.string()), fallback)
                      if column and column in ran.column_names
                      else pa.array([default or BASE] * ran.num_rows, pa.string()))
            grouped = pa.table({"adapter": names_, "p": pc.fill_null(ran.column(prompt), 0),
                                "c": pc.fill_null(ran.column(completion), 0)}).group_by(
                "adapter").aggregate([("p", "count"), ("p", "sum"), ("c", "sum")])
            for row in grouped.to_pylist():
                entry = counts.setdefault(row["adapter"], {"rows": 0, "prompt_tokens": 0,
                                                           "completion_tokens": 0})
                entry["rows"] += row["p_count"]
                entry["prompt_tokens"] += row["p_sum"]
                entry["completion_tokens"] += row["c_sum"]
    return dict(sorted(counts.items()))


def _steps(stats: list[dict]) -> list[dict]:
    """The output files' per-step counts, added up (a job with steps; else none)."""
    from pipelines.write import add_steps

    total: list[dict] = []
    for file in stats:
        if file.get("steps"):
            total = add_steps(total, file["steps"])
    return total


def _merged(counts: list[list]) -> list[tuple[int, int]]:
    """Several files' {value: rows} (as sorted pairs) as one, sorted by value."""
    total: dict[int, int] = defaultdict(int)
    for pairs in counts:
        for value, n in pairs:
            total[value] += n
    return sorted(total.items())


SAMPLE_ROWS, SAMPLE_CHARS = 5, 160


def _sample_rows(output: Location, config: dict, key: str) -> list[dict]:
    """A few rows of the output, input beside output, for the HTML page."""
    parts = list_parts(output)[0]
    if not parts:
        return []
    with (output / parts[0].name).open() as handle:  # the first rows only, not the file
        part = pa.Table.from_batches([next(pq.ParquetFile(handle).iter_batches(
            batch_size=SAMPLE_ROWS))])
    text = (config.get("output") or {}).get("column", "generated")
    shown = [c for c in part.column_names if c not in (*columns.GENERATED, columns.ROW_ID)]
    rows = []
    for row in part.slice(0, SAMPLE_ROWS).to_pylist():
        rows.append({c: _clip(row[c]) for c in [key, *[c for c in shown if c != key]]
                     if c in row} | {"error": _clip(row.get(columns.ERROR))}
                    | ({text: _clip(row.get(text))} if text in row else {}))
    return rows


def _clip(value) -> str | None:
    if value is None:
        return None
    text = value if isinstance(value, str) else json.dumps(value, default=str)
    return text if len(text) <= SAMPLE_CHARS else text[:SAMPLE_CHARS - 1] + "…"


def _plain(value):
    return value if isinstance(value, (str, int, float, bool)) or value is None else str(value)


def _stats(pairs: list[tuple[int, int]]) -> dict:
    """Total, mean, p50, p95 and max of values given as (value, rows) pairs, sorted."""
    rows = sum(n for _, n in pairs)
    if rows == 0:
        return {"total": 0, "mean": None, "p50": None, "p95": None, "max": None}
    total = sum(v * n for v, n in pairs)
    return {"total": int(total), "mean": round(total / rows, 2),
            "p50": _quantile(pairs, rows, 0.5), "p95": _quantile(pairs, rows, 0.95),
            "max": int(pairs[-1][0])}


def _quantile(pairs: list[tuple[int, int]], rows: int, q: float) -> int:
    """The nearest-rank quantile (polars' "nearest": the value at index round(q*(n-1)))."""
    index, seen = round(q * (rows - 1)), 0
    for value, n in pairs:
        seen += n
        if seen > index:
            return int(value)
    return int(pairs[-1][0])


def _histogram(pairs: list[tuple[int, int]]) -> dict:
    if not pairs:
        return {"edges": [], "counts": []}
    top = int(pairs[-1][0]) + 1
    width = max(1, -(-top // HISTOGRAM_BINS))  # ceil
    counts = [0] * -(-top // width)
    for value, n in pairs:
        counts[int(value) // width] += n
    return {"edges": [i * width for i in range(len(counts) + 1)], "counts": counts}


def _reuse(reuse: dict, prices: dict | None) -> dict:
    out = {k: reuse.get(k) for k in ("source", "reused", "generated", "dropped", "failed",
                                      "why_none", "prompt_tokens_saved",
                                      "completion_tokens_saved")}
    if reuse.get("from_step") is not None:  # a job of steps: its first steps' columns
        out.update(from_step=reuse["from_step"], from_step_name=reuse.get("from_step_name"))
    if prices:
        out["cost_saved"] = round(reuse.get("prompt_tokens_saved", 0) / 1e6 * prices["input"]
                                  + reuse.get("completion_tokens_saved", 0) / 1e6
                                  * prices["output"], 6)
    return out


def _cost(prices: dict | None, tokens: dict) -> dict | None:
    if not prices:
        return None
    cost_in = tokens["prompt"]["total"] / 1e6 * prices["input"]
    cost_out = tokens["output"]["total"] / 1e6 * prices["output"]
    return {"price_per_mtok": prices, "input": round(cost_in, 6), "output": round(cost_out, 6),
            "total": round(cost_in + cost_out, 6)}


class RunTimes:
    """This run's part records (from the writer), added up as they land: when the engines
    were ready, each replica's rows and tokens, and a timeline of at most ``points`` time
    slices. The driver keeps a few numbers per replica, not a record per part (a 10M-row job
    writes ~39,000 parts)."""

    def __init__(self, started: float, points: int = 512):
        self.started, self.points, self.width = started, points, 1.0  # a slice's seconds
        self.tokens = 0  # every part's; the rest counts generated parts only
        self.rows = self.prompt_tokens = 0
        self.cached_tokens: int | None = None  # None: no engine said (an HTTP engine's)
        self.ready: float | None = None
        self.last: float | None = None
        self.replicas: dict[str, dict] = {}
        self.slices: dict[int, list] = {}  # slice -> [last done_at, rows, output tokens]

    def add(self, part: dict) -> None:
        self.tokens += part["completion_tokens"]
        if part.get("ready_at") is None:
            return
        ready, done = part["ready_at"], part["done_at"]
        self.rows += part["rows"]
        self.prompt_tokens += part["prompt_tokens"]
        self.ready = ready if self.ready is None else min(self.ready, ready)
        self.last = done if self.last is None else max(self.last, done)
        r = self.replicas.setdefault(part["replica"], {"rows": 0, "output_tokens": 0,
                                                       "parts": 0, "ready_at": ready,
                                                       "last_done_at": done,
                                                       "prompt_tokens": 0, "cached_tokens": None})
        r["rows"] += part["rows"]
        r["prompt_tokens"] += part["prompt_tokens"]
        if part.get("cached_tokens") is not None:
            r["cached_tokens"] = (r["cached_tokens"] or 0) + part["cached_tokens"]
            self.cached_tokens = (self.cached_tokens or 0) + part["cached_tokens"]
        r["output_tokens"] += part["completion_tokens"]
        r["parts"] += 1
        r["ready_at"], r["last_done_at"] = min(r["ready_at"], ready), max(r["last_done_at"], done)
        self._slice(done - self.started, part["rows"], part["completion_tokens"])

    def _slice(self, t: float, rows: int, tokens: int) -> None:
        entry = self.slices.setdefault(int(t // self.width), [t, 0, 0])
        entry[:] = max(entry[0], t), entry[1] + rows, entry[2] + tokens
        if len(self.slices) > self.points:  # twice as wide: the timeline stays bounded
            old, self.slices, self.width = self.slices.values(), {}, self.width * 2
            for last, n, k in old:
                self._slice(last, n, k)

    def timeline(self) -> list[dict]:
        return [{"t": round(t, 2), "rows": n, "output_tokens": k}
                for t, n, k in sorted(self.slices.values())]


def _times(timings: dict, times: RunTimes) -> dict:
    """Start-up vs generation, throughput overall / per replica / over time."""
    started, finished = timings["started"], timings["finished"]
    ready = times.ready if times.ready is not None else finished
    last = times.last if times.last is not None else finished
    generation = max(last - ready, 1e-9)
    per_replica = []
    for label, r in sorted(times.replicas.items()):
        where = json.loads(label)
        busy = max(r["last_done_at"] - r["ready_at"], 1e-9)
        per_replica.append({"node": where.get("node"), "node_id": where.get("node_id"),
                            "actor": where.get("actor"),
                            "gpus": where.get("gpus", []),
                            "cpu_threads": where.get("cpu_threads"), "dtype": where.get("dtype"),
                            "prefix_caching": where.get("prefix_caching"),
                            "rows": r["rows"], "output_tokens": r["output_tokens"],
                            "parts": r["parts"], "seconds": round(busy, 2),
                            "output_tokens_per_s": round(r["output_tokens"] / busy, 1),
                            **_prefix_cache(r["prompt_tokens"], r["cached_tokens"])})
    return {
        "time": {"total_s": round(finished - started, 2),
                 "startup_s": round(ready - started, 2),
                 "preflight_s": round(timings["planned"] - started, 2),
                 # output.reuse: finding the rows to carry over and staging them
                 **({"reuse_s": round(timings["reuse_s"], 2)} if "reuse_s" in timings else {}),
                 # rows grouped by prompt head: the copy in head order, and the output put
                 # back in input order (pipelines/order/grouped.py)
                 **({"grouping_s": round(timings["grouping_s"], 2),
                     "restore_s": round(timings["restore_s"], 2)}
                    if "grouping_s" in timings else {}),
                 "ray_start_s": round(timings["ray_ready"] - timings["planned"]
                                      - timings.get("reuse_s", 0)
                                      - timings.get("grouping_s", 0), 2),
                 "engine_start_s": round(ready - timings["ray_ready"], 2),
                 "generation_s": round(generation, 2),
                 "finish_s": round(finished - last, 2)},
        "throughput": {"output_tokens": times.tokens,
                       "output_tokens_per_s": round(times.tokens / generation, 1),
                       # what a pooling task (embed, score, classify) is measured by
                       "rows_per_s": round(times.rows / generation, 1),
                       "prompt_tokens_per_s": round(times.prompt_tokens / generation, 1),
                       "per_replica": per_replica},
        "timeline": times.timeline(),
        **({"prefix_cache": _prefix_cache(times.prompt_tokens, times.cached_tokens)}
           if times.cached_tokens is not None else {}),
    }


def _prefix_cache(prompt_tokens: int, cached_tokens: int | None) -> dict:
    """The prompt tokens an engine's prefix cache held (vLLM's count), of those it was sent."""
    if cached_tokens is None:
        return {}
    return {"prompt_tokens": prompt_tokens, "cached_tokens": cached_tokens,
            "hit_rate": round(cached_tokens / prompt_tokens, 4) if prompt_tokens else 0.0}


def write_report(output: str | Path | Location, report: dict) -> Location:
    path = report_path(output)
    path.write_text(json.dumps(scrub_record(report), indent=2))
    return path


def load_report(output: str) -> dict:
    """The report written by the run, or one rebuilt from the committed output (no times)."""
    path = report_path(output)
    if path.exists():
        return json.loads(path.read_text())
    store = OutputStore(output)
    record = store.read_record()
    if record is None or record.get("state") != "complete" or not store.path.is_dir():
        raise OutputError(f"{output!r}: no completed overnight output here (see overnight "
                          "status)")
    return build_report(output, record)
