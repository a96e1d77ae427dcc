"""Reuse (output.reuse): a re-run over a changed table carries over the rows whose request is
unchanged and generates the rest; its output equals a from-scratch run over the new table.

The tables: 200 rows (3 with a null description: errors, generated again), then a new version
with 1% of rows edited, 1% added, 1% removed, a column the prompt does not read changed on a
few rows, and every row shuffled. Every run is real vLLM in this process's Ray; the rows that
reach the engine are counted by the replicas themselves (``through_replicas``).
"""

from __future__ import annotations

import json
import random
import shutil
import signal
from pathlib import Path

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import yaml

from pipelines import load_config, run_job
from pipelines.plan.validate import validate_job

from conftest import cli, job_config
from test_resume import kill_after_parts, settled_parts

ROWS = 200
NULLS = (5, 77, 150)  # rows without a description: on_null error, in both tables
EDITED, REMOVED, PRICED = (12, 140), (30, 99), (3, 60, 181)  # PRICED: a column not read
ADDED = 2
PRICES = {"input": 0.15, "output": 0.6}


def first_table() -> list[dict]:
    return [{"sku": f"S{i:04d}", "title": f"Item {i}",
             "description": None if i in NULLS else f"Thing number {i}, {'blue ' * (i % 4)}",
             "price": float(i)} for i in range(ROWS)]


def second_table() -> list[dict]:
    rows = [dict(r) for r in first_table()]
    for i in EDITED:
        rows[i]["title"] = f"Item {i}, now in green"
    for i in PRICED:
        rows[i]["price"] += 100
    rows = [r for i, r in enumerate(rows) if i not in REMOVED]
    rows += [{"sku": f"N{i}", "title": f"New item {i}", "description": "Just added.",
              "price": 1.0} for i in range(ADDED)]
    random.Random(7).shuffle(rows)
    return rows


@pytest.fixture(scope="session")
def reuse_tables(tmp_path_factory):
    root = tmp_path_factory.mktemp("reuse")
    pq.write_table(pa.Table.from_pylist(first_table()), root / "v1.parquet")
    pq.write_table(pa.Table.from_pylist(second_table()), root / "v2.parquet")
    return root


def config(tiny_model, root: Path, table: str, out: str, **sections) -> dict:
    return job_config(tiny_model, root / table, root / out, **{
        "resources": {"batch_size": 8}, "report": {"price_per_mtok": PRICES}, **sections})


def through_replicas(result) -> int:
    """The rows a run's replicas generated, as the run's report counts them from the replica's
    own columns on each part it wrote (``throughput.per_replica``). The rows carried over are
    staged as parts of their own, without those columns, and never pass a replica; a row
    refused before the engine (a null description) does pass, as an error."""
    return sum(r["rows"] for r in result.report.get("throughput", {}).get("per_replica", []))


@pytest.fixture(scope="session")
def greedy_runs(tiny_model, reuse_tables, ray_cluster):
    """The first table's run; the second table's run reusing it; the second from scratch."""
    root = reuse_tables
    first = run_job(load_config(config(tiny_model, root, "v1.parquet", "greedy")))
    predicted = validate_job(load_config(config(tiny_model, root, "v2.parquet", "greedy",
                                                output={"reuse": True}))).reuse
    incremental = run_job(load_config(config(tiny_model, root, "v2.parquet", "greedy",
                                             output={"reuse": True})))
    scratch = run_job(load_config(config(tiny_model, root, "v2.parquet", "greedy-scratch")))
    return predicted, incremental, scratch, first


def expected_counts() -> dict:
    found = ROWS - len(EDITED) - len(REMOVED)  # the earlier rows the new table asks for
    return {"reused": found - len(NULLS), "failed": len(NULLS),
            "generated": len(EDITED) + ADDED + len(NULLS),
            "dropped": len(EDITED) + len(REMOVED)}


