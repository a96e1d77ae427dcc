"""Images in, text out (prompt.images) through real jobs: vLLM on CPU with a tiny random-weight
Idefics3 model built here (``overnight tiny-model --vision``). The proof that the images reach
the model as they should is parity, row for row, with bare vLLM's ``LLM.chat`` given the same
images as ``data:`` URLs: the same texts and the same prompt tokens (each image's tokens
counted). Bad images are their rows' ``image_error``; pre-flight refuses a job that cannot take
images, in one line."""

from __future__ import annotations

import base64
import io
import json
import os
import signal
import subprocess
import sys

import polars as pl
import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from pipelines import load_config, run_job
from pipelines.errors import ConfigError, InputError
from pipelines.plan.preflight import plan_job

from conftest import KV_CACHE, cli, job_config

MAX_TOKENS = 8
TEMPLATE = "Describe {{ title }}."


def _image(size, mode, color, fmt: str) -> bytes:
    from PIL import Image

    image = Image.new(mode, size, color)
    for x in range(0, size[0], 7):  # a pattern, so images of one size still differ
        image.putpixel((x, (x * 3) % size[1]), 0 if mode in ("L", "P") else
                       (255,) * len(mode))
    out = io.BytesIO()
    image.save(out, fmt)
    return out.getvalue()


# Formats, modes and sizes: PNG with transparency, palette and grey, JPEG, WebP
IMAGES = {
    "red.png": _image((40, 30), "RGBA", (200, 10, 10, 128), "PNG"),
    "blue.jpg": _image((64, 64), "RGB", (10, 10, 200), "JPEG"),
    "green.webp": _image((100, 50), "RGB", (10, 200, 10), "WEBP"),
    "grey.png": _image((33, 47), "L", 90, "PNG"),
    "palette.png": _image((20, 80), "P", 3, "PNG"),
}


def data_url(name: str) -> str:
    mime = {"png": "image/png", "jpg": "image/jpeg", "webp": "image/webp"}[name.split(".")[-1]]
    return f"data:{mime};base64,{base64.b64encode(IMAGES[name]).decode()}"


@pytest.fixture(scope="session")
def vision_model(tmp_path_factory) -> str:
    from pipelines.tools.tiny_model import build_tiny_vision_model

    return str(build_tiny_vision_model(tmp_path_factory.mktemp("vision") / "model"))


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    root = tmp_path_factory.mktemp("photos")
    (root / "img").mkdir()
    for name, data in IMAGES.items():
        (root / "img" / name).write_bytes(data)
    return root


# Each row's photo (a path relative to the table's folder, an absolute path, or a data: URL)
# and its back (raw bytes, or null: on_null empty sends the prompt without it)
def parity_rows(folder) -> list[dict]:
    names = list(IMAGES)
    rows = []
    for i in range(12):
        name = names[i % len(names)]
        photo = (f"img/{name}", str(folder / "img" / name), data_url(name))[i % 3]
        back = IMAGES[names[(i + 2) % len(names)]] if i % 2 else None
        rows.append({"sku": f"P{i:02d}", "title": f"item {i}", "photo": photo, "back": back,
                     "photo_name": name,
                     "back_name": names[(i + 2) % len(names)] if i % 2 else None})
    return rows


def vision_config(model, input_path, output_path, **prompt) -> dict:
    return job_config(model, input_path, output_path,
                      input={"id_column": "sku"},
                      prompt={"system": None, "template": TEMPLATE, **prompt},
                      sampling={"temperature": 0.0, "max_tokens": MAX_TOKENS},
                      resources={"batch_size": 4})


