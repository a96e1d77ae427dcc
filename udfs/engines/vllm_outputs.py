"""What comes back from vLLM: a finished request's output as the engine interface's
``GenerationResult``, its logprobs, and a thinking model's output split by vLLM's own parser."""

from __future__ import annotations

import dataclasses

from udfs.engines.engine import GenerationResult, token_logprob


def result(out, top: int | None = None, reasoning: Reasoning | None = None,
            chat_template_kwargs: dict | None = None) -> GenerationResult:
    completion = out.outputs[0]
    result = GenerationResult(
        text=completion.text,
        finish_reason=completion.finish_reason,
        completion_tokens=len(completion.token_ids),
        logprobs=None if top is None else _logprobs(completion, top),
        prompt_tokens=(len(out.prompt_token_ids) if out.prompt_token_ids is not None
                       else None),
        cached_tokens=getattr(out, "num_cached_tokens", None),
    )
    return result if reasoning is None else reasoning.split(
        result, out.prompt_token_ids, completion, chat_template_kwargs)


class Reasoning:
    """A thinking model's output split into its thinking and its answer by vLLM's own parser,
    as vLLM's server and ``run_batch --reasoning-parser`` split it: the same parser class
    (``ParserManager.get_parser``), built per request with the chat template's switches its
    prompt was rendered with (the job's, or a step's own), told the prompt's token ids, and
    its ``parse`` and ``count_reasoning_tokens`` on the output."""

    def __init__(self, llm, name: str, chat_template_kwargs: dict | None):
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer = llm.get_tokenizer()
        self.model_config = llm.llm_engine.model_config
        self.chat_template_kwargs = chat_template_kwargs
        self.parser_cls = ParserManager.get_parser(
            reasoning_parser_name=name, model_name=self.model_config.model,
            is_harmony=self.model_config.hf_config.model_type == "gpt_oss",
            tokenizer=self.tokenizer)
        # what the parser reads of a request: its template switches; reasoning included
        self.request = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}], model=self.model_config.model,
            chat_template_kwargs=chat_template_kwargs)
        parser = self.parser_cls(self.tokenizer, None, model_config=self.model_config,
                                 chat_template_kwargs=chat_template_kwargs).reasoning_parser
        self.start_token_id, self.end_token_id = (_marker(parser, which)
                                                  for which in ("start", "end"))

    def split(self, result: GenerationResult, prompt_token_ids, completion,
              chat_template_kwargs: dict | None = None) -> GenerationResult:
        kwargs = self.chat_template_kwargs if chat_template_kwargs is None \
            else chat_template_kwargs
        parser = self.parser_cls(self.tokenizer, None, model_config=self.model_config,
                                 chat_template_kwargs=kwargs)
        if prompt_token_ids is not None:
            parser.set_prompt_token_ids(prompt_token_ids)
        token_ids = list(completion.token_ids)
        same = (kwargs or {}) == (self.chat_template_kwargs or {})
        request = self.request if same else \
            self.request.model_copy(update={"chat_template_kwargs": kwargs})
        reasoning, content, _ = parser.parse(result.text, request,
                                             enable_auto_tools=False,
                                             model_output_token_ids=token_ids)
        closed = self.end_token_id is not None and self.end_token_id in token_ids
        start = (token_ids.index(self.end_token_id) + 1 if closed
                 else len(token_ids) if content is None else 0)
        counted = parser.count_reasoning_tokens(token_ids)
        if reasoning and self.end_token_id is not None:
            # vLLM counts the tokens between a <think> and a </think> of the output only:
            # where the chat template opened the thinking in the prompt (DeepSeek-R1's,
            # this project's tiny thinking model) it counts none. The thinking's tokens are
            # those before the end of the thinking, less the markers.
            marks = (self.start_token_id, self.end_token_id)
            counted = max(counted, sum(1 for token in token_ids[:start - 1 if closed else start]
                                       if token not in marks))
        return dataclasses.replace(result, text=content, reasoning=reasoning,
                                   reasoning_tokens=counted, answer_start=start)


def _marker(parser, which: str) -> int | None:
    """The token id that starts or ends the thinking, for a parser that has one: a thinking
    parser's own (``end_token_id``), or its parser engine's (Qwen3's)."""
    engine = getattr(parser, "_parser_engine", None)
    for owner, name in ((parser, f"{which}_token_id"),
                        (engine, f"_reasoning_{which}_token_id")):
        value = getattr(owner, name, None)
        if isinstance(value, int):
            return value
    return None


def _logprobs(completion, top: int) -> list[dict]:
    """vLLM's per-token logprobs (a dict per position: the sampled token and the ``top``
    most likely, each with its rank) as the engine interface's entries. These are vLLM's
    default, raw logprobs: before temperature and penalties, but under structured output
    after the grammar's mask, so a token the grammar forbids has -inf and the allowed
    ones share all the probability."""
    entries = []
    for token_id, position in zip(completion.token_ids, completion.logprobs or ()):
        chosen = position[token_id]
        best = sorted((lp for lp in position.items() if lp[1].rank <= top),
                      key=lambda lp: lp[1].rank)[:top]
        entries.append(token_logprob(
            chosen.decoded_token, token_id, chosen.logprob,
            [token_logprob(lp.decoded_token, tid, lp.logprob) for tid, lp in best]))
    return entries
