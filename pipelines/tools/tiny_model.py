"""Build a tiny random-weight Llama model with a locally trained tokenizer and chat template.

No model hub is needed: the tokenizer is trained on generated text and the weights are random,
seeded, so the same command always builds the same model. Its output is gibberish, but it runs
through the real engine (and in float32 matches HF transformers token for token), which is what
the demo, the tests and the benchmarks need.

With ``labels`` it is a sequence classifier instead (``LlamaForSequenceClassification``, its
``id2label`` the labels): vLLM runs it as a pooling model for ``task: classify``, and with one
label as a cross-encoder for ``task: score``. The causal LM itself serves ``task: embed``
(vLLM's ``runner="pooling"`` turns it into an embedding model).

``build_tiny_vision_model`` builds a vision-language one (Idefics3, images in chat content
lists), the same way: local tokenizer, seeded random weights.
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

# ``tools=True``: a tool-calling model's markers and template, shaped as Hermes-style models
# (Qwen2.5, Hermes 2 Pro) have them, so vLLM's ``hermes`` tool parser reads its calls. The
# markers are added tokens, not special ones (as THINK_TOKENS): one token each, so a job can
# bias them, and kept in the decoded text whatever skip_special_tokens says.
TOOL_TOKENS = ["<tool_call>", "</tool_call>", "<tool_response>", "</tool_response>"]
# A whole call as one more added token: a random model never writes valid call JSON by itself;
# a request that gives this token a logit bias (``logit_bias: {id: 100}``) makes greedy
# decoding emit it, a call the parser reads (name "lookup", arguments {"q": "x"}). The bias
# holds at every step, so the call repeats until max_tokens: one token is one call.
CANNED_TOOL_CALL = '<tool_call>\n{"name": "lookup", "arguments": {"q": "x"}}\n</tool_call>'
# The tools, as a system block (after the conversation's own system message, merged into one);
# an assistant's calls in hermes' markers, each call's arguments through ``tojson`` (vLLM's chat
# path hands the template a dict, parsed from the request's JSON string); a tool message's
# result as a turn of its own; every other message as CHAT_TEMPLATE renders it.
TOOLS_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set ns = namespace(system='', rest=messages) %}"
    "{% if messages and messages[0]['role'] == 'system' %}"
    "{% set ns.system = messages[0]['content'] %}{% set ns.rest = messages[1:] %}{% endif %}"
    "{% if tools %}"
    "<|system|>\n{% if ns.system %}{{ ns.system }}\n\n{% endif %}"
    "You may call these functions:\n<tools>\n"
    "{% for tool in tools %}{{ tool | tojson }}\n{% endfor %}</tools><|end|>\n"
    "{% elif messages and messages[0]['role'] == 'system' %}"
    "<|system|>\n{{ ns.system }}<|end|>\n"
    "{% endif %}"
    "{% for message in ns.rest %}"
    "{% if message['role'] == 'assistant' and message['tool_calls'] %}"
    "<|assistant|>\n{{ message['content'] or '' }}"
    "{% for tc in message['tool_calls'] %}"
    "<tool_call>\n{\"name\": \"{{ tc['function']['name'] }}\", "
    "\"arguments\": {{ tc['function']['arguments'] | tojson }}}\n</tool_call>"
    "{% endfor %}<|end|>\n"
    "{% elif message['role'] == 'tool' %}"
    "<|tool|>\n<tool_response>\n{{ message['content'] }}\n</tool_response><|end|>\n"
    "{% else %}"
    "<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
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
                     reasoning: bool = False, tools: bool = False) -> Path:
    """Write a tokenizer and a random-weight LlamaForCausalLM (float32) to ``out_dir``; with
    ``labels``, a LlamaForSequenceClassification with one output per label; with
    ``reasoning``, a thinking model (``<think>``/``</think>`` tokens and a template that opens
    the thinking; a random model rarely closes it by itself: a job gives ``</think>`` a logit
    bias, ``sampling.logit_bias``, to make it); with ``tools``, a tool-calling model for vLLM's
    ``hermes`` parser (TOOL_TOKENS, TOOLS_CHAT_TEMPLATE, and CANNED_TOOL_CALL as one token
    for a request to bias). ``reasoning`` and ``tools`` do not combine."""
    if reasoning and tools:
        raise ValueError("a tiny model is built with reasoning or with tools, not both")
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM, LlamaForSequenceClassification

    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _tokenizer(seed, reasoning, tools)
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


def _tokenizer(seed: int, reasoning: bool, tools: bool):
    """The tiny model's tokenizer: a byte-level BPE trained on a seeded corpus, with a
    thinking model's or a tool-calling model's tokens added, and its chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

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
    if tools:
        # not special, for the same reason, and hermes matches its markers as text
        tokenizer.add_tokens(TOOL_TOKENS + [CANNED_TOOL_CALL], special_tokens=False)
    tokenizer.chat_template = (THINKING_CHAT_TEMPLATE if reasoning
                               else TOOLS_CHAT_TEMPLATE if tools else CHAT_TEMPLATE)
    return tokenizer