@pytest.fixture(scope="module")
def parity_job(vision_model, folder, ray_cluster):
    rows = parity_rows(folder)
    pq.write_table(pa.Table.from_pylist(rows, pa.schema([
        ("sku", pa.string()), ("title", pa.string()), ("photo", pa.string()),
        ("back", pa.binary()), ("photo_name", pa.string()), ("back_name", pa.string())])),
        folder / "table.parquet")
    config = load_config(vision_config(vision_model, folder / "table.parquet", folder / "out",
                                       images=["photo", "back"], on_null="empty"))
    summary = run_job(config)
    return rows, pl.read_parquet(folder / "out"), summary


BARE = """
import gc, json, sys
from vllm import LLM, SamplingParams
job = json.load(open(sys.argv[1]))
out = {"runs": []}
llm = model = None
for run in job["runs"]:
    if run["model"] != model:
        del llm
        gc.collect()
        llm = LLM(model=run["model"], dtype="float32", max_model_len=512, enforce_eager=True,
                  kv_cache_memory_bytes=job["kv"], enable_chunked_prefill=False,
                  limit_mm_per_prompt={"image": 2})
        model = run["model"]
    else:  # the same model's engine again, as a new one starts: nothing of the last run kept
        llm.reset_prefix_cache()
        llm.reset_mm_cache()
    outs = llm.chat(run["conversations"],
                    SamplingParams(temperature=0, max_tokens=job["max_tokens"]))
    out["runs"].append([{"text": o.outputs[0].text, "prompt_tokens": len(o.prompt_token_ids)}
                        for o in outs])
if job.get("templates"):
    from vllm.renderers.hf import _detect_content_format
    out["formats"] = [_detect_content_format(t, default="string") for t in job["templates"]]
json.dump(out, open(sys.argv[2], "w"))
"""


def bare_chats(runs: list[tuple[str, list]], root, templates=()) -> dict:
    """Bare vLLM's LLM.chat on each (model, conversations), in one process of its own (one
    import of vLLM; runs of one model in a row share its engine, its caches emptied between
    them); with ``templates``, vLLM's own content format of each."""
    job = {"kv": KV_CACHE, "max_tokens": MAX_TOKENS, "templates": list(templates),
           "runs": [{"model": model, "conversations": conv} for model, conv in runs]}
    (root / "bare.json").write_text(json.dumps(job))
    run = subprocess.run([sys.executable, "-c", BARE, str(root / "bare.json"),
                          str(root / "bare_out.json")], capture_output=True, text=True,
                         timeout=900, env={**os.environ, "VLLM_ENABLE_V1_MULTIPROCESSING": "0"})
    assert run.returncode == 0, run.stderr[-2000:]
    return json.loads((root / "bare_out.json").read_text())


def conversation(title: str, *names: str) -> list[dict]:
    parts = [{"type": "image_url", "image_url": {"url": data_url(n)}} for n in names]
    return [{"role": "user", "content": [*parts, {"type": "text",
                                                   "text": TEMPLATE.replace("{{ title }}",
                                                                            title)}]}]


def check_conversation(row: dict, described: str) -> list[dict]:
    """The later step's prompt (below): the row's photo again and the first step's text."""
    return [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(row["photo_name"])}},
        {"type": "text", "text": f"Does it match? {described}"}]}]


# Templates whose content format vLLM's own detection and overnight's port must agree on:
# loops over a message's content (by key, by attribute, through a filter, a set variable, a
# macro's parameter, a variable named content), and templates that only print it
DETECTED = [
    "{% for m in messages %}{{ m['content'] }}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] %}{{ p['text'] }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m.content %}{{ p.text }}{% endfor %}{% endfor %}",
    "{% for m in messages %}{% for p in m['content'] | selectattr('type', 'equalto', 'text') %}"
    "{{ p.text }}{% endfor %}{% endfor %}",
    "{% set msgs = messages %}{% for m in msgs %}{% for p in m.content %}x{% endfor %}"
    "{% endfor %}",
    "{% macro show(c) %}{% for p in c %}{{ p.text }}{% endfor %}{% endmacro %}"
    "{% for m in messages %}{{ show(m['content']) }}{% endfor %}",
    "{% for m in messages %}{% set content = m['content'] %}{% for p in content %}x"
    "{% endfor %}{% endfor %}",
    "{% for m in messages[1:] %}{{ m['content'] | trim }}{% endfor %}",
    "{% for m in messages %}{% generation %}{{ m.content }}{% endgeneration %}{% endfor %}",
    "{% for m in messages %}{{ m['content'] }",  # does not parse
]


