"""The vLLM engine behind the predictor: one bad request never fails the others, and
blocks submitted together from several threads all complete, each in its own order."""

from __future__ import annotations

import threading

import pytest

from udfs.engine import EngineSpec, GenerationRequest, build_engine

from conftest import KV_CACHE


@pytest.fixture(scope="session")
def vllm_engine(tiny_model):
    # Not closed: an in-process vLLM engine's shutdown tears down the process-wide
    # distributed state, which the reference `llm` in this same process still uses. (In a job
    # each engine has its actor process to itself.)
    return build_engine(EngineSpec("vllm", tiny_model, {
        "dtype": "float32", "max_model_len": 512, "kv_cache_memory_bytes": KV_CACHE}))


def test_a_request_the_engine_rejects_is_a_row_error(vllm_engine, llm):
    import vllm

    ok = [0, 3, 200, 40, 75]
    results = vllm_engine.generate([
        GenerationRequest(ok, 8, temperature=0.0),
        GenerationRequest([5] * 600, 8, temperature=0.0),  # longer than max_model_len 512
        GenerationRequest(ok[:3], 8, temperature=0.0),
    ])
    assert results[1].text is None
    assert "VLLMValidationError" in results[1].error and "600" in results[1].error
    reference = llm.generate([vllm.inputs.TokensPrompt(prompt_token_ids=ok),
                              vllm.inputs.TokensPrompt(prompt_token_ids=ok[:3])],
                             vllm.SamplingParams(temperature=0.0, max_tokens=8),
                             use_tqdm=False)
    assert [results[0].text, results[2].text] == [r.outputs[0].text for r in reference]


def test_blocks_from_several_threads_share_the_engine(vllm_engine):
    blocks = [[GenerationRequest([0, 3, 10 + b, 20 + i], 4 + 3 * i, temperature=0.0,
                                 ignore_eos=True)
               for i in range(6)] for b in range(4)]
    got: dict[int, list] = {}

    def run(b):
        got[b] = vllm_engine.generate(blocks[b])

    threads = [threading.Thread(target=run, args=(b,)) for b in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for b in range(4):
        assert [r.completion_tokens for r in got[b]] == [4 + 3 * i for i in range(6)]
        alone = vllm_engine.generate(blocks[b])
        assert [r.text for r in got[b]] == [r.text for r in alone]


def test_regex_and_choice_constrain_the_engine(vllm_engine):
    import re

    prompts = [[0, 3, 200 + i, 40] for i in range(4)]
    regex = vllm_engine.generate([GenerationRequest(p, 16, temperature=0.0,
                                                    structured={"regex": r"[0-9]{3}-[a-z]{2}"})
                                  for p in prompts])
    assert all(re.fullmatch(r"[0-9]{3}-[a-z]{2}", r.text) for r in regex), regex
    choice = vllm_engine.generate([GenerationRequest(p, 16, temperature=0.7, seed=i,
                                                     structured={"choice": ["yes", "no"]})
                                   for i, p in enumerate(prompts)])
    assert {r.text for r in choice} <= {"yes", "no"}


def test_an_engine_that_cannot_be_built_says_why_from_its_constructor(tiny_model):
    # On CPU the engine is built in its stepper thread (udfs/vllm_engine.py): the error must
    # still reach the caller, not die with the thread and leave the caller waiting
    with pytest.raises(Exception, match="max_model_len"):
        build_engine(EngineSpec("vllm", tiny_model, {
            "dtype": "float32", "max_model_len": 10**6, "kv_cache_memory_bytes": KV_CACHE}))
