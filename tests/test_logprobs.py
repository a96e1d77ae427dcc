"""Logprobs and confidence through a real job (Ray Data + vLLM on CPU, the tiny model): the
logprobs column equals vLLM's own for the same greedy requests; with structured.choice the
confidence column is the chosen label's probability among the labels (udfs/rows/logprobs.py)."""

from __future__ import annotations

import json
import math

import polars as pl
import pyarrow.parquet as pq
import pytest

from pipelines import load_config, run_job
from pipelines.errors import ConfigError
from pipelines.plan.preflight import plan_job
from udfs.rows.logprobs import LOGPROBS_TYPE, label_confidence, label_masses
from udfs.stages.prompts import PromptRenderer

from conftest import job_config

ROWS = [{"title": f"Kettle {i}", "description": f"Boils water fast, model {i}."}
        for i in range(12)]
LABELS = ["yes", "no"]
# the sampling section's penalties reach vLLM: the reference is given the same
PENALTIES = {"repetition_penalty": 1.3, "presence_penalty": 0.4, "frequency_penalty": 0.4}


@pytest.fixture(scope="session")
def rows_file(tmp_path_factory):
    path = tmp_path_factory.mktemp("logprobs") / "in.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    return path


def _run(tiny_model, rows_file, out, **sections):
    config = load_config(job_config(tiny_model, rows_file, out, **sections))
    return config, run_job(config), pl.read_parquet(out)


@pytest.fixture(scope="session")
def free_job(tiny_model, ray_cluster, rows_file):
    """Free generation, greedy, penalised, with the tokens' logprobs and their top 3
    alternatives."""
    return _run(tiny_model, rows_file, rows_file.parent / "free", output={"logprobs": 3},
                sampling=PENALTIES)


@pytest.fixture(scope="session")
def choice_job(tiny_model, ray_cluster, rows_file):
    """A yes/no classifier, greedy; top 6 (every token the grammar can allow here) kept in
    the logprobs column so that the test can read both labels' shares itself."""
    return _run(tiny_model, rows_file, rows_file.parent / "choice",
                output={"logprobs": 6}, structured={"choice": LABELS},
                prompt={"template": "Is this a kettle? {{ title }}: {{ description }}"})


def test_logprobs_equal_vllms_own_for_the_same_greedy_requests(free_job, llm):
    import vllm

    config, _, out = free_job
    renderer = PromptRenderer(plan_job(config).render)
    prompts = [vllm.inputs.TokensPrompt(prompt_token_ids=renderer.render_row(r)[0])
               for r in ROWS]
    params = vllm.SamplingParams(temperature=0.0, max_tokens=config.sampling.max_tokens,
                                 logprobs=3, **PENALTIES)
    theirs = llm.generate(prompts, params, use_tqdm=False)
    plain = llm.generate(prompts, vllm.SamplingParams(
        temperature=0.0, max_tokens=config.sampling.max_tokens), use_tqdm=False)
    assert out["rewritten"].to_list() == [t.outputs[0].text for t in theirs]
    assert out["rewritten"].to_list() != [t.outputs[0].text for t in plain]  # they tell
    assert out["error"].null_count() == len(ROWS)
    compared = 0
    for ours, their in zip(out["logprobs"].to_list(), theirs):
        completion = their.outputs[0]
        assert [t["token_id"] for t in ours] == list(completion.token_ids)
        for token, position in zip(ours, completion.logprobs):
            reference = position[token["token_id"]]
            assert token["token"] == reference.decoded_token
            assert token["logprob"] == pytest.approx(reference.logprob, abs=1e-5)
            best = sorted((lp for lp in position.items() if lp[1].rank <= 3),
                          key=lambda lp: lp[1].rank)
            assert [t["token_id"] for t in token["top"]] == [tid for tid, _ in best]
            assert [t["logprob"] for t in token["top"]] == pytest.approx(
                [lp.logprob for _, lp in best], abs=1e-5)
            compared += 1
    assert compared == out["completion_tokens"].sum() > len(ROWS)


def test_logprobs_column_is_a_list_of_token_structs(free_job):
    config, _, _ = free_job
    part = next(iter(sorted((pq.ParquetDataset(config.output.path).files))))
    assert pq.read_schema(part).field("logprobs").type == LOGPROBS_TYPE
    assert "logprobs" in config.generated_columns()
    assert "confidence" not in config.generated_columns()  # no choice, no confidence


def test_confidence_is_the_chosen_labels_probability(choice_job):
    _, summary, out = choice_job
    assert summary.errors == {} and out.height == len(ROWS)
    assert set(out["rewritten"]) <= set(LABELS)
    for text, confidence, tokens in zip(out["rewritten"], out["confidence"], out["logprobs"]):
        assert 0.0 <= confidence <= 1.0
        # each label's share read independently from the generation's logprobs: for two
        # labels they are the whole of the probability, and the chosen one is the larger
        masses = label_masses(LABELS, tokens)
        assert sum(masses.values()) == pytest.approx(1.0, abs=1e-5)
        assert confidence == pytest.approx(masses[text], abs=1e-6)
        assert masses[text] == max(masses.values())
    assert out["confidence"].n_unique() > 1  # read from each row, not a constant


def test_confidence_sees_labels_that_share_their_first_tokens():
    """The text, not token ids, decides: 'very good' and 'very bad' part only at their
    sixth character, however the grammar let the model spell 'very '."""
    labels = ["very good", "very bad", "neutral"]

    def step(token, logprob, *alternatives):
        top = [{"token": t, "token_id": None, "logprob": math.log(p)}
               for t, p in alternatives]
        return {"token": token, "token_id": None, "logprob": logprob, "top": top}

    entries = [
        step("v", math.log(0.6), ("v", 0.6), ("ve", 0.2), ("n", 0.2)),
        step("ery ", 0.0, ("ery ", 1.0)),
        step("g", math.log(0.75), ("g", 0.75), ("b", 0.25)),
        step("ood", 0.0, ("ood", 1.0)),
        step("</s>", 0.0, ("</s>", 1.0)),
    ]
    masses = label_masses(labels, entries)
    assert masses == pytest.approx({"very good": 0.8 * 0.75, "very bad": 0.8 * 0.25,
                                    "neutral": 0.2})
    assert label_confidence(labels, "very good", entries) == pytest.approx(0.6)
    assert label_confidence(labels, "verily", entries) is None  # not a label: no number


def test_logprob_columns_are_named_and_checked(tiny_model, tmp_path):
    base = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                      structured={"choice": LABELS})
    config = load_config(base)
    assert config.generated_columns()[:3] == ["row_id", "rewritten", "confidence"]
    off = load_config({**base, "output": {**base["output"], "confidence_column": None}})
    assert "confidence" not in off.generated_columns()
    with pytest.raises(ConfigError, match="output.logprobs_column 'error' is taken"):
        load_config({**base, "output": {**base["output"], "logprobs": 2,
                                        "logprobs_column": "error"}})
    with pytest.raises(ConfigError, match="output.logprobs: Input should be less than or "
                                          "equal to 20"):
        load_config({**base, "output": {**base["output"], "logprobs": 21}})