@pytest.fixture(scope="module")
def string_model(vision_model, tmp_path_factory) -> str:
    """The tiny vision model with a template that takes a message's content as one string."""
    from pipelines.tools.tiny_model import VISION_STRING_CHAT_TEMPLATE, with_chat_template

    return with_chat_template(vision_model, tmp_path_factory.mktemp("string") / "model",
                              VISION_STRING_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def string_job(string_model, parity_job, folder):
    """The parity job's table on the string-content model (it stopped the whole job)."""
    config = load_config(vision_config(string_model, folder / "table.parquet",
                                       folder / "string_out", images=["photo", "back"],
                                       on_null="empty"))
    run_job(config)
    return pl.read_parquet(folder / "string_out")


@pytest.fixture(scope="module")
def bare(parity_job, vision_model, string_model, folder) -> dict:
    """Bare LLM.chat on the parity rows, on both models; the later step's prompts on the
    parity job's texts (a job of steps' first step writes those, asserted where it is used);
    and vLLM's content formats of DETECTED and the models' templates: one process."""
    from pipelines.tools.tiny_model import VISION_CHAT_TEMPLATE, VISION_STRING_CHAT_TEMPLATE

    rows, out, _ = parity_job
    conversations = [conversation(r["title"], r["photo_name"],
                                  *([r["back_name"]] if r["back_name"] else [])) for r in rows]
    checks = [check_conversation(r, described) for r, described in zip(rows, out["rewritten"])]
    got = bare_chats([(vision_model, conversations), (vision_model, checks),
                      (string_model, conversations)], folder,
                     templates=[*DETECTED, VISION_CHAT_TEMPLATE, VISION_STRING_CHAT_TEMPLATE])
    return {"vision": got["runs"][0], "check": got["runs"][1], "string": got["runs"][2],
            "formats": got["formats"]}


def test_image_rows_equal_bare_vllm_chat_row_for_row(parity_job, bare):
    rows, out, summary = parity_job
    assert out["sku"].to_list() == [r["sku"] for r in rows]
    assert out["error"].null_count() == len(rows), out["error"].to_list()
    bare = bare["vision"]
    assert out["rewritten"].to_list() == [b["text"] for b in bare]
    assert out["prompt_tokens"].to_list() == [b["prompt_tokens"] for b in bare]
    # two images cost more prompt tokens than one, and the images change what is written
    one = [t for t, r in zip(out["prompt_tokens"], rows) if r["back"] is None]
    two = [t for t, r in zip(out["prompt_tokens"], rows) if r["back"] is not None]
    assert min(two) > max(one)
    assert len(set(out["rewritten"].to_list())) > 3
    assert summary.rows == len(rows)


# -- a template that takes a message's content as one string (issue #56, 11)

def test_a_string_content_template_gets_vllms_text_and_writes_what_llm_chat_writes(
        parity_job, string_job, bare):
    """vLLM's chat path hands a string-format template each message's text with an image's
    placeholder in it; it once got a list and stopped the job ("can only concatenate str (not
    list) to str"). Now row for row what LLM.chat writes on the same model, and not what the
    list-format template's prompt makes (its prompt is another text)."""
    rows, out, _ = parity_job
    assert string_job["error"].null_count() == len(rows), string_job["error"].to_list()
    assert string_job["rewritten"].to_list() == [b["text"] for b in bare["string"]]
    assert string_job["prompt_tokens"].to_list() == [b["prompt_tokens"] for b in bare["string"]]
    assert string_job["prompt_tokens"].to_list() != out["prompt_tokens"].to_list()
    assert string_job["image_count"].to_list() == out["image_count"].to_list()


def test_the_content_format_is_detected_as_vllm_detects_it(bare):
    from pipelines.tools.tiny_model import VISION_CHAT_TEMPLATE, VISION_STRING_CHAT_TEMPLATE
    from udfs.stages.chat_content import detect_content_format

    templates = [*DETECTED, VISION_CHAT_TEMPLATE, VISION_STRING_CHAT_TEMPLATE]
    assert [detect_content_format(t) for t in templates] == bare["formats"]
    assert bare["formats"][-2:] == ["openai", "string"]
    assert set(bare["formats"]) == {"openai", "string"}


def _renderer(model: str, **spec):
    from udfs.rows.images import ImageSpec
    from udfs.stages.prompts import PromptRenderer, RenderSpec

    return PromptRenderer(RenderSpec(**{
        "template": TEMPLATE, "tokenizer": model, "max_model_len": 512, "max_tokens": 8,
        "images": ImageSpec(columns=("photos",)), **spec}))


def _photos(*titles_and_counts) -> pa.Table:
    return pa.table({"title": [t for t, _ in titles_and_counts], "photos": pa.array(
        [[IMAGES["blue.jpg"]] * n for _, n in titles_and_counts], pa.list_(pa.binary()))})


def test_a_string_template_places_images_as_vllm_does_and_a_surplus_is_the_rows_error(
        string_model):
    """Each image's placeholder before the text, one a line; a text that holds the
    placeholder already keeps it where it stands (vLLM counts it); more placeholders than
    images is that row's image_error, the other rows rendered."""
    renderer = _renderer(string_model)
    assert renderer.content_format == "string"
    assert renderer.render_text({"title": "a lamp"}, 2) == (
        "<s>User: <image>\n<image>\nDescribe a lamp.<end_of_utterance>\nAssistant:")
    out = renderer(_photos(("a lamp", 2), ("the <image> here", 1), ("<image> <image>", 1)))
    kinds, errors = out.column("error_kind").to_pylist(), out.column("error").to_pylist()
    assert kinds[:2] == [None, None] and kinds[2] == "image_error", errors
    assert "more '<image>' placeholders than the message has images" in errors[2]
    assert renderer.render_text({"title": "the <image> here"}, 1) == (
        "<s>User: Describe the <image> here.<end_of_utterance>\nAssistant:")


def test_a_content_format_that_fails_every_row_is_refused_before_any_engine(
        string_model, folder):
    """prompt.chat_template_content_format: openai on the string-format template (the job as
    it was before): every row fails with one error, so pre-flight refuses in one line rather
    than start an engine; each row's own render_error where the renderer runs."""
    renderer = _renderer(string_model, chat_template_content_format="openai")
    out = renderer(_photos(("a", 1), ("b", 2)))
    assert out.column("error_kind").to_pylist() == ["render_error"] * 2
    assert "can only concatenate str" in out.column("error")[0].as_py()
    pq.write_table(pa.Table.from_pylist(parity_rows(folder)[:4]), folder / "four.parquet")
    config = load_config(vision_config(string_model, folder / "four.parquet", folder / "none",
                                       images=["photo", "back"], on_null="empty",
                                       chat_template_content_format="openai"))
    with pytest.raises(ConfigError) as refused:
        plan_job(config)
    assert str(refused.value).startswith(
        "prompt: each row tried (the first block's) fails to render the same way, e.g. row "
        "'P00': the model's chat template failed on this row: can only concatenate str")


def test_a_chat_template_that_fails_one_row_fails_that_row_alone(tiny_model, tmp_path):
    """Whatever the chat template raises for one row is that row's render_error; where it
    raises for every row alike (a system message it refuses) pre-flight says so, once."""
    from pipelines.tools.tiny_model import CHAT_TEMPLATE, with_chat_template
    from udfs.stages.prompts import PromptRenderer, RenderSpec

    picky = with_chat_template(tiny_model, tmp_path / "picky", (
        "{% for m in messages %}{% if m['role'] == 'system' %}"
        "{{ raise_exception('System role not supported') }}{% endif %}"
        "{% if 'boom' in m['content'] %}{{ m['content'] + 1 }}{% endif %}{% endfor %}"
        + CHAT_TEMPLATE))
    spec = RenderSpec(template="{{ title }}", tokenizer=picky, max_model_len=512, max_tokens=8)
    out = PromptRenderer(spec)(pa.table({"title": ["fine", "boom", "also fine"]}))
    assert out.column("error_kind").to_pylist() == [None, "render_error", None]
    assert out.column("error")[1].as_py().startswith(
        "the model's chat template failed on this row: ")
    pq.write_table(pa.table({"sku": ["a", "b", "c"], "title": ["x", "y", "z"]}),
                   tmp_path / "in.parquet")
    config = load_config(job_config(picky, tmp_path / "in.parquet", tmp_path / "out",
                                    input={"id_column": "sku"}, prompt={"template": "{{ title }}",
                                                                        "system": "Be brief."}))
    with pytest.raises(ConfigError, match=r"^prompt: each row tried .* e\.g\. row 'a': the "
                                          r"model's chat template failed on this row: System "
                                          r"role not supported$"):
        plan_job(config)


def test_the_output_and_the_report_count_the_images_and_their_tokens(parity_job, folder):
    from pipelines.report.report_text import report_lines
    from pipelines.report.run_report import load_report

    rows, out, _ = parity_job
    assert out.columns[-9:] == ["rewritten", "finish_reason", "prompt_tokens",
                                "completion_tokens", "image_count", "image_tokens",
                                "error_kind", "error", "request_key"]
    assert out["image_count"].to_list() == [1 + (r["back"] is not None) for r in rows]
    # the tiny model's image is 7 tokens (image splitting off), whatever its size
    assert out["image_tokens"].to_list() == [7 * n for n in out["image_count"]]
    report = load_report(str(folder / "out"))
    assert report["images"] == {"images": sum(out["image_count"]),
                                "image_tokens": sum(out["image_tokens"])}
    assert any(line.startswith("images ") for line in report_lines(report))


# -- bad images: the row's error, never the job's

def _truncated() -> bytes:
    return IMAGES["blue.jpg"][: len(IMAGES["blue.jpg"]) // 2]


def _bomb() -> bytes:
    return _image((1200, 1000), "L", 0, "PNG")  # 1.2 megapixels, over the job's cap of 1


BAD = {
    "missing": [{"bytes": None, "path": "img/nowhere.png"}],
    "truncated": [{"bytes": _truncated(), "path": None}],
    "not an image": [{"bytes": b"just some text, no image", "path": None}],
    "bomb": [{"bytes": _bomb(), "path": None}],
    "null": None,
    "bad data url": [{"bytes": None, "path": "data:image/png;base64,@@@"}],
    "url not allowed": [{"bytes": None, "path": "http://127.0.0.1:9/cat.png"}],
}
BAD_CAUSE = {"missing": "no such file", "truncated": "truncated or corrupt",
             "not an image": "not an image", "bomb": "over the cap of 1,000,000",
             "null": "is null in this row", "bad data url": "image",
             "url not allowed": "fetch_image_urls"}


@pytest.fixture(scope="module")
def bad_job(vision_model, folder, ray_cluster):
    good = [{"sku": f"G{i}", "title": f"good {i}",
             "photos": [{"bytes": IMAGES["blue.jpg"], "path": None}] if i % 2 else
             [{"bytes": None, "path": "img/red.png"}]} for i in range(4)]
    bad = [{"sku": f"B{i}", "title": case, "photos": value}
           for i, (case, value) in enumerate(BAD.items())]
    rows = good + bad + [{"sku": "T0", "title": "a <image> b",
                          "photos": [{"bytes": IMAGES["blue.jpg"], "path": None}]}]
    kind = pa.list_(pa.struct([("bytes", pa.binary()), ("path", pa.string())]))
    pq.write_table(pa.Table.from_pylist(rows, pa.schema([("sku", pa.string()),
                                                         ("title", pa.string()),
                                                         ("photos", kind)])),
                   folder / "bad.parquet")
    config = load_config(vision_config(vision_model, folder / "bad.parquet", folder / "bad_out",
                                       images=["photos"], max_image_pixels=1_000_000))
    run_job(config)
    return rows, pl.read_parquet(folder / "bad_out")


def test_each_bad_image_is_its_rows_image_error_and_the_others_are_generated(bad_job):
    rows, out = bad_job
    by_sku = {r["sku"]: r for r in out.to_dicts()}
    for row in rows:
        got = by_sku[row["sku"]]
        if row["sku"] == "T0":
            continue  # below
        if row["sku"].startswith("G"):
            assert got["error"] is None and got["completion_tokens"] > 0, got
            continue
        assert got["error_kind"] == "image_error", (row["title"], got)
        assert BAD_CAUSE[row["title"]] in got["error"], (row["title"], got["error"])
        assert "\n" not in got["error"] and got["rewritten"] is None


# -- pre-flight: one line, before any engine starts

def test_a_model_that_takes_no_images_is_refused_before_any_engine(tiny_model, folder):
    pq.write_table(pa.Table.from_pylist([{"sku": "a", "title": "x", "photo": "img/red.png"}]),
                   folder / "one.parquet")
    config = load_config(vision_config(tiny_model, folder / "one.parquet", folder / "none",
                                       images=["photo"]))
    with pytest.raises(ConfigError, match="takes no images"):
        plan_job(config)


def test_a_column_that_cannot_hold_an_image_is_refused(vision_model, folder):
    pq.write_table(pa.Table.from_pylist([{"sku": "a", "title": "x", "photo": 3}]),
                   folder / "ints.parquet")
    config = load_config(vision_config(vision_model, folder / "ints.parquet", folder / "none",
                                       images=["photo"]))
    with pytest.raises(InputError, match="'photo' is int64, which cannot hold an image"):
        plan_job(config)
    config = load_config(vision_config(vision_model, folder / "ints.parquet", folder / "none",
                                       images=["picture"]))
    with pytest.raises(InputError, match="'picture' is not a column"):
        plan_job(config)


def test_more_images_a_row_than_allowed_is_refused(vision_model, folder):
    pq.write_table(pa.Table.from_pylist([{"sku": "a", "title": "x",
                                          "photos": ["img/red.png", "img/blue.jpg"]}]),
                   folder / "two.parquet")
    config = load_config(vision_config(vision_model, folder / "two.parquet", folder / "none",
                                       images=["photos"], max_images=1))
    with pytest.raises(ConfigError, match="prompt.max_images is 1, and a row .* holds 2"):
        plan_job(config)


def test_a_text_holding_the_image_token_is_its_rows_image_error(bad_job):
    _, out = bad_job
    got = out.filter(pl.col("sku") == "T0").to_dicts()[0]
    assert got["error_kind"] == "image_error"
    assert "holds 2 image placeholders ('<image>') for 1 image" in got["error"]


# -- Batch files: chat bodies with image_url parts

def test_a_batch_file_with_image_url_parts_gives_the_table_jobs_texts(parity_job, vision_model,
                                                                      folder):
    from pipelines.batchfile.run import run_batch_file

    rows, out, _ = parity_job
    lines = [{"custom_id": r["sku"], "method": "POST", "url": "/v1/chat/completions",
              "body": {"model": "m", "max_tokens": MAX_TOKENS, "temperature": 0,
                       "messages": conversation(r["title"], r["photo_name"],
                                                *([r["back_name"]] if r["back_name"] else []))}}
             for r in rows]
    # detail is accepted, and changes nothing (as in vLLM)
    lines[0]["body"]["messages"][0]["content"][0]["image_url"]["detail"] = "low"
    # a path is never read on a request's word: that line's error
    lines.append({"custom_id": "path", "method": "POST", "url": "/v1/chat/completions",
                  "body": {"model": "m", "max_tokens": 4, "messages": [{"role": "user",
                           "content": [{"type": "image_url",
                                        "image_url": {"url": str(folder / "img/red.png")}},
                                       {"type": "text", "text": "x"}]}]}})
    requests = folder / "requests.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch_file(requests, folder / "results.jsonl", model=vision_model, overrides=[
        f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
        "model.max_model_len=512", "resources.batch_size=4"])
    results = {r["custom_id"]: r for r in map(json.loads, (folder / "results.jsonl")
                                               .read_text().splitlines())}
    texts = [results[r["sku"]]["response"]["body"]["choices"][0]["message"]["content"]
             for r in rows]
    assert texts == out["rewritten"].to_list()
    assert [results[r["sku"]]["response"]["body"]["usage"]["prompt_tokens"] for r in rows] \
        == out["prompt_tokens"].to_list()
    errors = [json.loads(line) for line in (folder / "results.errors.jsonl")
              .read_text().splitlines()]
    assert [e["custom_id"] for e in errors] == ["path"]
    assert "data: URL or an http(s) URL" in errors[0]["error"]["message"]


