"""The run report as the short table of text that ``overnight run`` prints at its end and
``overnight report`` prints for an output (the HTML page shows it too)."""

from __future__ import annotations

from pipelines.reuse.find import steps_carried


def report_lines(report: dict) -> list[str]:
    """The report as the short table ``overnight run`` and ``overnight report`` print."""
    return [*_row_lines(report), *_token_lines(report), *_time_lines(report),
            *_reuse_lines(report), *_cost_lines(report)]


def _row_lines(report: dict) -> list[str]:
    """The output and model, its rows (errors by kind, recovery), each step's rows."""
    rows = report["rows"]
    model = report.get("model") or {}
    lines = [f"run report   {report['output']}  (model {model.get('name')}, fingerprint "
             f"{report.get('fingerprint')})",
             f"rows         {rows['input']} in -> {rows['output']} out: {rows['ok']} ok, "
             f"{rows['skipped']} skipped, "
             + (f"{rows['dropped']} dropped (kept), " if rows.get("dropped") else "")
             + f"{rows['errors']} with errors"
             + (f" ({rows['resumed']} from an earlier run)" if rows.get("resumed") else "")]
    for kind, e in rows["errors_by_kind"].items():
        lines.append(f"  {kind:<11}{e['count']}  e.g. {', '.join(map(str, e['examples']))}")
    lines.extend(_recovery_lines(report.get("recovery") or {}))
    for step in report.get("steps") or ():
        lines.append(f"  step {step['name']:<10} {step['rows_in']:,} in -> {step['rows_out']:,} "
                     f"out, {step['dropped']:,} dropped, {step['errors']:,} with errors; "
                     f"tokens {step['prompt_tokens']:,} in, {step['completion_tokens']:,} out; "
                     f"{step['seconds']:.1f} s in blocks")
    return lines


def _token_lines(report: dict) -> list[str]:
    """Tokens in and out, a thinking model's split, the images, the tokens by adapter."""
    tok = report["tokens"]
    lines = []
    for name, label in (("prompt", "tokens in"), ("output", "tokens out")):
        s = tok[name]
        lines.append(f"{label:<13}total {s['total']:,}  mean {_num(s['mean'])}  p50 "
                     f"{_num(s['p50'])}  p95 {_num(s['p95'])}")
    r = report.get("reasoning")
    if r:
        out = r["reasoning_tokens"] + r["answer_tokens"]
        share = f" ({r['reasoning_tokens'] / out:.0%} of the output)" if out else ""
        lines.append(f"reasoning    {r['reasoning_tokens']:,} thinking tokens{share}, "
                     f"{r['answer_tokens']:,} answer; {r['no_answer_rows']:,} rows without an "
                     f"answer ({r['no_answer_share']:.1%})")
    i = report.get("images")
    if i:
        share = (f" ({i['image_tokens'] / tok['prompt']['total']:.0%} of the tokens in)"
                 if tok["prompt"]["total"] else "")
        lines.append(f"images       {i['images']:,} images, {i['image_tokens']:,} "
                     f"tokens{share}")
    for name, a in (report.get("adapters") or {}).items():
        lines.append(f"adapter      {name}: {a['rows']:,} rows, {a['prompt_tokens']:,} prompt "
                     f"+ {a['completion_tokens']:,} output tokens")
    return lines


def replica_hardware(replica: dict) -> str:
    """What a replica ran on, in words: its GPUs, else its CPU threads (Ray's node and actor
    ids stay in the report's JSON)."""
    gpus = replica.get("gpus") or []
    if gpus:
        return f"GPU{'s' if len(gpus) > 1 else ''} {','.join(map(str, gpus))}"
    threads = replica.get("cpu_threads")
    return f"no GPU: {threads} CPU threads" if threads else "no GPU"


