"""Build a tiny random-weight Llama model with a locally trained tokenizer and chat template.

No model hub is needed: the tokenizer is trained on generated text and the weights are random,
seeded, so the same command always builds the same model. Its output is gibberish, but it runs
through the real engine (and in float32 matches HF transformers token for token), which is what
the demo, the tests and the benchmarks need.

With ``labels`` it is a sequence classifier instead (``LlamaForSequenceClassification``, its
``id2label`` the labels): vLLM runs it as a pooling model for ``task: classify``, and with one
label as a cross-encoder for ``task: score``. The causal LM itself serves ``task: embed``
(vLLM's ``runner="pooling"`` turns it into an embedding model).
"""

from __future__ import annotations

import json
import random
from pathlib import Path

CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
SPECIAL_TOKENS = ["<s>", "</s>", "<pad>", "<|system|>", "<|user|>", "<|assistant|>", "<|end|>"]
# ``reasoning=True``: a thinking model's tokens and template, as Qwen3's and DeepSeek-R1's are
# shaped. The template opens the thinking after the assistant's tag; ``enable_thinking: false``
# (a chat template switch, passed as vLLM's chat path passes it) writes an empty thinking
# instead, so the model answers at once.
THINK_TOKENS = ["<think>", "</think>"]
THINKING_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n"
    "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n"
    "{% else %}<think>\n{% endif %}{% endif %}"
)

# Sizes: "tiny" for tests and the demo (starts in seconds), "bench" for benchmarks, large
# enough that the engine, not Ray, dominates a CPU run.
SIZES = {
    "tiny": dict(hidden_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2, intermediate_size=256),
    "bench": dict(hidden_size=512, num_hidden_layers=6, num_attention_heads=8,
                  num_key_value_heads=4, intermediate_size=1024),
}
_WORDS = (
    "the a product lamp chair table shirt shoe phone cable bag bottle soft bright warm cool "
    "steel wood cotton wool glass leather red blue green black white small large light heavy "
    "fast slow quiet new classic modern simple elegant durable cheap premium for with and of "
    "rewrite describe title description price review great bad good question answer topic "
    "summary category score json true false null café naïve über façade 東京 中文 emoji 🙂 👍 "
    "مرحبا שלום привет ☕ 0 1 2 3 4 5 6 7 8 9 { } [ ] : , \" . ! ?"
).split()


def _corpus(n_lines: int, seed: int) -> list[str]:
    rng = random.Random(seed)
    lines = []
    for _ in range(n_lines):
        words = rng.choices(_WORDS, k=rng.randint(4, 24))
        lines.append(" ".join(words))
    lines.append(json.dumps({"title": "x", "score": 1, "ok": True, "tags": ["a", "b"]}))
    return lines


def build_tiny_model(out_dir: str | Path, size: str = "tiny", seed: int = 0,
                     labels: list[str] | tuple[str, ...] | None = None,
                     reasoning: bool = False) -> Path:
    """Write a tokenizer and a random-weight LlamaForCausalLM (float32) to ``out_dir``; with
    ``labels``, a LlamaForSequenceClassification with one output per label; with
    ``reasoning``, a thinking model (``<think>``/``</think>`` tokens and a template that opens
    the thinking; a random model rarely closes it by itself: a job gives ``</think>`` a logit
    bias, ``sampling.logit_bias``, to make it)."""
    import torch
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import (LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification,
                              PreTrainedTokenizerFast)

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(4000, seed), trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        model_max_length=2048,
    )
    if reasoning:
        # added, not special, as a thinking model's tokenizer has them: the decoded text keeps
        # them (vLLM skips special tokens when it decodes), for the reasoning parser to find
        tokenizer.add_tokens(THINK_TOKENS, special_tokens=False)
    tokenizer.chat_template = THINKING_CHAT_TEMPLATE if reasoning else CHAT_TEMPLATE
    tokenizer.save_pretrained(out)

    config = LlamaConfig(
        vocab_size=len(tokenizer),
        max_position_embeddings=2048,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
        **SIZES[size],
        **({"num_labels": len(labels), "id2label": dict(enumerate(labels)),
            "label2id": {label: i for i, label in enumerate(labels)}} if labels else {}),
    )
    torch.manual_seed(seed)
    model = (LlamaForSequenceClassification if labels else LlamaForCausalLM)(config)
    with torch.no_grad():
        # Scaled-up weights make the logits spread out, so greedy choices are not near-ties
        # that float rounding could flip between implementations.
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    model.to(torch.float32).save_pretrained(out, safe_serialization=True)
    return out
