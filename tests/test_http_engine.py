"""The HTTP engine against a real ``vllm serve`` on loopback (CPU, the tiny model): the same
greedy rows as the in-process engine; a server killed and restarted mid-run loses no row; a
429 is retried; a client error is that row's error; a wrong model or URL is a job error."""

from __future__ import annotations

import json
import threading
import time
from pathlib import Path

import polars as pl
import pytest

from pipelines import load_config, run_job
from pipelines.errors import JobError
from pipelines.plan.preflight import plan_job
from udfs.columns import ErrorKind
from udfs.engines.engine import EngineSpec, GenerationRequest, build_engine
from udfs.rows.logprobs import label_masses
from udfs.stages.prompts import PromptRenderer

from conftest import KV_CACHE, job_config
from servers import TooManyRequestsStub, VLLMServer, free_port

ROWS = [{"sku": f"H{i:03d}", "title": f"Kettle {i}", "description": f"Boils water, model {i}."}
        for i in range(24)]
ROWS[4]["description"] = None
ROWS[9]["description"] = "steam " * 1500  # too long for max_model_len 512
SECRET = "sk-do-not-print-me-42"


@pytest.fixture(scope="session")
def server(tiny_model, tmp_path_factory):
    srv = VLLMServer(tiny_model, tmp_path_factory.mktemp("serve") / "server.log", KV_CACHE)
    srv.start()
    yield srv
    srv.kill()


@pytest.fixture
def http_job(tiny_model, ray_cluster, tmp_path):
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))

    def make(base_url: str, name: str = "out", rows=None, output=None, sampling=None,
             structured=None, **engine):
        path = tmp_path / "in.jsonl"
        if rows is not None:
            path = tmp_path / f"{name}.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in rows))
        raw = job_config(tiny_model, path, tmp_path / name, input={"id_column": "sku"},
                         output=output or {}, sampling=sampling or {})
        raw["engine"] = {"kind": "http", "base_url": base_url, **engine}
        if structured is not None:
            raw["structured"] = structured
        return load_config(raw)

    return make


def greedy_reference(config, out: pl.DataFrame, llm) -> list[str]:
    """vLLM's own generate on the prompts the renderer makes for the rows that ran."""
    import vllm

    renderer = PromptRenderer(plan_job(config).render)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=renderer.render_row(
        {"title": r["title"], "description": r["description"]})[0])
        for r in out.filter(pl.col("error").is_null()).iter_rows(named=True)]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=config.sampling.max_tokens)
    return [r.outputs[0].text for r in llm.generate(prompts, params, use_tqdm=False)]


def test_http_job_gives_the_in_process_engines_rows(server, http_job, llm):
    config = http_job(server.base_url)
    summary = run_job(config)
    out = pl.read_parquet(config.output.path)
    assert out["sku"].to_list() == [r["sku"] for r in ROWS]
    assert dict(zip(out["sku"], out["error_kind"])) == {
        r["sku"]: (ErrorKind.NULL_FIELD if i == 4 else ErrorKind.PROMPT_TOO_LONG if i == 9
                   else None) for i, r in enumerate(ROWS)}
    ok = out.filter(pl.col("error").is_null())
    assert ok["rewritten"].to_list() == greedy_reference(config, out, llm)
    assert ok["completion_tokens"].min() > 0  # usage taken from the response
    assert summary.report["rows"]["ok"] == len(ROWS) - 2


def test_chat_endpoint_sends_messages_and_matches_too(server, http_job, llm):
    """endpoint: chat sends the rendered messages; the server's chat template gives the same
    prompt, hence the same greedy text."""
    config = http_job(server.base_url, endpoint="chat")
    run_job(config)
    out = pl.read_parquet(config.output.path)
    ok = out.filter(pl.col("error").is_null())
    assert ok.height == len(ROWS) - 2
    assert ok["rewritten"].to_list() == greedy_reference(config, out, llm)