def test_an_incremental_run_equals_a_from_scratch_run_over_the_new_table(greedy_runs,
                                                                          reuse_tables):
    _, incremental, scratch, _ = greedy_runs
    out = pl.read_parquet(reuse_tables / "greedy")
    fresh = pl.read_parquet(reuse_tables / "greedy-scratch")
    assert out["sku"].to_list() == [r["sku"] for r in second_table()]  # the new table's order
    assert out.equals(fresh)
    # the new table's values, where the prompt does not read them: the new price
    assert out.filter(pl.col("sku") == "S0003")["price"].item() == 103.0
    assert out.filter(pl.col("error_kind").is_not_null()).height == len(NULLS)
    counts = expected_counts()
    assert {k: incremental.reuse[k] for k in counts} == counts
    assert incremental.rows_reused == counts["reused"]
    assert incremental.rows_resumed == 0
    assert scratch.reuse is None


def test_validate_predicts_the_rows_a_run_reuses(greedy_runs):
    predicted, incremental, _, _ = greedy_runs
    c = expected_counts()
    assert predicted == (f"reuse: {c['reused']} of {ROWS} rows reusable from "
                         f"{incremental.output}; {c['generated']} to generate; "
                         f"{c['failed']} of them failed before; {c['dropped']} earlier rows "
                         "no longer asked for (removed or changed)")


def test_the_report_counts_the_rows_and_tokens_reused(greedy_runs, reuse_tables):
    _, incremental, _, _ = greedy_runs
    reuse = incremental.report["reuse"]
    first = pl.read_parquet(reuse_tables / "greedy")
    carried = first.filter(pl.col("error").is_null()
                           & ~pl.col("sku").is_in([f"S{i:04d}" for i in EDITED])
                           & pl.col("sku").str.starts_with("S"))
    assert reuse["reused"] == carried.height
    assert reuse["prompt_tokens_saved"] == carried["prompt_tokens"].sum()
    assert reuse["completion_tokens_saved"] == carried["completion_tokens"].sum()
    assert reuse["cost_saved"] == round(reuse["prompt_tokens_saved"] / 1e6 * PRICES["input"]
                                        + reuse["completion_tokens_saved"] / 1e6
                                        * PRICES["output"], 6)
    from pipelines.report.report_text import report_lines

    line = next(x for x in report_lines(incremental.report) if x.startswith("reuse"))
    assert f"{reuse['reused']:,} rows carried over" in line and "tokens not generated" in line


def test_settings_that_change_every_request_reuse_nothing_and_others_everything(
        greedy_runs, tiny_model, reuse_tables):
    """validate says it before any engine starts: a template change reuses no row; batch
    size, replicas and blocks in flight change how the job runs, not what it writes."""
    root = reuse_tables
    other = validate_job(load_config(config(
        tiny_model, root, "v2.parquet", "greedy", output={"reuse": True},
        prompt={"system": "Be brief.", "template": "Name: {{ title }}\n{{ description }}"})))
    assert other.reuse.startswith(f"reuse: 0 of {ROWS} rows reusable")
    assert other.reuse.endswith("(prompt.template changed)")
    sampled = validate_job(load_config(config(
        tiny_model, root, "v2.parquet", "greedy", output={"reuse": True},
        sampling={"temperature": 0.0, "max_tokens": 12})))
    assert sampled.reuse.endswith("(sampling.max_tokens changed)")
    same = validate_job(load_config(config(
        tiny_model, root, "v2.parquet", "greedy", output={"reuse": True},
        resources={"batch_size": 5, "replicas": 1, "blocks_in_flight": 3})))
    # (the output is the second table's by now: every row that did not fail)
    assert same.reuse == (f"reuse: {ROWS - len(NULLS)} of {ROWS} rows reusable from "
                          f"{root / 'greedy'}; {len(NULLS)} to generate; {len(NULLS)} of them "
                          "failed before")