def _time_lines(report: dict) -> list[str]:
    """The time split, the engines' idle time, the throughput overall and per replica (a run's
    report only: one rebuilt from the output has no times)."""
    t = report.get("time")
    if not t:
        return []
    lines = [f"time         {t['total_s']:.1f} s = start-up {t['startup_s']:.1f} s "
             f"(pre-flight {t['preflight_s']:.1f}, "
             + (f"reuse {t['reuse_s']:.1f}, " if "reuse_s" in t else "")
             + (f"grouping by prefix {t['grouping_s']:.1f}, " if "grouping_s" in t else "")
             + f"Ray {t['ray_start_s']:.1f}, "
             f"engines {t['engine_start_s']:.1f}) + generation "
             f"{t['generation_s']:.1f} s + finish {t['finish_s']:.1f} s"
             + (f" (the rows put back in input order: {t['restore_s']:.1f} s)"
                if "restore_s" in t else "")]
    if t.get("engine_idle_s") is not None:
        lines.append(f"engines idle {t['engine_idle_s']:.1f} s of the generation, waiting "
                     "for blocks (summed over replicas)")
    th = report["throughput"]
    lines.append("throughput   - (no row generated: every row was reused)"
                 if report.get("reuse") and not report["reuse"]["generated"] else
                 f"throughput   {th['output_tokens_per_s']:,.0f} output tok/s over the "
                 "generation" if th["output_tokens"] or "rows_per_s" not in th else
                 f"throughput   {th['rows_per_s']:,.1f} rows/s, "
                 f"{th['prompt_tokens_per_s']:,.0f} prompt tok/s (no output tokens: a "
                 "pooling task)")
    for number, r in enumerate(th["per_replica"], 1):
        lines.append(f"  replica {number} on {r['node']} ({replica_hardware(r)})"
                     + (f", {r['dtype']}" if r.get("dtype") else "") + ": "
                     f"{r['rows']} rows, {r['output_tokens']:,} tok, "
                     f"{r['output_tokens_per_s']:,.0f} tok/s"
                     + (f", prefix cache {r['hit_rate']:.0%}" if "hit_rate" in r else "")
                     + (", prefix caching off (the engine's choice for this model)"
                        if r.get("prefix_caching") is False else ""))
    return lines + _prefix_lines(report.get("prefix_cache"))


def _prefix_lines(cache: dict | None) -> list[str]:
    """What the engines' prefix cache saved; the rows' grouping by prompt head, where done."""
    if not cache or not cache["prompt_tokens"]:
        return []
    lines = [f"prefix cache {cache['hit_rate']:.0%} of the prompt tokens held, not computed "
             f"again ({cache['cached_tokens']:,} of {cache['prompt_tokens']:,})"]
    grouped = cache.get("grouped_by_prefix")
    if grouped:
        lines.append(f"             rows run grouped by prompt head: "
                     f"{grouped['shared_in_head_order'] / max(grouped['prompt_tokens'], 1):.0%}"
                     " of their prompt tokens in heads they share")
    return lines


def _reuse_lines(report: dict) -> list[str]:
    """output.reuse: the rows carried over, and the tokens (and cost) not spent again."""
    reuse = report.get("reuse")
    if not reuse:
        return []
    saved = reuse["prompt_tokens_saved"] + reuse["completion_tokens_saved"]
    return [f"reuse        {reuse['reused']:,} rows carried over from {reuse['source']}"
            f"{steps_carried(reuse)}, "
            f"{reuse['generated']:,} generated, {reuse['dropped']:,} earlier rows no "
            f"longer asked for; {saved:,} tokens not generated again"
            + (f" (${reuse['cost_saved']:.4f} hosted)" if "cost_saved" in reuse else "")
            + (f"; none reused: {reuse['why_none']}" if reuse.get("why_none")
               and not reuse["reused"] else "")]


def _cost_lines(report: dict) -> list[str]:
    """What the run would have cost at the configured hosted prices."""
    cost = report.get("cost")
    if not cost:
        return []
    p = cost["price_per_mtok"]
    return [f"hosted cost  ${cost['total']:.4f} at ${p['input']}/${p['output']} per "
            f"Mtok in/out (${cost['input']:.4f} + ${cost['output']:.4f})"]


def _recovery_lines(recovery: dict) -> list[str]:
    """Engine restarts with their causes, blocks retried, rows isolated (udfs/engines/recovery.py)."""
    restarts = recovery.get("restarts") or []
    if not restarts and not recovery.get("retried_blocks"):
        return []
    lines = [f"recovery     {len(restarts)} engine restart(s), "
             f"{recovery.get('retried_blocks', 0)} block(s) retried, "
             f"{recovery.get('isolated_rows', 0)} row(s) isolated as engine_crash"]
    for r in restarts:
        lines.append(f"  restart    actor {str(r.get('actor'))[:12]}: {r.get('cause')}")
    return lines



def _num(value) -> str:
    return "-" if value is None else f"{value:g}"
