"""vLLM in process as a pooling model: ``task: embed | score | classify``.

The engine is vLLM's own ``LLM`` with ``runner="pooling"``; ``convert`` stays vLLM's ``auto``,
which turns a ``*ForCausalLM`` into an embedding model and runs a ``*ForSequenceClassification``
as a classifier (with one label, a cross-encoder: what ``LLM.score`` needs). Requests go in as
``llm_engine.add_request(id, TokensPrompt, PoolingParams(task=...))``, as ``LLM.embed``,
``LLM.classify`` and ``LLM.score`` build them (vllm/entrypoints/pooling/), so the values are the
same: an embedding L2-normalized unless ``normalize`` is false, a classifier's softmax, a
cross-encoder's sigmoid.

The engine, its construction and its stepper thread are the generation engine's
(udfs/engines/vllm_engine.py, udfs/engines/stepper.py): one thread owns the engine, and blocks from several threads join the
running batch. Only what a request is and what comes back differ.
"""

from __future__ import annotations

import time
from dataclasses import replace
from typing import Sequence

from udfs.engines.engine import EngineSpec, PoolingRequest, PoolingResult
from udfs.engines.engine import one_line as _one_line
from udfs.engines.stepper import Batch, Stepper
from udfs.engines.vllm_engine import VLLMEngine

# PoolingParams.task for each of overnight's tasks: a cross-encoder's score is a one-label
# classification of the pair (vLLM's CrossEncoderIOProcessor)
POOLING_TASKS = {"embed": "embed", "classify": "classify", "score": "classify"}


class VLLMPoolingEngine(VLLMEngine):
    """The vllm engine's options, less structured outputs (nothing is decoded)."""

    def __init__(self, spec: EngineSpec):
        opts = {k: v for k, v in spec.options.items()
                if k not in ("structured_outputs", "max_logprobs")}
        opts["args"] = {"runner": "pooling", **opts.get("args", {})}
        super().__init__(replace(spec, options=opts))
        config = self.llm.llm_engine.model_config
        self.embedding_size = getattr(config, "embedding_size", None)

    @staticmethod
    def stepper_class() -> type[Stepper]:
        return _PoolingStepper

    def pool(self, requests: Sequence[PoolingRequest]) -> list[PoolingResult]:
        """Thread-safe, as ``generate`` is: every block's requests go to the one engine."""
        return VLLMEngine.generate(self, requests)

    def generate(self, requests):
        raise TypeError("a pooling engine does not generate text; use pool()")

    def _pooling_params(self, req: PoolingRequest):
        params = self.vllm.PoolingParams(task=POOLING_TASKS[req.task])
        if req.task == "embed":
            params.use_activation = req.normalize  # for embeddings: normalize
            params.dimensions = req.dimensions
        if req.pair_start is not None:  # token types: 0 for the query, 1 from the document
            params.extra_kwargs = {"compressed_token_type_ids": req.pair_start}
        return params


class _PoolingStepper(Stepper):
    """The generation stepper with pooling requests: each finishes in the step that reads
    it, in arrival order (nothing to gain from ordering by length), and its tokens count as
    the prompt's."""

    def slots(self, llm_engine) -> int:
        # vLLM's own pooling loop (LLM._run_tiling_engine) keeps twice max_num_seqs in the
        # engine: "can already saturate the core"
        return 2 * llm_engine.vllm_config.scheduler_config.max_num_seqs

    def _queue(self, batch: Batch) -> None:
        tokens = sum(len(r.prompt_token_ids) for r in batch.requests)
        self.requests_seen += len(batch.requests)
        self.cap_seen += tokens
        if self.busy_since is None:
            self.busy_since = time.monotonic()
        for index in range(len(batch.requests)):
            self.waiting.push(batch, index, self.steps, steps=0)

    def _add(self, batch: Batch, index: int) -> None:
        engine, request = self.engine, batch.requests[index]
        request_id = f"overnight-{next(self.counter)}"
        try:  # one vLLM refuses (too long, a dimension it has not) is this row's error
            prompt = engine.vllm.inputs.TokensPrompt(
                prompt_token_ids=list(request.prompt_token_ids))
            engine.llm.llm_engine.add_request(request_id, prompt,
                                              engine._pooling_params(request))
        except engine.request_errors as exc:
            batch.set(index, PoolingResult(None, error=_one_line(exc)))
            self._count(len(request.prompt_token_ids))
            return
        self.pending[request_id] = (batch, index)

    def _finish(self, batch: Batch, index: int, out) -> None:
        batch.set(index, PoolingResult(out.outputs.data.tolist()))
        self._count(len(batch.requests[index].prompt_token_ids))

    def _count(self, tokens: int) -> None:
        self.requests_done += 1
        self.tokens_finished += tokens
        self.cap_finished += tokens

    def _count_live(self, llm_engine) -> None:
        self.tokens_live = self.tokens_finished  # nothing is ever half done