# A tiny vision-language model: Idefics3 (a SigLIP-style vision tower, a pixel-shuffle
# connector and a Llama text model). Of vLLM 0.32's image models it is the one that runs here:
# its image processor is PIL and numpy, no torchvision (the others import torchvision, whose
# registry builds are CUDA ones that break ``import vllm`` on a CPU machine).
# The image tokens as Idefics3's processor names them; the 36 ``<row_i_col_j>`` tags mark the
# tiles when image splitting is on.
VISION_TOKENS = (["<fake_token_around_image>", "<image>", "<global-img>", "<end_of_utterance>"]
                 + [f"<row_{i}_col_{j}>" for i in range(1, 7) for j in range(1, 7)])
# Idefics3's own template, shaped for OpenAI-style content lists ({"type": "image"} and
# {"type": "text", "text": ...} parts), with plain string content accepted too. vLLM's chat
# path sees the loop over the content and passes the parts, each image as {"type": "image"};
# the processor then expands each ``<image>`` into the image's tokens.
VISION_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ message['role'] | capitalize }}"
    "{% if message['content'] is string %}: {{ message['content'] }}"
    "{% else %}"
    "{% if message['content'][0]['type'] == 'image' %}:{% else %}: {% endif %}"
    "{% for part in message['content'] %}"
    "{% if part['type'] == 'text' %}{{ part['text'] }}"
    "{% elif part['type'] == 'image' %}<image>{% endif %}"
    "{% endfor %}{% endif %}"
    "<end_of_utterance>\n"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
# The same model's prompt as a template that takes a message's content as one string (many
# models' templates do): vLLM's chat path sees no loop over the content and hands it the text
# with each image's placeholder (``<image>``) in it. Concatenated with ``+``, as such templates
# often are, a list of parts would stop it ("can only concatenate str (not "list") to str").
VISION_STRING_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% for message in messages %}"
    "{{ (message['role'] | capitalize) + ': ' + message['content'] + '<end_of_utterance>\n' }}"
    "{% endfor %}"
    "{% if add_generation_prompt %}Assistant:{% endif %}"
)
VISION_TILE = 32    # px: the vision tower's image size (a tile, and the whole image unsplit)
VISION_PATCH = 8    # px: (32 / 8)^2 = 16 patches, pixel-shuffled by 2 into 4 tokens an image


def build_tiny_vision_model(out_dir: str | Path, seed: int = 0) -> str:
    """Write a tokenizer, an ``Idefics3Processor`` and a random-weight
    Idefics3ForConditionalGeneration (float32) to ``out_dir``; return the directory.

    Image splitting is off: every image, whatever its size, is resized to one 32 px square and
    costs 7 prompt tokens (``<fake_token_around_image><global-img>`` + 4 ``<image>`` +
    ``<fake_token_around_image>``). A request can turn it on (vLLM's ``mm_processor_kwargs``
    ``{"do_image_splitting": true}``): up to 4 x 4 tiles of 32 px, the image first resized to a
    128 px longest edge."""
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = _vision_tokenizer(seed)
    scale_factor = 2
    processor = _vision_processor(tokenizer, scale_factor)
    processor.save_pretrained(out)  # the tokenizer too, with its chat template
    tokenizer.save_pretrained(out)
    model = _random_vision_model(_vision_config(tokenizer, scale_factor), seed)
    model.save_pretrained(out, safe_serialization=True)
    return str(out)