def test_a_seeded_job_reuses_a_snapshot_elsewhere_with_its_samples_together(
        tiny_model, reuse_tables, ray_cluster, monkeypatch):
    """Sampled (temperature 0.8, a seed per row from its id, two samples a row): the reused
    rows' samples come over together, from a copy of the output somewhere else
    (output.reuse_from), and the result equals a from-scratch run. Looked up and staged as a
    large table's are, in a Ray task (pipelines/reuse/carry.py: LARGE_ROWS)."""
    import pipelines.reuse.carry
    import pipelines.reuse.ray_task

    monkeypatch.setattr(pipelines.reuse.carry, "LARGE_ROWS", 0)
    on_ray = []
    monkeypatch.setattr(pipelines.reuse.carry, "carry_over_on_ray", lambda *a: on_ray.append(
        pipelines.reuse.ray_task.carry_over_on_ray(*a)) or on_ray[-1])
    root = reuse_tables
    seeded = {"input": {"id_column": "sku"},
              "sampling": {"temperature": 0.8, "seed": 5, "max_tokens": 12, "n": 2}}
    run_job(load_config(config(tiny_model, root, "v1.parquet", "seeded", **seeded)))
    shutil.copytree(root / "seeded", root / "snapshot")  # the folder alone, no record
    incremental = run_job(load_config(config(
        tiny_model, root, "v2.parquet", "seeded-next", **seeded,
        output={"reuse_from": str(root / "snapshot")})))
    scratch = run_job(load_config(config(tiny_model, root, "v2.parquet", "seeded-scratch",
                                         **seeded)))
    out = pl.read_parquet(root / "seeded-next")
    assert out.equals(pl.read_parquet(root / "seeded-scratch"))
    assert out.height == 2 * ROWS and out["sample_index"].to_list()[:4] == [0, 1, 0, 1]
    assert incremental.reuse["reused"] == expected_counts()["reused"]
    assert incremental.reuse["source"] == str(root / "snapshot")
    assert len(on_ray) == 1 and on_ray[0][0]["reused"] == expected_counts()["reused"]
    assert scratch.reuse is None


def test_only_the_new_and_changed_rows_reach_the_engine(greedy_runs, tiny_model, reuse_tables):
    """Counted by the replicas: the first table's run generates every row; the changed table's
    run reusing it, its new, edited and failed rows alone; a run with other resources reusing
    that output, the failed rows alone (failed rows are always generated again); a run with
    another template, every row. (The 3 null rows among them fail again before the engine.)"""
    root = reuse_tables
    _, incremental, _, first = greedy_runs
    assert through_replicas(first) == ROWS
    assert through_replicas(incremental) == expected_counts()["generated"]
    second = incremental.output.rstrip("/")  # the second table's output, reused below

    def run(out: str, **sections) -> int:
        return through_replicas(run_job(load_config(config(
            tiny_model, root, "v2.parquet", out, output={"reuse_from": second}, **sections))))

    assert run("counted-b16", resources={"batch_size": 16}) == len(NULLS)
    assert pl.read_parquet(root / "counted-b16").equals(pl.read_parquet(root / "greedy-scratch"))
    templated = {"prompt": {"system": "Be brief.",
                            "template": "Name: {{ title }}\n{{ description }}"}}
    assert run("counted-templated", **templated) == ROWS