def test_a_message_batches_file_with_image_blocks_gives_the_table_jobs_texts(
        parity_job, vision_model, folder):
    """Anthropic's base64 image blocks, in a user turn, go to the model as the table's
    images do: the same texts."""
    from pipelines.batchfile.run import run_batch_file

    def block(part: dict) -> dict:
        if part["type"] == "text":
            return part
        media, data = part["image_url"]["url"].removeprefix("data:").split(";base64,")
        return {"type": "image", "source": {"type": "base64", "media_type": media,
                                            "data": data}}

    rows, out, _ = parity_job
    lines = []
    for r in rows:
        [message] = conversation(r["title"], r["photo_name"],
                                 *([r["back_name"]] if r["back_name"] else []))
        lines.append({"custom_id": r["sku"], "params": {
            "model": "m", "max_tokens": MAX_TOKENS, "temperature": 0, "messages": [
                {"role": "user", "content": [block(p) for p in message["content"]]}]}})
    requests = folder / "messages.jsonl"
    requests.write_text("".join(json.dumps(line) + "\n" for line in lines))
    run_batch_file(requests, folder / "messages-results.jsonl", model=vision_model,
                   overrides=[f"engine.kv_cache_memory_bytes={KV_CACHE}", "model.dtype=float32",
                              "model.max_model_len=512", "resources.batch_size=4"])
    results = {r["custom_id"]: r["result"] for r in map(json.loads, (
        folder / "messages-results.jsonl").read_text().splitlines())}
    assert [results[r["sku"]]["message"]["content"][0]["text"] for r in rows] == \
        out["rewritten"].to_list(), results