def _vision_tokenizer(seed: int):
    """A byte-level BPE trained on the word corpus, with the Idefics3 image tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
    from transformers import PreTrainedTokenizerFast

    bpe = Tokenizer(models.BPE(unk_token=None))
    bpe.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    bpe.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=2048,
        special_tokens=["<s>", "</s>", "<pad>"] + VISION_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    bpe.train_from_iterator(_corpus(4000, seed) + ["User: Assistant: User:"] * 50,
                            trainer=trainer)
    tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=bpe, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
        extra_special_tokens=VISION_TOKENS, model_max_length=2048,
    )
    tokenizer.chat_template = VISION_CHAT_TEMPLATE
    return tokenizer


def _vision_processor(tokenizer, scale_factor: int):
    """The processor: one 32 px image unsplit, up to 4 x 4 tiles when a request splits."""
    from transformers import Idefics3ImageProcessorPil, Idefics3Processor

    image_processor = Idefics3ImageProcessorPil(
        do_image_splitting=False,
        size={"longest_edge": 4 * VISION_TILE},
        max_image_size={"longest_edge": VISION_TILE},
    )
    image_seq_len = (VISION_TILE // VISION_PATCH) ** 2 // scale_factor ** 2
    return Idefics3Processor(image_processor=image_processor, tokenizer=tokenizer,
                             image_seq_len=image_seq_len, chat_template=VISION_CHAT_TEMPLATE)


def _vision_config(tokenizer, scale_factor: int):
    """A two-layer Llama text tower and a one-layer vision tower."""
    from transformers import Idefics3Config, LlamaConfig

    # head_dim 32 in both towers: vLLM's CPU attention refuses a head size under 32
    text_config = LlamaConfig(
        vocab_size=len(tokenizer), max_position_embeddings=2048,
        hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, head_dim=32, rms_norm_eps=1e-5,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, tie_word_embeddings=False,
    )
    return Idefics3Config(
        vision_config=dict(hidden_size=64, intermediate_size=128, num_hidden_layers=1,
                           num_attention_heads=2, image_size=VISION_TILE,
                           patch_size=VISION_PATCH),
        text_config=text_config,
        image_token_id=tokenizer.convert_tokens_to_ids("<image>"),
        scale_factor=scale_factor,
        pad_token_id=tokenizer.pad_token_id,
        tie_word_embeddings=False,
        torch_dtype="float32",
    )


def _random_vision_model(config, seed: int):
    """Random float32 weights from ``seed``."""
    import torch
    from transformers import Idefics3ForConditionalGeneration

    torch.manual_seed(seed)
    model = Idefics3ForConditionalGeneration(config)
    with torch.no_grad():
        # as in build_tiny_model: spread-out logits, no near-ties for greedy choices
        for param in model.parameters():
            if param.dim() > 1:
                param.mul_(4.0)
    return model.to(torch.float32)


def with_chat_template(model_dir: str | Path, out_dir: str | Path, template: str) -> str:
    """A copy of a model with another chat template (its tokenizer's and processor's,
    ``chat_template.jinja``), its weights linked, not copied: a template variant in
    moments, without building the model again."""
    import shutil

    src, out = Path(model_dir), Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    for item in src.iterdir():
        if item.suffix == ".safetensors":
            (out / item.name).symlink_to(item.resolve())
        elif item.name != "chat_template.jinja":
            shutil.copy2(item, out / item.name)
    (out / "chat_template.jinja").write_text(template, encoding="utf-8")
    return str(out)