def test_structured_output_through_the_server(server, http_job):
    """json_schema goes as response_format, choice as vLLM's structured_outputs extension."""
    import jsonschema

    schema = {"type": "object", "properties": {"colour": {"type": "string", "maxLength": 10}},
              "required": ["colour"], "additionalProperties": False}
    config = http_job(server.base_url, name="schema", rows=ROWS[:4])
    config = load_config({**config.model_dump(mode="json"), "structured": {"json_schema": schema},
                          "sampling": {"temperature": 0.0, "max_tokens": 40}})
    summary = run_job(config)
    out = pl.read_parquet(config.output.path).filter(pl.col("error").is_null())
    assert out.height == 4 and summary.structured
    for text, parsed in zip(out["rewritten"], out["parsed"]):
        jsonschema.validate(json.loads(text), schema)
        assert parsed == json.loads(text)

    config = http_job(server.base_url, name="choice", rows=ROWS[:4])
    config = load_config({**config.model_dump(mode="json"),
                          "structured": {"choice": ["red", "green", "blue"]}})
    run_job(config)
    assert set(pl.read_parquet(config.output.path)["rewritten"]) <= {"red", "green", "blue"}


def test_logprobs_and_penalties_through_the_server(server, http_job, llm):
    """output.logprobs and the sampling penalties go to the server; the logprobs it returns
    (text, no token ids) equal vLLM's own for the same greedy requests."""
    import vllm

    penalties = {"repetition_penalty": 1.3, "presence_penalty": 0.5, "frequency_penalty": 0.5}
    config = http_job(server.base_url, name="logprobs", rows=ROWS[:4],
                      output={"logprobs": 2}, sampling=penalties)
    run_job(config)
    out = pl.read_parquet(config.output.path).filter(pl.col("error").is_null())
    renderer = PromptRenderer(plan_job(config).render)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=renderer.render_row(
        {"title": r["title"], "description": r["description"]})[0])
        for r in out.iter_rows(named=True)]
    theirs = llm.generate(prompts, vllm.SamplingParams(
        temperature=0.0, max_tokens=config.sampling.max_tokens, logprobs=2, **penalties),
        use_tqdm=False)
    assert out.height == 4
    for text, ours, their in zip(out["rewritten"], out["logprobs"], theirs):
        completion = their.outputs[0]
        assert text == completion.text
        assert [t["token"] for t in ours] == [p[t].decoded_token for t, p in zip(
            completion.token_ids, completion.logprobs)]
        assert [t["logprob"] for t in ours] == pytest.approx(
            [p[t].logprob for t, p in zip(completion.token_ids, completion.logprobs)], abs=1e-5)
        # completions give the alternatives as {text: logprob}: texts that repeat (several
        # tokens decode to '' here) collapse into one, so some tokens have fewer than 2
        for token, position in zip(ours, completion.logprobs):
            assert token["token_id"] is None and 1 <= len(token["top"]) <= 2
            for alt in token["top"]:
                assert any(lp.decoded_token == alt["token"] and lp.logprob == pytest.approx(
                    alt["logprob"], abs=1e-5) for lp in position.values())

    # choice: the confidence is read from the logprobs the server sends with each answer
    labels = ["red", "green", "blue"]
    config = http_job(server.base_url, name="confidence", rows=ROWS[:4], output={"logprobs": 13},
                      structured={"choice": labels})
    run_job(config)
    out = pl.read_parquet(config.output.path).filter(pl.col("error").is_null())
    assert out.height == 4 and set(out["rewritten"]) <= set(labels)
    for text, confidence, tokens in zip(out["rewritten"], out["confidence"], out["logprobs"]):
        assert 0.0 <= confidence <= 1.0
        masses = label_masses(labels, tokens)  # 13 alternatives: all the grammar allows
        assert confidence == pytest.approx(masses[text] / sum(masses.values()), abs=1e-6)