# -- a server as the engine: the images go to it as data: URLs

def test_a_server_as_the_engine_gets_each_rows_images_and_writes_the_same_texts(
        parity_job, vision_model, folder, ray_cluster):
    from servers import VLLMServer

    rows, out, _ = parity_job
    server = VLLMServer(vision_model, folder / "server.log", KV_CACHE)
    server.args += ["--limit-mm-per-prompt", '{"image": 2}']
    server.start()
    try:
        raw = vision_config(vision_model, folder / "table.parquet", folder / "http_out",
                            images=["photo", "back"], on_null="empty")
        raw["engine"] = {"kind": "http", "base_url": server.base_url, "endpoint": "chat"}
        run_job(load_config(raw))
    finally:
        server.kill()
    served = pl.read_parquet(folder / "http_out")
    assert served["error"].null_count() == len(rows), served["error"].to_list()
    assert served["rewritten"].to_list() == out["rewritten"].to_list()
    assert served["prompt_tokens"].to_list() == out["prompt_tokens"].to_list()


# -- a job of steps: a later step sees the earlier step's text, and the image again

def test_a_later_step_sees_the_earlier_steps_text_and_the_image_again(parity_job, vision_model,
                                                                       folder, bare):
    rows, out, _ = parity_job
    raw = vision_config(vision_model, folder / "table.parquet", folder / "steps_out")
    del raw["prompt"], raw["sampling"]
    raw["output"].pop("column")
    greedy = {"temperature": 0.0, "max_tokens": MAX_TOKENS}
    raw["steps"] = [
        {"name": "describe", "column": "described", "sampling": greedy,
         "prompt": {"images": ["photo", "back"], "on_null": "empty", "template": TEMPLATE}},
        {"name": "check", "column": "checked", "sampling": greedy,
         "prompt": {"images": ["photo"], "template": "Does it match? {{ described }}"}}]
    run_job(load_config(raw))
    steps = pl.read_parquet(folder / "steps_out")
    assert steps["error"].null_count() == len(rows), steps["error"].to_list()
    # the first step is the one-step job, row for row
    assert steps["described"].to_list() == out["rewritten"].to_list()
    # the second: bare LLM.chat on the photo again and the first step's text (the bare
    # fixture's check run, on the one-step job's texts: the first step's, as just asserted)
    bare = bare["check"]
    assert steps["checked"].to_list() == [b["text"] for b in bare]
    assert steps["checked_prompt_tokens"].to_list() == [b["prompt_tokens"] for b in bare]


