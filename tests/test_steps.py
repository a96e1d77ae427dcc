"""Jobs of several steps (``steps:``, udfs/stages/steps.py) on the real CPU engine, through Ray Data.

- a three-step greedy job equals the same three steps run as three single-step jobs chained
  by hand (each reading the one before's output), row for row;
- filters keep exactly the rows their condition selects, over known values and over an
  earlier step's parsed struct; dropped rows are written only when asked, with the step;
- fan-out (``explode``, ``n``) makes the rows it says;
- a job killed in the middle of its second step resumes and ends equal to an uninterrupted
  seeded run;
- a step that cannot run is refused in pre-flight, in one line naming the step.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import polars as pl
import pytest
import yaml

from pipelines import load_config, run_job
from pipelines.errors import JobError
from pipelines.plan.preflight import plan_job

from conftest import REPO, cli, job_config

ROWS = 48
FAULTS = REPO / "tests" / "faults"
ANSWER_TOKENS = 9  # the answer step's max_tokens: the reclaim fault strikes its requests


@pytest.fixture(scope="session")
def steps_input(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("steps")
    rows = [{"sku": f"S{i:03d}", "title": f"Thing {i}", "price": float(i * 3 % 97),
             "description": f"A useful thing, number {i}."} for i in range(ROWS)]
    pl.DataFrame(rows).write_parquet(root / "in.parquet")
    return root


def steps_config(tiny_model, root: Path, name: str, steps: list[dict], **sections) -> dict:
    config = job_config(tiny_model, root / "in.parquet", root / name,
                        input={"id_column": "sku"}, **sections)
    del config["prompt"], config["sampling"]
    config["output"].pop("column")
    return {**config, "steps": steps}


REWRITE = {"template": "Title: {{ title }}\n{{ description }}"}
LABEL = {"template": "Is this good? {{ rewrite }}"}
SUMMARY = {"template": "{{ title }} is {{ label }}: {{ rewrite }}"}
GREEDY = {"temperature": 0.0}


@pytest.fixture(scope="session")
def three_steps(tiny_model, steps_input, ray_cluster):
    """The same three steps as one job, and as three jobs chained by hand."""
    root = steps_input
    steps = [{"name": "rewrite", "prompt": REWRITE, "sampling": {**GREEDY, "max_tokens": 12}},
             {"name": "label", "prompt": LABEL, "sampling": {**GREEDY, "max_tokens": 4},
              "structured": {"choice": ["good", "bad"]}},
             {"name": "summary", "prompt": SUMMARY, "sampling": {**GREEDY, "max_tokens": 10}}]
    one = run_job(load_config(steps_config(tiny_model, root, "one", steps)))
    chained, source = [], root / "in.parquet"
    for step in steps:
        config = job_config(tiny_model, source, root / f"by-hand-{step['name']}",
                            prompt={"system": None, **step["prompt"]},
                            sampling=step["sampling"],
                            output={"column": step["name"]}, input={"id_column": "sku"},
                            **({"structured": step["structured"]} if "structured" in step
                               else {}))
        chained.append(run_job(load_config(config)))
        source = root / f"by-hand-{step['name']}"
    return one, chained, pl.read_parquet(root / "one"), pl.read_parquet(source)


def test_three_steps_equal_three_jobs_chained_by_hand(three_steps):
    one, chained, steps, by_hand = three_steps
    assert steps["sku"].to_list() == by_hand["sku"].to_list() == [f"S{i:03d}" for i in
                                                                   range(ROWS)]
    for column in ("rewrite", "label", "summary"):
        assert steps[column].to_list() == by_hand[column].to_list(), column
    assert steps["rewrite"].null_count() == 0 and set(steps["label"]) <= {"good", "bad"}
    # each step's own columns in the one job; the chained jobs' under their column's name
    assert steps["summary_finish_reason"].to_list() == by_hand["finish_reason"].to_list()
    assert steps["rewrite_completion_tokens"].to_list() == \
        by_hand["rewrite_completion_tokens"].to_list()
    assert steps["completion_tokens"].to_list() == [
        sum(t) for t in zip(*(steps[f"{c}_completion_tokens"] for c in
                              ("rewrite", "label", "summary")))]
    assert steps["error"].null_count() == ROWS
    # one engine started instead of three
    assert one.report["time"]["engine_start_s"] > 0
    saved = sum(r.report["time"]["startup_s"] for r in chained) - one.report["time"][
        "startup_s"]
    print(f"start-up: one job {one.report['time']['startup_s']:.1f} s, three chained "
          f"{saved + one.report['time']['startup_s']:.1f} s")
    assert [s["name"] for s in one.report["steps"]] == ["rewrite", "label", "summary"]
    assert all(s["rows_in"] == s["rows_out"] == ROWS for s in one.report["steps"])


def test_a_job_reads_an_earlier_jobs_output_and_names_its_columns_apart(three_steps):
    *_, by_hand = three_steps
    names = by_hand.columns
    # the first job's columns under its column's name, the last job's as a job's are
    for column in ("rewrite", "label"):
        assert f"{column}_finish_reason" in names and f"{column}_error" in names
    assert "finish_reason" in names and "error" in names


@pytest.fixture(scope="session")
def filtered(tiny_model, steps_input, ray_cluster):
    root = steps_input
    judge = {"type": "object", "properties": {"score": {"type": "integer", "minimum": 1,
                                                        "maximum": 5}},
             "required": ["score"]}
    steps = [{"name": "cheap", "where": "price < 60"},
             {"name": "judge", "prompt": {"template": "Score {{ title }} from 1 to 5."},
              "sampling": {**GREEDY, "max_tokens": 12}, "structured": {"json_schema": judge}},
             {"name": "keep", "where": "judge.score >= 3"},
             {"name": "pitch", "prompt": {"template": "Sell {{ title }} ({{ judge.score }})"},
              "sampling": {"temperature": 0.8, "max_tokens": 4, "n": 2}}]
    kept = run_job(load_config(steps_config(tiny_model, root, "filtered", steps,
                                            output={"keep_dropped": True})))
    return kept, pl.read_parquet(root / "filtered"), pl.read_parquet(root / "in.parquet")


def test_filters_keep_exactly_the_rows_their_condition_selects(filtered):
    summary, out, source = filtered
    by_sku = {r["sku"]: r for r in source.to_dicts()}
    first = out.unique("sku", keep="first", maintain_order=True)
    assert first["sku"].to_list() == source["sku"].to_list()  # every row, kept or dropped
    for row in first.to_dicts():
        price = by_sku[row["sku"]]["price"]
        if price >= 60:
            assert row["dropped_by"] == "cheap" and row["judge"] is None, row
        elif row["error"] is not None:  # a judgement that did not parse: kept, with it
            assert row["dropped_by"] is None and row["error"].startswith("step judge:")
        else:
            score = row["judge"]["score"]
            assert row["dropped_by"] == ("keep" if score < 3 else None), row
            assert (row["pitch"] is None) == (score < 3)
    passed = out.filter(pl.col("dropped_by").is_null() & pl.col("error").is_null())
    assert passed.height == 2 * passed["sku"].n_unique()  # n: 2 samples each
    assert passed["pitch_index"].to_list() == [0, 1] * passed["sku"].n_unique()
    assert out.filter(pl.col("dropped_by").is_not_null())["pitch_index"].is_null().all()
    steps = {s["name"]: s for s in summary.report["steps"]}
    cheap = int((source["price"] < 60).sum())
    assert steps["cheap"]["rows_in"] == ROWS and steps["cheap"]["rows_out"] == cheap
    assert steps["cheap"]["dropped"] == ROWS - cheap
    assert steps["keep"]["dropped"] == first.filter(pl.col("dropped_by") == "keep").height
    assert steps["pitch"]["rows_out"] == passed.height
    assert summary.input_rows == ROWS
    # the dropped rows written (keep_dropped) are counted apart, not as ok
    rows = summary.report["rows"]
    assert rows["dropped"] == out.filter(pl.col("dropped_by").is_not_null()).height > 0
    assert rows["ok"] == out.filter(pl.col("dropped_by").is_null()
                                    & pl.col("error").is_null()).height


RESUME_STEPS = [
    {"name": "questions", "prompt": {"template": "Two questions about {{ title }}:"},
     "sampling": {"temperature": 0.8, "max_tokens": 40},
     "structured": {"json_schema": {"type": "array", "minItems": 2, "maxItems": 2,
                                    "items": {"type": "string", "maxLength": 6}}},
     "explode": True},
    {"name": "answer", "prompt": {"template": "Q: {{ questions }}\nA:"},
     "sampling": {"temperature": 0.8, "max_tokens": ANSWER_TOKENS}},
    {"name": "long", "where": "length(answer) > 6"},
    {"name": "verdict", "prompt": {"template": "{{ questions }} {{ answer }} ok?"},
     "sampling": {"temperature": 0.8, "max_tokens": 3}, "structured": {"choice": ["y", "n"]}},
]


@pytest.fixture(scope="session")
def synthetic(tiny_model, steps_input, ray_cluster):
    """A seeded synthetic-data job: questions fanned out, answered, filtered, judged."""
    root = steps_input

    def config(name: str) -> dict:
        return steps_config(tiny_model, root, name, RESUME_STEPS,
                            resources={"batch_size": 4})

    run_job(load_config(config("synthetic")))
    return root, config, pl.read_parquet(root / "synthetic")


def test_explode_makes_a_row_per_element_and_dropped_rows_are_not_written(synthetic):
    root, _, out = synthetic
    assert "dropped_by" not in out.columns
    parsed = out.filter(pl.col("questions").is_not_null())
    per_row = parsed.group_by("sku", maintain_order=True).agg(pl.col("questions_index"))
    # each parsed array gave two rows, 0 and 1, less those the filter dropped
    assert all(set(i) <= {0, 1} for i in per_row["questions_index"])
    kept = out.filter(pl.col("error").is_null())
    assert (kept["answer"].str.len_chars() > 6).all()
    assert set(kept["verdict"]) <= {"y", "n"}
    assert out["questions_text"].null_count() < out.height


def test_killed_in_the_middle_of_step_two_resumes_equal_to_an_uninterrupted_run(synthetic,
                                                                               capsys):
    root, config, reference = synthetic
    raw = config("reclaimed")
    path = root / "reclaimed.yaml"
    path.write_text(yaml.safe_dump(raw))
    marker = root / "reclaimed.fault"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(FAULTS), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
        "OVERNIGHT_TEST_FAULT": "reclaim", "OVERNIGHT_TEST_POISON_TOKENS": str(ANSWER_TOKENS),
        "OVERNIGHT_TEST_FAULT_AFTER": "50", "OVERNIGHT_TEST_FAULT_MARKER": str(marker)}
    command = [sys.executable, "-m", "pipelines.cli", "run", str(path), "--quiet"]
    proc = subprocess.Popen(command, cwd=REPO, env=env, start_new_session=True, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        deadline = time.time() + 300
        while not marker.exists() and proc.poll() is None and time.time() < deadline:
            time.sleep(0.05)
        os.killpg(proc.pid, signal.SIGKILL)  # the 50th answer request is in the engine
        proc.communicate(timeout=120)
    finally:
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    assert proc.returncode == -signal.SIGKILL  # the whole job, killed at an answer request
    assert not (root / "reclaimed").exists()
    staged = sorted(p.name for p in (root / "reclaimed.partial").glob("part-*.parquet"))
    assert staged, "no block was written before the kill"

    code, stdout, stderr = cli("run", path, capsys=capsys)  # (in this process's Ray)
    assert code == 0, stderr
    assert "resumed: " in stdout
    out = pl.read_parquet(root / "reclaimed")
    assert out["sku"].to_list() == reference["sku"].to_list()
    assert out.equals(reference)
    record = json.loads((root / "reclaimed.report.json").read_text())
    assert [s["rows_in"] for s in record["steps"]] == [
        s["rows_in"] for s in json.loads((root / "synthetic.report.json").read_text())["steps"]]


@pytest.mark.parametrize("steps, message", [
    ([{"name": "a", "prompt": {"template": "{{ b }}"}},
      {"name": "b", "prompt": {"template": "{{ title }}"}}],
     "steps[0] (a): prompt uses 'b': a column of step 'b', which comes later"),
    ([{"name": "a", "prompt": {"template": "{{ title }}"}},
      {"name": "f", "where": "nope > 1"}],
     "steps[1] (f): where uses 'nope', which is not a column of the input or of an earlier "
     "step"),
    ([{"name": "a", "prompt": {"template": "{{ title }}"}}, {"name": "f", "where": "price + 1"}],
     "steps[1] (f): where 'price + 1' is a Float64, not a condition"),
    ([{"name": "a", "prompt": {"template": "{{ title }}"}}, {"name": "f", "where": "a >"}],
     "steps[1] (f): where 'a >' does not parse"),
    ([{"name": "a", "prompt": {"template": "{{ title }}"}, "explode": True,
       "structured": {"json_schema": {"type": "object", "properties": {"x": {"type": "string"}}}}}],
     "steps[0] (a): explode needs structured.json_schema of type array"),
])
def test_a_step_that_cannot_run_is_refused_before_the_engine_starts(
        tiny_model, steps_input, steps, message):
    with pytest.raises(JobError) as err:
        plan_job(load_config(steps_config(tiny_model, steps_input, "refused", steps)))
    assert str(err.value).startswith(message), str(err.value)
    assert "\n" not in str(err.value)


@pytest.mark.parametrize("change, message", [
    ({"sampling": {"max_tokens": 5}}, "sampling.max_tokens does not apply to a job with steps"),
    ({"prompt": {"template": "x"}}, "give exactly one of prompt (a job of one step) and steps"),
    ({"steps": [{"name": "a", "where": "price > 1"}]}, "steps: no step has a prompt"),
    ({"steps": [{"name": "a", "prompt": {"template": "x"}},
                {"name": "a", "prompt": {"template": "y"}}]}, "steps[1].name 'a' is used"),
    ({"steps": [{"name": "x", "where": "price > 1", "column": "c"}]},
     "steps.0: column does not apply to a step without a prompt"),
])
def test_steps_config_errors_name_the_key(tiny_model, steps_input, change, message):
    from pipelines.errors import ConfigError

    raw = steps_config(tiny_model, steps_input, "bad", [{"name": "a", "prompt": {
        "template": "{{ title }}"}}])
    raw.update(change)
    with pytest.raises(ConfigError) as err:
        load_config(raw)
    assert message in str(err.value), str(err.value)
