"""Tool calls through vLLM's own parser, as its chat server runs them: a request's tools turned
into its constraint (``adjust_request``: a named or required choice held to the functions'
JSON Schemas), and a finished output parsed into its content and calls (``parse``)."""

from __future__ import annotations

import dataclasses

from udfs.engines.engine import GenerationResult
from udfs.rows.tool_calls import calls_expected, read_spec


class ToolCalling:
    """vLLM's parser for ``model.tool_parser`` (``ParserManager.get_parser`` with auto tools
    on, as ``vllm serve --enable-auto-tool-choice --tool-call-parser NAME`` builds it), and
    the request object it reads, built once per tool spec."""

    def __init__(self, llm, name: str):
        from vllm.parser.parser_manager import ParserManager

        self.tokenizer = llm.get_tokenizer()
        self.model_config = llm.llm_engine.model_config
        self.parser_cls = ParserManager.get_parser(
            tool_parser_name=name, enable_auto_tools=True, model_name=self.model_config.model,
            is_harmony=self.model_config.hf_config.model_type == "gpt_oss",
            tokenizer=self.tokenizer)
        self._requests: dict[str, object] = {}  # tool spec JSON -> its adjusted request

    def request(self, tools: str):
        """The chat request vLLM's parser reads for a tool spec, adjusted as the server
        adjusts it (its structured outputs and skip_special_tokens set); cached by spec."""
        found = self._requests.get(tools)
        if found is not None:
            return found
        from vllm.entrypoints.openai.chat_completion.protocol import ChatCompletionRequest

        spec = read_spec(tools)
        request = ChatCompletionRequest(
            messages=[{"role": "user", "content": ""}], model=self.model_config.model,
            tools=spec["tools"], tool_choice=spec["tool_choice"],
            parallel_tool_calls=spec["parallel_tool_calls"])
        if request.tool_choice != "none" or self.parser_cls.always_adjust_request:
            request = self._parser(request).adjust_request(request)
        if len(self._requests) > 1024:  # a Batch file's lines may each bring their own
            self._requests.clear()
        self._requests[tools] = request
        return request

    def _parser(self, request):
        return self.parser_cls(self.tokenizer, request.tools, model_config=self.model_config)

    def sampling_changes(self, tools: str) -> dict:
        """What the tools change in a request's SamplingParams: the constraint a named or
        required choice puts on decoding (structured_outputs), and whether special tokens
        stay in the text (a parser that reads its markers as such tokens)."""
        request = self.request(tools)
        changes = {"skip_special_tokens": request.skip_special_tokens}
        if request.structured_outputs is not None:
            changes["structured_outputs"] = request.structured_outputs
        return changes

    def parse(self, result: GenerationResult, tools: str, prompt_token_ids,
              token_ids) -> GenerationResult:
        """The output's content and calls, as the chat server's full response has them: the
        parser's ``parse``; only the first call where parallel_tool_calls is false."""
        if result.text is None:
            return dataclasses.replace(result, tool_calls=[])
        request = self.request(tools)
        parser = self._parser(request)  # a parser keeps state: one per output
        if prompt_token_ids is not None:
            parser.set_prompt_token_ids(prompt_token_ids)
        _, content, calls = parser.parse(result.text, request, enable_auto_tools=True,
                                         model_output_token_ids=list(token_ids))
        calls = list(calls or [])
        if request.parallel_tool_calls is False:
            calls = calls[:1]
        found = [{"id": call.id, "name": call.name, "arguments": call.arguments}
                 for call in calls]
        # "tool_calls" where calls were made: always for auto (as vLLM's server says), else
        # where the model stopped (a named call cut at max_tokens stays "length")
        finish = result.finish_reason
        if found and (finish == "stop" or request.tool_choice == "auto"):
            finish = "tool_calls"
        # a named or required choice that made no call: the text stays, for the row's error
        # to keep (the parser gives None for it)
        text = content if found or content is not None or not calls_expected(read_spec(tools)) \
            else result.text
        return dataclasses.replace(result, text=text, tool_calls=found, finish_reason=finish)