def test_429_is_retried_and_the_key_is_never_written(server, http_job, llm, monkeypatch,
                                                       tmp_path):
    stub = TooManyRequestsStub(server.base_url, refuse=5)
    monkeypatch.setenv("OVERNIGHT_TEST_KEY", SECRET)
    try:
        config = http_job(stub.base_url, name="stubbed", rows=ROWS[:8],
                          api_key_env="OVERNIGHT_TEST_KEY", backoff_s=0.1)
        summary = run_job(config)
        out = pl.read_parquet(config.output.path)
        assert out.filter(pl.col("error").is_null())["rewritten"].to_list() == \
            greedy_reference(config, out, llm)
        assert SECRET not in repr(plan_job(config).engine)
    finally:
        stub.close()
    assert stub.refused == 5 and stub.passed == 7  # 8 rows, one null: 7 requests got through
    assert out.filter(pl.col("error").is_not_null())["sku"].to_list() == ["H004"]
    assert summary.rows == 8
    written = "".join(p.read_text() for p in tmp_path.glob("stubbed*.json"))
    assert "OVERNIGHT_TEST_KEY" in written and SECRET not in written


def test_credentials_in_the_base_url_stay_out_of_the_record_and_the_report(server, http_job,
                                                                          tmp_path):
    url = server.base_url.replace("http://", "http://someone:pw-in-url-7@")
    config = http_job(url, name="creds", rows=ROWS[:3])
    run_job(config)
    written = "".join(p.read_text() for p in tmp_path.glob("creds*.json"))
    written += "".join(p.read_text() for p in (tmp_path / "creds").glob("*")
                       if p.suffix != ".parquet")
    assert "pw-in-url-7" not in written and "someone" not in written
    assert server.base_url.split("//")[1] in written  # the server is named, without them


def test_client_error_is_that_rows_error(server, tiny_model):
    engine = build_engine(EngineSpec("http", tiny_model, {"base_url": server.base_url,
                                                          "max_retries": 0}))
    try:
        results = engine.generate([GenerationRequest([1, 40, 41], 8, temperature=0.0),
                                   GenerationRequest([5] * 600, 8, temperature=0.0),
                                   GenerationRequest([1, 40], 8, temperature=0.0)])
    finally:
        engine.close()
    assert results[0].error is None and results[2].error is None
    assert results[1].text is None and results[1].error.startswith("HTTP 400: ")
    assert "600" in results[1].error  # the server's own message


def test_wrong_model_and_unreachable_url_are_job_errors(server, http_job):
    with pytest.raises(JobError, match=r"engine.model 'nope' is not served at .*; it serves: "):
        plan_job(http_job(server.base_url, model="nope"))
    closed = f"http://127.0.0.1:{free_port()}/v1"
    with pytest.raises(JobError, match=r"engine.base_url .*: cannot reach the server \(Connect"):
        plan_job(http_job(closed))


def test_server_killed_and_restarted_mid_run_loses_no_row(server, http_job, llm):
    """Last of the module: it kills the session's server, then brings it back."""
    rows = [{"sku": f"R{i:03d}", "title": f"Mug {i}", "description": "Holds tea. " * (i % 5)}
            for i in range(48)]
    config = http_job(server.base_url, name="restarted", rows=rows, max_retries=12,
                      backoff_s=0.5)
    config = load_config({**config.model_dump(mode="json"),
                          "sampling": {"temperature": 0.0, "max_tokens": 48},
                          "resources": {"batch_size": 4, "blocks_in_flight": 1}})
    staging = Path(config.output.path + ".partial")
    result: dict = {}
    job = threading.Thread(target=lambda: result.setdefault("summary", run_job(config)))
    job.start()
    deadline = time.time() + 300
    while time.time() < deadline and len(list(staging.glob("part-*.parquet"))) < 2:
        time.sleep(0.05)
    server.kill()
    killed_at = len(list(staging.glob("part-*.parquet")))
    time.sleep(2)
    server.start()
    job.join(timeout=600)
    out = pl.read_parquet(config.output.path)
    assert killed_at < len(rows) // 4  # the server died mid-run
    assert out["sku"].to_list() == [r["sku"] for r in rows]
    assert out["error"].null_count() == len(rows)  # every request retried to success
    assert out["rewritten"].to_list() == greedy_reference(config, out, llm)