def test_an_incremental_run_killed_half_way_resumes_to_the_uninterrupted_output(
        tiny_model, reuse_tables, ray_cluster, capsys):
    """The second half of the rows edited; the reuse run SIGKILLed (its whole process group)
    once about half of the rows it generates are written, run again: the same output as a
    run not stopped."""
    root = reuse_tables
    rows = first_table()
    for r in rows[ROWS // 2:]:
        r["title"] += " (edited)"
    pq.write_table(pa.Table.from_pylist(rows), root / "half.parquet")
    sampled = {"input": {"id_column": "sku"},
               "sampling": {"temperature": 0.8, "seed": 2, "max_tokens": 12}}
    run_job(load_config(config(tiny_model, root, "v1.parquet", "killed", **sampled)))
    path = root / "killed.yaml"
    path.write_text(yaml.safe_dump(config(tiny_model, root, "half.parquet", "killed",
                                          output={"reuse": True}, **sampled)))
    before = sorted(p.name for p in (root / "killed").glob("part-*"))
    # the first half's rows (less its two nulls) are staged as 7 parts, then generated blocks
    code, _ = kill_after_parts(path, root / "killed.partial", 7 + 7, signal.SIGKILL)
    assert code == -signal.SIGKILL
    written = settled_parts(root / "killed.partial")
    assert len(written) >= 7 + 7  # (and not committed: the record says running, below)
    assert sorted(p.name for p in (root / "killed").glob("part-*")) == before  # untouched
    record = json.loads((root / "killed.overnight.json").read_text())
    assert record["state"] == "running" and record["reuse"]["reused"] == ROWS // 2 - 2
    code, out, err = cli("run", path, "--quiet", capsys=capsys)  # (in this process's Ray)
    assert code == 0, err
    assert f"reused: {ROWS // 2 - 2} rows carried over" in out
    run_job(load_config(config(tiny_model, root, "half.parquet", "unbroken", **sampled)))
    assert pl.read_parquet(root / "killed").equals(pl.read_parquet(root / "unbroken"))


def test_reuse_tells_in_one_line_what_it_cannot_use(tiny_model, reuse_tables, tmp_path, capsys):
    root = reuse_tables
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config(tiny_model, root, "v2.parquet", "nowhere")))
    code, _, err = cli("validate", path, "--reuse-from", tmp_path / "no-such-output",
                       capsys=capsys)
    assert code == 2
    assert err.strip().splitlines()[-1].endswith(
        f"output.reuse_from {str(tmp_path / 'no-such-output')!r}: no such output")
    assert "Traceback" not in err
    # an output written before request keys: nothing to match, said
    old = tmp_path / "old"
    old.mkdir()
    pq.write_table(pa.table({"sku": ["S0001"], "generated": ["x"], "error": [None]},
                            ), old / "part-000000000000-000000000001.parquet")
    code, out, err = cli("validate", path, "--reuse-from", old, capsys=capsys)
    assert code == 0, err
    assert (f"reuse: 0 of {ROWS} rows reusable from {old}; {ROWS} to generate (the earlier "
            "output has no request_key column") in out
    deduped = tmp_path / "deduped.yaml"
    deduped.write_text(yaml.safe_dump(config(
        tiny_model, root, "v2.parquet", "nowhere", output={"reuse": True, "dedupe": True},
        sampling={"temperature": 0.8, "n": 2})))
    code, _, err = cli("validate", deduped, capsys=capsys)
    assert code == 2
    assert "output.reuse does not apply to output.dedupe" in err
    assert "Traceback" not in err


# A job of steps: a sampled step with two samples a row, then a greedy judge of each sample
REWRITE = {"name": "rewrite", "prompt": {"template": "Rewrite: {{ title }}\n{{ description }}"},
           "sampling": {"temperature": 0.8, "seed": 5, "n": 2, "max_tokens": 8}}
JUDGE, JUDGE_AGAIN = "Is this good? {{ rewrite }}", "Rate it, 1 to 5: {{ rewrite }}"


def steps_config(tiny_model, root: Path, table: str, out: str, judge: str = JUDGE,
                 more: tuple = (), **sections) -> dict:
    raw = config(tiny_model, root, table, out, input={"id_column": "sku"}, **sections)
    del raw["prompt"], raw["sampling"], raw["output"]["column"]
    return {**raw, "steps": [REWRITE, {"name": "judge", "prompt": {"template": judge},
                                       "sampling": {"temperature": 0.0, "max_tokens": 6}},
                             *more]}


