"""Prompts from a column of chat messages, rendered as vLLM's own chat path renders them."""

from __future__ import annotations

import pyarrow as pa

from udfs import columns
from udfs.columns import ErrorKind
from udfs.stages.prompts import PromptRenderer, RenderSpec


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


def test_a_block_tokenized_in_one_call_equals_each_row_rendered_alone(tiny_model):
    """The renderer tokenizes a block's prompts in one call (the GIL released meanwhile):
    the same ids, lengths and errors as rendering each row by itself, for chat prompts,
    raw ones, rows too long, null fields and rows whose values break the template."""
    rows = [{"title": t, "description": d} for t, d in [
        ("Lamp", "A warm light 🙂"), ("Über café", "naïve — مرحبا — שלום"),
        ("Empty", ""), ("Null", None), ("Long", "word " * 600), ("{{ 7 * 7 }}", "{% raw %}"),
        ("Tabs\tand\nlines", "  spaced  "), ("Bad", "x")]]
    for chat in (True, False):
        renderer = PromptRenderer(RenderSpec(
            template="Title: {{ title }}\n{{ description }}{{ 1 // (title != 'Bad') }}",
            tokenizer=tiny_model, max_model_len=512, max_tokens=8, system="Be brief.",
            chat=chat, on_null="error"))
        out = renderer(pa.Table.from_pylist(rows))
        alone = [renderer.render_row(row) for row in rows]
        assert out.column(columns.PROMPT_TOKEN_IDS).to_pylist() == [a[0] for a in alone]
        assert out.column(columns.PROMPT_TOKENS).to_pylist() == [a[1] for a in alone]
        assert out.column(columns.ERROR_KIND).to_pylist() == [
            None, None, None, ErrorKind.NULL_FIELD, ErrorKind.PROMPT_TOO_LONG, None, None,
            ErrorKind.RENDER]
        assert out.column(columns.ERROR).to_pylist() == [a[4] for a in alone]
        plain = alone[0][0]  # and the ids are the tokenizer's own, row by row
        assert plain == renderer.tokenize(renderer.render_text(rows[0]), chat=chat)


def test_columns_whose_names_are_not_jinja_names_are_reached_through_row(tiny_model):
    """A column named "Product Name" (or "2nd-title") cannot be {{ Product Name }}; it is
    row["Product Name"], checked, null-checked and rendered like any other column."""
    renderer = PromptRenderer(RenderSpec(
        template='{{ row["Product Name"] }} | {{ row["2nd-title"] }} | {{ row.price }} | '
                 '{{ price }}', tokenizer=tiny_model, max_model_len=512, max_tokens=8,
        chat=False))
    assert renderer.variables == ["2nd-title", "Product Name", "price"]
    table = pa.table({"Product Name": ["Lamp", "Desk"], "2nd-title": ["warm", None],
                      "price": [3, 4], "unused": [None, None]})
    out = renderer(table)
    assert renderer.render_text(table.to_pylist()[0]) == "Lamp | warm | 3 | 3"
    assert out.column(columns.ERROR).to_pylist() == [
        None, "column '2nd-title' is null in this row"]


def test_row_is_only_ever_a_columns_name_away():
    from udfs.stages.templates import TemplateError, compile_template

    for source, needle in [("{{ row }}", "row is the whole row"),
                           ("{{ row | length }}", "row is the whole row"),
                           ("{{ row[name] }}", "in quotes")]:
        try:
            compile_template(source)
        except TemplateError as exc:
            assert needle in str(exc)
        else:
            raise AssertionError(f"{source} compiled")
    # a loop variable named row is the template's own, not the row
    assert compile_template("{% for row in rows %}{{ row }}{% endfor %}")[1] == ["rows"]


