"""Reasoning models (model.reasoning_parser) through a real job: vLLM on CPU, a tiny random
thinking model (``<think>``/``</think>`` in its tokenizer, a template that opens the thinking).
A random model rarely closes its thinking by itself: the jobs give ``</think>`` a logit bias
(sampling.logit_bias) that makes some rows close it within the budget and some after it. The
proof is parity with vLLM's own ``run_batch --reasoning-parser`` on the same requests, row for
row."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import polars as pl
import pytest

from pipelines import load_config, run_job
from pipelines.batchfile.run import run_batch_file
from pipelines.errors import ConfigError
from pipelines.plan.preflight import plan_job
from udfs.stages.prompts import PromptRenderer

from conftest import KV_CACHE, cli, job_config

ROWS = [{"title": f"Lamp {i}", "description": f"A steel lamp, model {i}, warm light."}
        for i in range(24)]
PARSER = "deepseek_r1"
BUDGET = 24
# </think>'s logit bias: on this model and these prompts every row closes its thinking within
# 65 tokens, 5 of 24 after 24 (measured with bare vLLM, 2026-12-04)
BIAS = 1.5
TEMPLATE = "Describe {{ title }}: {{ description }}"
SYSTEM = "Be brief."


@pytest.fixture(scope="session")
def think_model(tmp_path_factory):
    from pipelines.tools.tiny_model import build_tiny_model

    return str(build_tiny_model(tmp_path_factory.mktemp("think") / "model", reasoning=True))


@pytest.fixture(scope="session")
def end_token(think_model):
    from transformers import AutoTokenizer

    return AutoTokenizer.from_pretrained(think_model).convert_tokens_to_ids("</think>")


@pytest.fixture(scope="session")
def root(tmp_path_factory):
    path = tmp_path_factory.mktemp("reasoning")
    (path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _config(think_model, root, out, end_token, **sections):
    base = {"model": {"reasoning_parser": PARSER},
            "prompt": {"system": SYSTEM, "template": TEMPLATE},
            "sampling": {"temperature": 0.0, "max_tokens": BUDGET,
                         "logit_bias": {end_token: BIAS}}}
    sections = {**base, **{k: {**base.get(k, {}), **v} for k, v in sections.items()}}
    return job_config(think_model, root / "in.jsonl", root / out, **sections)


@pytest.fixture(scope="session")
def thinking_job(think_model, end_token, root, ray_cluster):
    config = load_config(_config(think_model, root, "out", end_token))
    summary = run_job(config)
    return config, summary, pl.read_parquet(root / "out")


@pytest.fixture(scope="session")
def requests_file(thinking_job, root, end_token):
    """The job's rows as chat requests, as vLLM's run_batch takes them."""
    config, _, _ = thinking_job
    lines = [{"custom_id": f"r{i}", "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "think", "max_tokens": BUDGET, "temperature": 0,
                       "logit_bias": {str(end_token): BIAS},
                       "messages": [{"role": "system", "content": SYSTEM},
                                    {"role": "user", "content": f"Describe {r['title']}: "
                                                                f"{r['description']}"}]}}
             for i, r in enumerate(ROWS)]
    path = root / "requests.jsonl"
    path.write_text("".join(json.dumps(line) + "\n" for line in lines))
    return path


@pytest.fixture(scope="session")
def vllms_run_batch(requests_file, think_model, root):
    out = root / "vllm_out.jsonl"
    run = subprocess.run(
        [sys.executable, "-m", "vllm.entrypoints.openai.run_batch", "-i", str(requests_file),
         "-o", str(out), "--model", think_model, "--served-model-name", "think",
         "--reasoning-parser", PARSER, "--dtype", "float32", "--max-model-len", "512",
         "--kv-cache-memory-bytes", str(KV_CACHE), "--enforce-eager",
         "--no-enable-chunked-prefill"],
        capture_output=True, text=True, timeout=600,
        env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    return {line["custom_id"]: line["response"]["body"]
            for line in map(json.loads, out.read_text().splitlines())}


@pytest.fixture(scope="session")
def our_batch(requests_file, think_model, root, ray_cluster):
    results = root / "results.jsonl"
    run_batch_file(requests_file, results, model=think_model, overrides=[
        f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
        "model.max_model_len=512", "resources.batch_size=8",
        f"model.reasoning_parser={PARSER}"])
    return {line["custom_id"]: line["response"]["body"]
            for line in map(json.loads, results.read_text().splitlines())}


def test_the_answer_and_the_thinking_equal_vllms_run_batch_row_for_row(
        thinking_job, vllms_run_batch):
    _, _, out = thinking_job
    assert out.columns == ["title", "description", "row_id", "rewritten", "reasoning",
                           "finish_reason", "prompt_tokens", "completion_tokens",
                           "reasoning_tokens", "error_kind", "error", "request_key"]
    for i, row in enumerate(out.iter_rows(named=True)):
        theirs = vllms_run_batch[f"r{i}"]
        message = theirs["choices"][0]["message"]
        assert row["rewritten"] == message["content"], i
        assert row["reasoning"] == message["reasoning"], i
        assert row["finish_reason"] == theirs["choices"][0]["finish_reason"]
        assert row["prompt_tokens"] == theirs["usage"]["prompt_tokens"]
        assert row["completion_tokens"] == theirs["usage"]["completion_tokens"]
        # vLLM counts only tokens between a <think> and a </think> of the output, none where
        # the template opened the thinking (this model's, DeepSeek-R1's); overnight counts the
        # tokens before </think>, less the markers
        assert theirs["usage"]["completion_tokens_details"]["reasoning_tokens"] == 0
        tokens = row["completion_tokens"]
        if row["rewritten"] is None:
            # all of it thinking (or all but a </think> that came as the budget's last token)
            assert row["reasoning_tokens"] in (tokens, tokens - 1)
        else:  # the thinking, </think>, then the answer's tokens
            assert row["reasoning_tokens"] <= tokens - 2
    # the shapes the test needs are there: answered rows, and rows that ran out thinking
    answered = out.filter(pl.col("rewritten").is_not_null())
    assert 0 < answered.height < out.height
    assert answered["reasoning"].null_count() < answered.height


def test_a_row_out_of_budget_in_its_thinking_is_no_answer_and_a_larger_budget_completes_it(
        thinking_job, think_model, end_token, root, ray_cluster):
    import shutil

    config, summary, out = thinking_job
    short = out.filter(pl.col("error_kind") == "no_answer")
    assert short.height > 0
    assert short["finish_reason"].to_list() == ["length"] * short.height
    assert short["reasoning"].null_count() == 0 and short["rewritten"].null_count() == short.height
    assert short["completion_tokens"].to_list() == [BUDGET] * short.height
    assert "--retry-errors --set sampling.max_tokens=N" in short["error"][0]
    assert summary.errors == {"no_answer": short.height}

    again = root / "retried"
    shutil.copytree(root / "out", again)
    shutil.copy(root / "out.overnight.json", root / "retried.overnight.json")
    bigger = load_config(_config(think_model, root, "retried", end_token),
                         ["sampling.max_tokens=96"])
    run_job(bigger, retry_errors=True)
    retried = pl.read_parquet(again)
    was = set(short["row_id"].to_list())
    for before, after in zip(out.iter_rows(named=True), retried.iter_rows(named=True)):
        if before["row_id"] not in was:
            assert after == before  # the rows that had answered are kept as they were
        else:
            assert after["error"] is None and after["rewritten"] is not None
            assert after["reasoning"].startswith(before["reasoning"])  # greedy: the same start


def test_the_report_counts_thinking_apart_from_the_answer(thinking_job, root):
    report = json.loads((root / "out.report.json").read_text())
    _, _, out = thinking_job
    assert report["reasoning"] == {
        "reasoning_tokens": out["reasoning_tokens"].sum(),
        "answer_tokens": out["completion_tokens"].sum() - out["reasoning_tokens"].sum(),
        "no_answer_rows": out.filter(pl.col("error_kind") == "no_answer").height,
        "no_answer_share": round(out.filter(pl.col("error_kind") == "no_answer").height
                                 / out.height, 4)}
    from pipelines.report.report_text import report_lines

    line = next(x for x in report_lines(report) if x.startswith("reasoning"))
    assert f"{report['reasoning']['no_answer_rows']} rows without an answer" in line


def test_batch_results_carry_the_reasoning_as_vllms_server_does(our_batch, vllms_run_batch,
                                                                thinking_job):
    _, _, out = thinking_job
    for i in range(len(ROWS)):
        ours, theirs = our_batch[f"r{i}"], vllms_run_batch[f"r{i}"]
        assert ours["choices"][0]["message"]["content"] == \
            theirs["choices"][0]["message"]["content"]
        assert ours["choices"][0]["message"]["reasoning"] == \
            theirs["choices"][0]["message"]["reasoning"]
        assert ours["choices"][0]["finish_reason"] == theirs["choices"][0]["finish_reason"]
        assert {k: v for k, v in ours["usage"].items() if k != "completion_tokens_details"} \
            == {k: theirs["usage"][k] for k in ("prompt_tokens", "completion_tokens",
                                                "total_tokens")}
        assert ours["usage"]["completion_tokens_details"]["reasoning_tokens"] == \
            out["reasoning_tokens"][i]
        assert ours["choices"][0]["message"]["content"] == out["rewritten"][i]


def test_a_json_schema_answer_parses_after_the_thinking_it_keeps(
        think_model, end_token, root, ray_cluster):
    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 8}},
              "required": ["colour"], "additionalProperties": False}
    config = load_config(_config(think_model, root, "json", end_token,
                                 structured={"json_schema": schema},
                                 sampling={"max_tokens": 96}))
    run_job(config)
    out = pl.read_parquet(root / "json")
    done = out.filter(pl.col("error").is_null())
    assert done.height > 0
    assert done["parsed"].null_count() == 0  # every answered row parsed
    assert all(json.loads(text)["colour"] == parsed["colour"]
               for text, parsed in zip(done["rewritten"], done["parsed"]))
    assert done["reasoning"].null_count() < done.height  # and the thinking is kept
    left = out.filter(pl.col("error").is_not_null())
    assert set(left["error_kind"].to_list()) <= {"no_answer"}, left["error"].to_list()


def test_enable_thinking_false_reaches_the_chat_template_as_vllms_chat_path_passes_it(
        think_model, end_token, root):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(think_model)
    messages = [{"role": "system", "content": SYSTEM},
                {"role": "user", "content": f"Describe {ROWS[0]['title']}: "
                                            f"{ROWS[0]['description']}"}]
    on = PromptRenderer(plan_job(load_config(_config(think_model, root, "on", end_token)))
                        .render)
    off = PromptRenderer(plan_job(load_config(_config(
        think_model, root, "off", end_token,
        prompt={"system": SYSTEM, "template": TEMPLATE,
                "chat_template_kwargs": {"enable_thinking": False}}))).render)
    assert off.render_text(ROWS[0]) != on.render_text(ROWS[0])
    assert off.render_text(ROWS[0]) == tokenizer.apply_chat_template(
        messages, tokenize=False, add_generation_prompt=True, enable_thinking=False)
    assert off.render_text(ROWS[0]).endswith("<think>\n\n</think>\n\n")
    assert off.render_row(ROWS[0])[0] == list(tokenizer.apply_chat_template(
        messages, tokenize=True, add_generation_prompt=True, enable_thinking=False,
        return_dict=False))


def test_preflight_refuses_a_parser_vllm_lacks_and_settings_it_cannot_honour(
        think_model, end_token, root):
    with pytest.raises(ConfigError, match=r"^model.reasoning_parser 'deepseek-r1' is not one "
                       r"of vLLM's reasoning parsers; did you mean 'deepseek_r1'\? vLLM has: "
                       r".*deepseek_r1.*qwen3"):
        plan_job(load_config(_config(think_model, root, "x", end_token,
                                     model={"reasoning_parser": "deepseek-r1"})))
    with pytest.raises(ConfigError, match="model.reasoning_parser does not apply to task: "
                                          "embed"):
        load_config({"task": "embed", "input": {"path": str(root / "in.jsonl")},
                     "model": {"name": think_model, "reasoning_parser": PARSER},
                     "prompt": {"template": TEMPLATE}, "output": {"path": str(root / "y")}})
    with pytest.raises(ConfigError, match="output.reasoning_column needs "
                                          "model.reasoning_parser"):
        load_config(job_config(think_model, root / "in.jsonl", root / "z",
                               output={"reasoning_column": "thoughts"}))
    with pytest.raises(ConfigError, match=r"sampling.logit_bias.*not within -100 and 100"):
        load_config(_config(think_model, root, "w", end_token,
                            sampling={"logit_bias": {end_token: 101}}))


def test_the_cli_says_a_wrong_parser_in_one_line(think_model, end_token, root, tmp_path,
                                                 capsys):
    import yaml

    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(_config(think_model, root, "cli", end_token,
                                           model={"reasoning_parser": "qwen"})))
    code, _, err = cli("validate", path, capsys=capsys)  # (in this process)
    assert code == 2
    assert err.count("\n") == 1 and err.startswith(
        "overnight: error: model.reasoning_parser 'qwen' is not one of vLLM's")


# A job of steps on the thinking model: a draft that thinks, then a judge that reads the
# draft's answer and its thinking by name, with the thinking switched off in its template.
# qwen3's parser reads the switch (chat_template_kwargs.enable_thinking) per request, as
# vLLM's chat path gives it: with thinking off the whole output is the answer.
JUDGE = "Answer: {{ draft }}\nThinking: {{ draft_reasoning }}"


@pytest.fixture(scope="session")
def steps_job(think_model, end_token, root, ray_cluster):
    config = job_config(think_model, root / "in.jsonl", root / "steps",
                        model={"reasoning_parser": "qwen3"})
    del config["prompt"], config["sampling"], config["output"]["column"]
    config["steps"] = [
        {"name": "draft", "prompt": {"system": SYSTEM, "template": TEMPLATE},
         "sampling": {"temperature": 0.0, "max_tokens": BUDGET,
                      "logit_bias": {end_token: BIAS}}},
        {"name": "judge", "prompt": {"template": JUDGE, "on_null": "empty",
                                     "chat_template_kwargs": {"enable_thinking": False}},
         "sampling": {"temperature": 0.0, "max_tokens": 8}},
    ]
    config = load_config(config)
    run_job(config)
    return config, pl.read_parquet(root / "steps")


def test_a_later_step_reads_an_earlier_steps_answer_and_thinking_by_name(
        steps_job, thinking_job, think_model, root):
    from transformers import AutoTokenizer

    _, out = steps_job
    _, _, one = thinking_job
    assert out.columns == [
        "title", "description", "row_id",
        "draft", "draft_reasoning", "draft_finish_reason", "draft_prompt_tokens",
        "draft_completion_tokens", "draft_reasoning_tokens",
        "judge", "judge_reasoning", "judge_finish_reason", "judge_prompt_tokens",
        "judge_completion_tokens", "judge_reasoning_tokens",
        "finish_reason", "prompt_tokens", "completion_tokens", "reasoning_tokens",
        "error_kind", "error", "request_key"]
    # the draft step is the one-step job's requests: the same generation, split by qwen3's
    # parser, which drops the stray </think>s this random model repeats after the first
    assert out["draft_reasoning"].to_list() == one["reasoning"].to_list()
    assert out["draft"].to_list() == [(text or "").replace("</think>", "") or None
                                      for text in one["rewritten"]]
    assert out["draft_completion_tokens"].to_list() == one["completion_tokens"].to_list()
    assert out["draft_reasoning_tokens"].to_list() == one["reasoning_tokens"].to_list()
    # a draft without an answer is its step's no_answer, and goes no further
    short = out.filter(pl.col("error_kind") == "no_answer")
    assert short.height == out["draft"].null_count() > 0
    assert short["error"].str.starts_with("step draft: no answer").all()
    # (--retry-errors runs one-step jobs' rows only: a job of steps runs again whole)
    assert short["error"].str.ends_with("--set steps.0.sampling.max_tokens=N --overwrite").all()
    assert short["judge"].null_count() == short.height
    # the judge's prompt is its template over the draft's answer and thinking, rendered with
    # enable_thinking false: its prompt tokens are that prompt's
    tokenizer = AutoTokenizer.from_pretrained(think_model)
    judged = out.filter(pl.col("error").is_null())
    assert judged.height > 0
    for row in judged.iter_rows(named=True):
        text = f"Answer: {row['draft']}\nThinking: {row['draft_reasoning'] or ''}"
        ids = tokenizer.apply_chat_template([{"role": "user", "content": text}],
                                            tokenize=True, add_generation_prompt=True,
                                            enable_thinking=False, return_dict=False)
        assert row["judge_prompt_tokens"] == len(ids)
        # thinking off: the whole output is the answer
        assert row["judge_reasoning"] is None and row["judge"] is not None
        assert row["reasoning_tokens"] == row["draft_reasoning_tokens"] + \
            row["judge_reasoning_tokens"]
    report = json.loads((root / "steps.report.json").read_text())
    assert report["reasoning"]["reasoning_tokens"] == out["reasoning_tokens"].sum()
    assert report["reasoning"]["no_answer_rows"] == short.height


def test_anthropic_results_carry_the_thinking_as_a_thinking_block(our_batch, think_model,
                                                                  end_token, root, ray_cluster):
    """The same requests as a Message Batches file (Anthropic's has no logit_bias: the job's
    sampling.logit_bias is every request's): the thinking first, as a thinking block."""
    lines = [{"custom_id": f"r{i}", "params": {
        "model": "claude-sonnet-4-5", "max_tokens": BUDGET, "temperature": 0, "system": SYSTEM,
        "messages": [{"role": "user", "content": f"Describe {r['title']}: {r['description']}"}]}}
        for i, r in enumerate(ROWS)]
    (root / "messages.jsonl").write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch_file(root / "messages.jsonl", root / "messages-results.jsonl", model=think_model,
                   overrides=[f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
                              "model.max_model_len=512", "resources.batch_size=8",
                              f"model.reasoning_parser={PARSER}",
                              f"sampling.logit_bias={{{end_token}: {BIAS}}}"])
    results = [json.loads(line) for line in
               (root / "messages-results.jsonl").read_text().splitlines()]
    assert [r["custom_id"] for r in results] == [f"r{i}" for i in range(len(ROWS))]
    for result in results:
        message, body = result["result"]["message"], our_batch[result["custom_id"]]
        expected = [{"type": "thinking", "thinking": body["choices"][0]["message"]["reasoning"],
                     "signature": ""}]
        if body["choices"][0]["message"]["content"] is not None:
            expected.append({"type": "text", "text": body["choices"][0]["message"]["content"]})
        assert message["content"] == expected
        assert message["usage"]["output_tokens"] == body["usage"]["completion_tokens"]
        assert message["stop_reason"] == {"length": "max_tokens", "stop": "end_turn"}[
            body["choices"][0]["finish_reason"]]
    # both kinds are here: rows that answered, and rows whose thinking used the budget
    assert {len(r["result"]["message"]["content"]) for r in results} == {1, 2}