@pytest.fixture(scope="session")
def steps_runs(tiny_model, reuse_tables, ray_cluster):
    """A job of steps over the first table; over the second reusing it, and from scratch;
    then with its last step's prompt changed, reusing the second's, and from scratch."""
    root = reuse_tables

    def job(table, out, judge=JUDGE, **sections):
        return load_config(steps_config(tiny_model, root, table, out, judge, **sections))

    first = run_job(job("v1.parquet", "steps"))
    rows = validate_job(job("v2.parquet", "steps", output={"reuse": True})).reuse
    whole = run_job(job("v2.parquet", "steps", output={"reuse": True}))
    run_job(job("v2.parquet", "steps-scratch"))
    before = pl.read_parquet(root / "steps")
    last = validate_job(job("v2.parquet", "steps", JUDGE_AGAIN, output={"reuse": True})).reuse
    judged = run_job(job("v2.parquet", "steps", JUDGE_AGAIN, output={"reuse": True}))
    run_job(job("v2.parquet", "steps-judged-scratch", JUDGE_AGAIN))
    return {"rows": rows, "whole": whole, "last": last, "judged": judged, "before": before,
            "first": first}


def test_a_job_of_steps_run_again_equals_a_from_scratch_run_with_its_samples_together(
        steps_runs, reuse_tables):
    out = pl.read_parquet(reuse_tables / "steps")  # (by now: after the judge changed)
    before = steps_runs["before"]
    assert before.equals(pl.read_parquet(reuse_tables / "steps-scratch"))
    assert before.height == 2 * ROWS and before["rewrite_index"].to_list()[:4] == [0, 1, 0, 1]
    counts = expected_counts()
    assert {k: steps_runs["whole"].reuse[k] for k in counts} == counts
    c = counts
    assert steps_runs["rows"] == (f"reuse: {c['reused']} of {ROWS} rows reusable from "
                                  f"{reuse_tables / 'steps'}; {c['generated']} to generate; "
                                  f"{c['failed']} of them failed before; {c['dropped']} earlier "
                                  "rows no longer asked for (removed or changed)")
    assert out.equals(pl.read_parquet(reuse_tables / "steps-judged-scratch"))


def test_a_changed_last_step_is_all_a_job_of_steps_generates_again(steps_runs, reuse_tables):
    """The first step's samples carried over as they were, the judge run on each of them;
    validate said so before, and the report counts the first step's tokens as saved."""
    before, judged = steps_runs["before"], steps_runs["judged"]
    out = pl.read_parquet(reuse_tables / "steps")
    ok = before.filter(pl.col("error").is_null())
    carried = out.join(ok.select("sku", "rewrite_index", "rewrite", "rewrite_completion_tokens"),
                       on=["sku", "rewrite_index"], suffix="_before")
    assert carried.height == ok.height == 2 * (ROWS - len(NULLS))
    assert carried["rewrite"].to_list() == carried["rewrite_before"].to_list()
    assert (out["judge"] != before["judge"]).any()  # judged again, by the other prompt
    reuse = judged.reuse
    assert reuse["reused"] == ROWS - len(NULLS) and reuse["from_step_name"] == "judge"
    assert reuse["completion_tokens_saved"] == ok["rewrite_completion_tokens"].sum()
    assert steps_runs["last"] == (
        f"reuse: {ROWS - len(NULLS)} of {ROWS} rows reusable from {reuse_tables / 'steps'}; "
        f"{len(NULLS)} to generate; {len(NULLS)} of them failed before (the steps before "
        "'judge': 'judge' and the steps after it run for every row)")
    from pipelines.report.report_text import report_lines

    line = next(x for x in report_lines(judged.report) if x.startswith("reuse"))
    assert "the steps before 'judge'" in line