def test_pre_flights_template_only_renders_as_the_tokenizer_does(tiny_model, tmp_path):
    """Pre-flight renders sample rows through the chat template alone (udfs/stages/chat_content.py:
    TemplateOnly, transformers' Jinja environment without transformers): the same text as
    the tokenizer's own apply_chat_template, for the tiny model's template, a thinking
    template given its switch, and one with transformers' globals and filters."""
    from pipelines.tools.tiny_model import THINKING_CHAT_TEMPLATE, with_chat_template
    from udfs.stages.chat_content import TemplateOnly
    from udfs.stages.prompts import load_tokenizer

    messages = [{"role": "system", "content": "Be brief."},
                {"role": "user", "content": "Hi 🙂 {{ x }}"}]
    fancy = ("{% for m in messages %}{% if loop.first %}{{ bos_token }}{% endif %}"
             "{{ m | tojson }}{% if m['role'] == 'nobody' %}{{ raise_exception('no') }}"
             "{% endif %}{% endfor %}\n  {% if add_generation_prompt %}<|assistant|>{% endif %}")
    for template, kwargs in ((None, {}), (THINKING_CHAT_TEMPLATE, {"enable_thinking": False}),
                             (fancy, {})):
        model = tiny_model if template is None else with_chat_template(
            tiny_model, tmp_path / str(len(kwargs)) / str(len(template)), template)
        real = load_tokenizer(model).apply_chat_template(messages, tokenize=False,
                                                         add_generation_prompt=True, **kwargs)
        assert TemplateOnly(model).apply_chat_template(messages, **kwargs) == real


def _tokenizer_files(folder, config: dict, special_map: dict | None = None):
    """A model folder holding only the json files TemplateOnly reads."""
    import json

    folder.mkdir(parents=True)
    (folder / "tokenizer_config.json").write_text(json.dumps(config))
    if special_map is not None:
        (folder / "special_tokens_map.json").write_text(json.dumps(special_map))
    return str(folder)


BOS_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{{ bos_token + m['content'] }}"
                "{% endfor %}")


def test_template_only_reads_special_tokens_map_too(tmp_path):
    """transformers hands a chat template special_tokens_map.json's tokens too (a string, or
    {"content": ...}), over tokenizer_config.json's where the config has no
    added_tokens_decoder (an older layout)."""
    from udfs.stages.chat_content import TemplateOnly

    older = _tokenizer_files(tmp_path / "older", {"chat_template": BOS_TEMPLATE,
                                                  "eos_token": "</old>"},
                             {"bos_token": {"content": "<s>", "lstrip": False},
                              "eos_token": "</s>", "additional_special_tokens": ["<x>"]})
    template = TemplateOnly(older)
    assert template.special == {"bos_token": "<s>", "eos_token": "</s>"}
    assert template.apply_chat_template([{"role": "user", "content": "hi"}]) == "<s><s>hi"
    newer = _tokenizer_files(tmp_path / "newer", {
        "chat_template": BOS_TEMPLATE, "bos_token": "<|begin|>",
        "added_tokens_decoder": {"0": {"content": "<|begin|>", "special": True}}},
        {"bos_token": "<s>", "eos_token": "</s>"})
    assert TemplateOnly(newer).special == {"bos_token": "<|begin|>", "eos_token": "</s>"}


def test_rows_failing_on_an_undefined_name_are_not_refused_in_pre_flight(tmp_path):
    """A chat template reading a name pre-flight's environment lacks (a tokenizer class's
    default bos_token, known to transformers alone) fails every row here; the real tokenizer
    may render them all, so pre-flight refuses no job for it. A template's own error, alike on
    every row, is still refused."""
    from udfs.stages.prompts import rows_fail_alike

    table = pa.table({"sku": ["a", "b", "c"], "title": ["x", "y", "z"]})
    bare = _tokenizer_files(tmp_path / "bare", {"chat_template": BOS_TEMPLATE})
    spec = RenderSpec(template="{{ title }}", tokenizer=bare, max_model_len=512, max_tokens=8)
    assert rows_fail_alike(spec, table, "sku") is None
    picky = _tokenizer_files(tmp_path / "picky", {"chat_template": (
        "{% for m in messages %}{{ m['content'] + 1 }}{% endfor %}")})
    spec = RenderSpec(template="{{ title }}", tokenizer=picky, max_model_len=512, max_tokens=8)
    assert rows_fail_alike(spec, table, "sku").startswith(
        "row 'a': the model's chat template failed on this row: ")


def test_a_replica_loads_its_tokenizer_without_scikit_learn(tiny_model):
    """transformers imports scikit-learn wherever installed (here: the test extra brings it),
    for nothing a replica runs: a replica's tokenizer (its first import of transformers'
    models, so vLLM's after it imports none either) loads in a fresh process without it."""
    import subprocess
    import sys

    from conftest import REPO

    # (where scikit-learn is not installed, the same holds, trivially)
    probe = ("import sys; from udfs.stages.prompts import load_tokenizer; "
             f"tokenizer = load_tokenizer({tiny_model!r}); "
             "print(tokenizer('two words')['input_ids'] != [], 'sklearn' in sys.modules)")
    done = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                          cwd=REPO, timeout=300)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]
