"""Prompts from a column of chat messages, rendered as vLLM's own chat path renders them."""

from __future__ import annotations

import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind
from udfs.prompts import PromptRenderer, RenderSpec


def test_messages_column_renders_like_vllm_chat(tiny_model, llm):
    import vllm

    conversations = [
        [{"role": "user", "content": "Name a lamp."}],
        [{"role": "system", "content": "Be terse."}, {"role": "user", "content": "Hi 🙂"},
         {"role": "assistant", "content": "Hello."}, {"role": "user", "content": "{{ x }}"}],
    ]
    renderer = PromptRenderer(RenderSpec(template=None, tokenizer=tiny_model,
                                         max_model_len=512, max_tokens=8,
                                         messages_column="messages", system="Be brief."))
    table = pa.table({"messages": conversations + [[{"role": "user"}]]})
    out = renderer(table)
    ids = out.column(columns.PROMPT_TOKEN_IDS).to_pylist()
    reference = llm.chat([[{"role": "system", "content": "Be brief."}, *conversations[0]],
                          conversations[1]],
                         vllm.SamplingParams(max_tokens=1), use_tqdm=False)
    assert ids[:2] == [r.prompt_token_ids for r in reference]
    assert out.column(columns.ERROR_KIND).to_pylist() == [None, None, ErrorKind.RENDER]
    assert "not a {role, content} message" in out.column(columns.ERROR).to_pylist()[2]