def generated(result) -> list[int]:
    """Each step's rows generated in a job of steps' run (the step's own count, over the rows it
    returned: a sample each; the rows it carried over or refused before the engine are not
    among them); a filter step generates nothing."""
    return [s["rows_out"] if s["completion_tokens"] else 0 for s in result.report["steps"]]


def test_a_job_of_steps_asks_the_engine_only_for_its_changed_rows_and_steps(
        steps_runs, tiny_model, reuse_tables, capsys):
    """Counted by each step: the first table (each row's two rewrites, then a judge of each);
    the second reusing it (the new and edited rows' alone); the second with the judge's prompt
    changed (the judge alone, of every rewrite); a filter added after the last step (nothing).
    A change of a step before that filter reuses nothing: the rows the filter dropped are not
    in the output; validate says so."""
    root = reuse_tables
    rows = ROWS - len(NULLS)  # (a null row fails at its first step, before the engine)
    assert generated(steps_runs["first"]) == [2 * rows, 2 * rows]
    new = len(EDITED) + ADDED
    assert generated(steps_runs["whole"]) == [2 * new, 2 * new]
    assert generated(steps_runs["judged"]) == [0, 2 * rows]
    assert sum(s["completion_tokens"] for s in steps_runs["whole"].report["steps"]) > 0
    keep = ({"name": "keep", "where": "length(judge) > 3"},)
    kept = run_job(load_config(steps_config(
        tiny_model, root, "v2.parquet", "steps-kept", JUDGE_AGAIN, keep,
        output={"reuse_from": str(root / "steps")})))
    assert generated(kept) == [0, 0, 0]
    assert kept.report["steps"][2]["rows_in"] == 2 * rows  # (every row, carried to the filter)
    path = root / "steps-kept.yaml"
    path.write_text(yaml.safe_dump(steps_config(tiny_model, root, "v2.parquet", "steps-kept",
                                               more=keep)))
    code, out, err = cli("validate", path, "--reuse", capsys=capsys)
    assert code == 0, err
    assert ("(steps[1] (judge) changed, and the earlier job's step 'keep' after it drops "
            "rows, which its output does not hold (output.keep_dropped: true keeps them for a "
            "next run))") in out


def test_a_batch_file_run_again_after_an_edit_generates_only_its_new_and_changed_lines(
        tiny_model, tmp_path, ray_cluster):
    """A Batch file run again after an edit (as ``overnight batch --overwrite`` does): the
    unchanged lines' results are carried over (the replicas count the requests they got),
    and equal a run from scratch."""
    from pipelines.batchfile.run import run_batch_file

    def line(i: int, text: str) -> str:
        return json.dumps({"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
                           "body": {"model": "m", "max_tokens": 4, "temperature": 0,
                                    "messages": [{"role": "user", "content": text}]}})

    lines = [line(i, f"Say {i}") for i in range(40)]
    requests = tmp_path / "requests.jsonl"
    requests.write_text("\n".join(lines) + "\n")

    def batch(out: str, overwrite: bool = False) -> int:
        done = run_batch_file(requests, tmp_path / out, model=tiny_model, overwrite=overwrite,
                              overrides=["engine.kv_cache_memory_bytes=134217728"])
        assert done["results"] == len(lines) and done["errors"] == 0
        return through_replicas(done["summary"])

    assert batch("results.jsonl") == 40
    lines[3] = line(3, "Say three")
    lines.append(line(40, "Say forty"))
    requests.write_text("\n".join(reversed(lines)) + "\n")
    assert batch("results.jsonl", overwrite=True) == 2  # (the result files are replaced)
    assert batch("scratch.jsonl") == 41

    def bodies(name: str) -> dict:
        return {r["custom_id"]: r["response"]["body"]["choices"]
                for r in map(json.loads, (tmp_path / name).read_text().splitlines())}

    assert bodies("results.jsonl") == bodies("scratch.jsonl")


