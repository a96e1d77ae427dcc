"""The vLLM engine behind the predictor: one bad request never fails the others, and
blocks submitted together from several threads all complete, each in its own order."""

from __future__ import annotations

import threading

import pytest

from udfs.engines.engine import EngineSpec, GenerationRequest, build_engine

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
    # On CPU the engine is built in its stepper thread (udfs/engines/stepper.py): the error must
    # still reach the caller, not die with the thread and leave the caller waiting
    with pytest.raises(Exception, match="max_model_len"):
        build_engine(EngineSpec("vllm", tiny_model, {
            "dtype": "float32", "max_model_len": 10**6, "kv_cache_memory_bytes": KV_CACHE}))


def test_more_requests_than_the_engine_has_slots_all_complete_in_order(vllm_engine, llm):
    # 3 blocks x 100 requests from three threads: more than the engine's 256 sequence slots,
    # so some wait in the stepper's queue (longest first) before the engine sees them
    import vllm

    blocks = [[GenerationRequest([0, 3, 30 + b, i % 200], 1 + (7 * i + b) % 6,
                                 temperature=0.0, ignore_eos=True)
               for i in range(100)] for b in range(3)]
    got: dict[int, list] = {}
    threads = [threading.Thread(target=lambda b=b: got.__setitem__(b, vllm_engine.generate(
        blocks[b]))) for b in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    for b in range(3):
        reference = llm.generate(
            [vllm.inputs.TokensPrompt(prompt_token_ids=r.prompt_token_ids) for r in blocks[b]],
            [vllm.SamplingParams(temperature=0.0, max_tokens=r.max_tokens, ignore_eos=True)
             for r in blocks[b]], use_tqdm=False)
        assert [r.text for r in got[b]] == [o.outputs[0].text for o in reference]
        assert [r.completion_tokens for r in got[b]] == [r.max_tokens for r in blocks[b]]


def test_waiting_requests_go_longest_first_and_none_waits_forever():
    from udfs.engines.stepper import Batch, _Waiting

    def batch(*lengths):
        return Batch([GenerationRequest([1], n) for n in lengths])

    waiting, first = _Waiting(), batch(10, 200, 50, 50)
    for i in range(4):
        waiting.push(first, i, step=0)
    assert [waiting.pop()[1] for _ in range(2)] == [1, 2]  # the longest; ties in arrival order
    # 30 steps later a newcomer goes before a waiting request only if it is more than 30
    # tokens longer: 100 before the waiting 50, 60 not; the new 10 after the old 10
    late = batch(100, 60, 10)
    for i in range(3):
        waiting.push(late, i, step=30)
    assert [(b is late, i) for b, i in (waiting.pop() for _ in range(5))] == [
        (True, 0), (False, 3), (True, 1), (False, 0), (True, 2)]
    assert not waiting


def test_the_c_heap_is_trimmed_at_most_once_a_trim_interval(monkeypatch):
    # Trimming after every block handed back the pages the engine reuses for each step's
    # activations: they faulted in again, and the prefill-heavy job ran ~0.1 slower (#24)
    import time

    import udfs.stages.memory as memory

    trims = []
    monkeypatch.setattr(memory, "_malloc_trim", trims.append)
    monkeypatch.setattr(memory, "_trimmed_at", None)
    for _ in range(5):  # blocks in quick succession: the first trims
        memory.release_free_memory()
    assert trims == [0]
    # a trim interval later, the next block trims again, and the one after it does not
    monkeypatch.setattr(memory, "_trimmed_at", time.monotonic() - memory.TRIM_EVERY_S - 1)
    memory.release_free_memory()
    memory.release_free_memory()
    assert trims == [0, 0]