def test_samples_logprobs_replicas_and_a_resume_work_with_images(parity_job, vision_model,
                                                                  folder, tmp_path, capsys):
    """The image job sampled (two seeded samples a row) with logprobs, on two replicas (each
    with its engine: the blocks go to whichever is free); the same job on one replica,
    SIGKILLed once a part is written and run again: the same output, row for row, each row's
    samples with their image counts, and a logprob a token."""
    import yaml
    from test_resume import kill_after_parts

    rows, _, _ = parity_job

    def config(out: str, replicas: int) -> dict:
        raw = vision_config(vision_model, folder / "table.parquet", tmp_path / out,
                            images=["photo", "back"], on_null="empty")
        raw["sampling"] = {"temperature": 0.8, "seed": 3, "n": 2, "max_tokens": MAX_TOKENS}
        raw["output"]["logprobs"] = 2
        raw["resources"] = {"batch_size": 4, "replicas": replicas}
        return raw

    run_job(load_config(config("two", 2)))
    path = tmp_path / "one.yaml"
    path.write_text(yaml.safe_dump(config("one", 1)))
    kill_after_parts(path, tmp_path / "one.partial", 1, signal.SIGKILL)
    assert not (tmp_path / "one").exists()  # killed before its commit
    code, stdout, stderr = cli("run", path, "--quiet", capsys=capsys)  # (in this process's Ray)
    assert code == 0, stderr
    assert "resumed:" in stdout
    out, one = pl.read_parquet(tmp_path / "two"), pl.read_parquet(tmp_path / "one")
    assert out.drop("logprobs").equals(one.drop("logprobs"))
    assert out.height == 2 * len(rows) and out["sample_index"].to_list()[:4] == [0, 1, 0, 1]
    assert out["error"].null_count() == out.height
    assert out["image_count"].to_list() == [1 + (r["back"] is not None) for r in rows
                                            for _ in range(2)]
    assert all(len(lp) == c for lp, c in zip(out["logprobs"].to_list(),
                                             out["completion_tokens"].to_list()))
    assert out["rewritten"].to_list() != out["rewritten"].shift(1).to_list()  # sampled apart