def test_a_job_of_steps_killed_while_it_reruns_a_changed_step_resumes_to_the_same_output(
        steps_runs, tiny_model, reuse_tables, capsys):
    """The judge changed, so every row goes on from its carried rewrites (their states staged
    beside the parts), reusing the from-scratch output of steps_runs; the run SIGKILLed
    half-way and run again equals the from-scratch run with the changed judge."""
    root = reuse_tables
    path = root / "steps-killed.yaml"
    path.write_text(yaml.safe_dump(steps_config(
        tiny_model, root, "v2.parquet", "steps-killed", JUDGE_AGAIN,
        output={"reuse_from": str(root / "steps-scratch")})))
    blocks = ROWS // 8
    code, _ = kill_after_parts(path, root / "steps-killed.partial", blocks // 2, signal.SIGKILL)
    assert code == -signal.SIGKILL
    assert len(settled_parts(root / "steps-killed.partial")) < blocks
    code, out, err = cli("run", path, "--quiet", capsys=capsys)  # (in this process's Ray)
    assert code == 0, err
    assert "the steps before 'judge'" in out
    out = pl.read_parquet(root / "steps-killed")
    assert out.equals(pl.read_parquet(root / "steps-judged-scratch"))
    assert out.height == 2 * ROWS


# Nightly re-runs of a table where two rows ask for one request (a greedy job with an id
# column, demo.yaml's shape: the id is not in the key): 10 rows, rows 2 and 3 and rows 6 and 7
# rendering the same prompt under other ids, row 0 a null (an error, generated again)
DUPLICATES = ((2, 3), (6, 7))


def duplicate_table() -> list[dict]:
    rows = [{"sku": f"D{i}", "title": f"Item {i}", "description": f"Thing {i}."}
            for i in range(10)]
    rows[0]["description"] = None
    for a, b in DUPLICATES:
        rows[b] = {**rows[a], "sku": rows[b]["sku"]}
    return rows


@pytest.fixture(scope="session")
def duplicate_runs(tiny_model, tmp_path_factory, ray_cluster):
    """Run; run again reusing it; --retry-errors with another max_tokens (the documented
    way out of a budget too small); validate and run again reusing that."""
    root = tmp_path_factory.mktemp("duplicates")
    pq.write_table(pa.Table.from_pylist(duplicate_table()), root / "t.parquet")

    def job(max_tokens: int = 4, **output):
        return load_config(config(tiny_model, root, "t.parquet", "out",
                                  input={"id_column": "sku"}, output=output,
                                  sampling={"temperature": 0.0, "max_tokens": max_tokens}))

    run_job(job())
    first = pl.read_parquet(root / "out")
    again = run_job(job(reuse=True))
    second = pl.read_parquet(root / "out")
    run_job(job(max_tokens=5), retry_errors=True)
    retried = pq.read_schema(next((root / "out").glob("*.parquet"))).metadata
    predicted = validate_job(job(reuse=True)).reuse
    third = run_job(job(reuse=True))
    return {"root": root, "first": first, "second": second, "again": again, "third": third,
            "predicted": predicted, "retried": retried, "job": job}


def test_two_rows_with_one_request_stay_two_rows_night_after_night(duplicate_runs):
    """Each input row takes its own earlier row: 10 rows, each id once, equal to the first
    run's, after a reuse run and another after a --retry-errors (10 rows became 12 and 16)."""
    first = duplicate_runs["first"]
    assert first.height == 10 and first["sku"].to_list() == [f"D{i}" for i in range(10)]
    for a, b in DUPLICATES:  # (one request: one key, two rows)
        assert first["request_key"][a] == first["request_key"][b]
    for out in (duplicate_runs["second"], pl.read_parquet(duplicate_runs["root"] / "out")):
        assert out.equals(first)
    assert duplicate_runs["again"].reuse["reused"] == 9  # (row 0 failed: generated again)
    assert duplicate_runs["again"].reuse["dropped"] == 0


def test_a_reuse_after_retry_errors_with_another_max_tokens_reuses_the_other_rows(
        duplicate_runs):
    """The retried row is keyed by max_tokens 5, the rest by 4, and the file's metadata says
    5 (its first part's): each row is found by its own key, not by the file's settings."""
    meta = json.loads(duplicate_runs["retried"][b"overnight.job"])
    assert meta["request_key"]["sampling"]["max_tokens"] == 5
    out = duplicate_runs["root"] / "out"
    assert duplicate_runs["predicted"] == (
        f"reuse: 9 of 10 rows reusable from {out}; 1 to generate; 1 earlier rows no longer "
        "asked for (removed or changed)")
    assert duplicate_runs["third"].reuse["reused"] == 9


def test_reuse_from_a_file_or_a_folder_of_renamed_files_reads_them_by_content(
        duplicate_runs, tiny_model, tmp_path, capsys):
    """--reuse-from a part file, or a snapshot whose files were renamed: the rows are found
    in them; a file that is not Parquet is one line, no traceback."""
    job, root = duplicate_runs["job"], duplicate_runs["root"]
    (part,) = (root / "out").glob("part-*.parquet")
    snapshot = tmp_path / "snapshot"
    snapshot.mkdir()
    shutil.copy(part, snapshot / "2026-12-05.parquet")
    for source in (part, snapshot):
        assert validate_job(job(reuse_from=str(source))).reuse == (
            f"reuse: 9 of 10 rows reusable from {source}; 1 to generate; 1 of them failed "
            "before")
    (tmp_path / "empty").mkdir()
    assert validate_job(job(reuse_from=str(tmp_path / "empty"))).reuse.endswith(
        "(the earlier output has no Parquet files)")
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config(tiny_model, root, "t.parquet", "out")))
    code, _, err = cli("validate", path, "--reuse-from", path, capsys=capsys)
    assert code == 2, err
    assert err.strip().splitlines()[-1].startswith(
        f"overnight: error: output.reuse_from {str(path)!r}: not a Parquet file")
    assert "Traceback" not in err


def test_the_lookup_tells_input_rows_apart_and_takes_each_earlier_row_once():
    """No engine: an earlier output's input rows by their ids and samples, never their keys
    alone; new rows with one key matched to earlier rows by (key, occurrence)."""
    import numpy as np

    from pipelines.reuse.find import ReusePlan
    from pipelines.reuse.join import _input_rows, _join, _Spill

    high, low = np.array([1, 1, 1, 2], np.uint64), np.array([5, 5, 5, 6], np.uint64)
    ids = pa.table({"sku": ["a", "b", "b", "c"], "sample_index": [0, 0, 1, 0]})
    assert _input_rows(ids.select(["sku"]), high, low, "sku", steps=False).tolist() == \
        [True, True, True, True]  # (one-prompt job, no samples: a row each)
    assert _input_rows(ids, high, low, "sku", steps=False).tolist() == \
        [True, True, False, True]
    assert _input_rows(ids, high, low, None, steps=True).tolist() == \
        [True, False, False, True]  # (no ids at all: the key's runs, as before)
    old = np.array([(1, 5, 0, 1, True), (1, 5, 1, 2, True), (2, 6, 3, 1, True),
                    (9, 9, 4, 1, True)], _Spill.DTYPE["old"])
    new = np.array([(1, 5, 0), (2, 6, 1), (1, 5, 2), (1, 5, 3)], _Spill.DTYPE["new"])
    plan = ReusePlan(source="s", rows=4)
    plan.at, plan.count = np.full(4, -1, np.int64), np.zeros(4, np.int32)
    _join(new, old, plan)
    assert plan.at.tolist() == [0, 3, 1, -1] and plan.count.tolist() == [1, 1, 2, 0]
    assert plan.dropped == 1 and plan.failed == 0
