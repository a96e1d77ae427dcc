"""The command line as a user meets it: one clear line and exit 2 for every mistake."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import REPO, job_config


def overnight(*args, cwd=REPO) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "pipelines.cli", *map(str, args)],
                          capture_output=True, text=True, cwd=cwd, timeout=300)


@pytest.fixture
def job_file(tiny_model, tmp_path):
    """A valid job over a small JSONL table; tests break one thing at a time."""
    rows = [{"sku": f"S{i}", "title": f"T{i}", "description": "d" * (i * 300)} for i in range(6)]
    rows[2]["description"] = None
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))

    def write(**sections) -> Path:
        config = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                            input={"id_column": "sku"})
        for name, value in sections.items():
            config[name] = {**config[name], **value}
        path = tmp_path / "job.yaml"
        path.write_text(yaml.safe_dump(config))
        return path

    return write


def assert_one_line_error(result, *needles):
    assert result.returncode == 2, result.stderr
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overnight: error: "), result.stderr
    for needle in needles:
        assert needle in lines[0]


def test_unknown_key(job_file):
    path = job_file(sampling={"max_tokenz": 3})
    assert_one_line_error(overnight("validate", path), "sampling.max_tokenz: unknown key")


def test_missing_template_column_lists_the_columns(job_file):
    path = job_file(prompt={"template": "{{ titel }}"})
    assert_one_line_error(overnight("run", path), "column 'titel'",
                          "its columns are: sku, title, description")


def test_template_that_does_not_parse(job_file):
    path = job_file(prompt={"template": "line one\n{{ title "})
    assert_one_line_error(overnight("validate", path),
                          "prompt.template does not parse (template line 2)")


def test_a_template_that_fails_on_every_row_stops_before_an_engine_starts(job_file):
    # the sandbox refuses the attribute on every row: the job's mistake, not the rows'
    path = job_file(prompt={"template": "{{ title.__class__ }}"})
    assert_one_line_error(overnight("run", path),
                          "prompt.template fails on each of the 6 rows tried",
                          "row 'S0': access to attribute '__class__'")


def test_validate_shows_what_fails_and_prompts_of_rows_that_render(job_file, tmp_path):
    # the first row's template fails (and the last row's is null): the rest still render
    rows = [{"sku": "A", "title": "x", "n": 0}, {"sku": "B", "title": "y", "n": 4},
            {"sku": "C", "title": "z", "n": None}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    result = overnight("validate", job_file(prompt={"template": "{{ title }} {{ 8 / n }}"}))
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    assert "row 'A': template failed on this row: division by zero" in result.stdout
    assert "row 'C': column 'n' is null" in result.stdout
    assert "y 2.0" in result.stdout.split("--- prompt 1 ---")[1]


def test_a_column_named_with_a_space_is_reached_through_row(job_file, tmp_path):
    rows = [{"sku": "A", "Product Name": "Desk lamp"}, {"sku": "B", "Product Name": "Mug"}]
    (tmp_path / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    path = job_file(prompt={"template": 'Name: {{ row["Product Name"] }}'})
    result = overnight("validate", path)
    assert result.returncode == 0, result.stderr
    assert "Name: Desk lamp" in result.stdout.split("--- prompt 1 ---")[1]
    assert_one_line_error(
        overnight("validate", job_file(prompt={"template": '{{ row["Product name"] }}'})),
        "prompt.template uses column 'Product name'", "its columns are: sku, Product Name")


def test_duplicate_ids_are_named(job_file, tmp_path):
    (tmp_path / "in.jsonl").write_text('{"sku": "A", "title": "x", "description": "y"}\n' * 3)
    assert_one_line_error(overnight("validate", job_file()),
                          "input.id_column 'sku' is not unique", "'A'")


def test_missing_id_column(job_file):
    path = job_file(input={"id_column": "code"})
    assert_one_line_error(overnight("validate", path), "input.id_column 'code'")


def test_malformed_jsonl_names_file_and_line(job_file, tmp_path):
    with open(tmp_path / "in.jsonl", "a") as handle:
        handle.write('{"sku": "Z", "title": \n')
    assert_one_line_error(overnight("run", job_file()), f"{tmp_path / 'in.jsonl'}:7")


def test_missing_model(job_file, tmp_path):
    path = job_file(model={"name": str(tmp_path / "no-model")})
    assert_one_line_error(overnight("validate", path), "model.name", "cannot load")


def test_run_checks_a_local_model_without_importing_torch(job_file):
    # pre-flight reads a local model's tokenizer and context length from its files (the
    # tokenizers library alone): transformers' AutoTokenizer would import torch in the driver
    path = job_file(model={"max_model_len": None})
    probe = ("import sys; from pipelines.config import load_config; "
             "from pipelines.plan.preflight import plan_job; "
             f"plan = plan_job(load_config({str(path)!r})); "
             "print(plan.render.max_model_len, 'torch' in sys.modules, "
             "'transformers' in sys.modules)")
    result = subprocess.run([sys.executable, "-c", probe], capture_output=True, text=True,
                            cwd=REPO, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["2048", "False", "False"]


def test_a_local_models_length_is_what_transformers_reads(tiny_model):
    from pipelines.plan.model import _local_model, resolve_max_model_len

    models = [tiny_model] + [str(m) for m in [REPO / "models" / "smollm2"]
                             if (m / "config.json").is_file()]
    for name in models:
        assert _local_model(name).max_position_embeddings == resolve_max_model_len(name)


def test_a_broken_local_tokenizer_is_named(job_file, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "tokenizer.json").write_text('{"model": ')
    path = job_file(model={"name": str(model)})
    assert_one_line_error(overnight("run", path), "model.name", "cannot load its tokenizer")


def test_messages_need_a_chat_template(job_file, tiny_model, tmp_path):
    model = tmp_path / "model"
    shutil.copytree(tiny_model, model)
    (model / "chat_template.jinja").unlink()
    path = job_file(model={"name": str(model)},
                    prompt={"template": None, "messages_column": "title"})
    assert_one_line_error(overnight("run", path), "prompt.messages_column needs a chat model")


def test_existing_output_is_not_overwritten(job_file, tmp_path):
    (tmp_path / "out").mkdir()
    assert_one_line_error(overnight("run", job_file()), "already exists", "--overwrite")


def test_a_second_run_of_the_same_output_is_refused_in_one_line(job_file, tmp_path):
    """Two `overnight run`s of one job at once would write the same parts and commit over
    each other: the second is refused while the first holds the output."""
    import os

    from pipelines.storage import hold_lock

    handle, _ = hold_lock(tmp_path / "out.overnight.lock")  # as a running job holds it
    try:
        assert_one_line_error(overnight("run", job_file()), "is being written by another "
                              f"overnight run (pid {os.getpid()})", "choose another")
    finally:
        handle.close()
    assert not (tmp_path / "out.partial").exists()


def test_debug_shows_the_traceback(job_file):
    result = overnight("--debug", "validate", job_file(sampling={"max_tokenz": 3}))
    assert result.returncode != 0 and "Traceback" in result.stderr


def test_validate_reports_lengths_failures_and_prompts(job_file):
    result = overnight("validate", job_file(), "--set", "sampling.max_tokens=64")
    assert result.returncode == 0, result.stderr
    out = result.stdout
    assert "1 jsonl file(s), 6 rows" in out
    assert "prompt tokens: p50 " in out
    assert "will fail: 1 rows null_field, e.g. row 'S2': column 'description' is null" in out
    assert "will fail: 3 rows prompt_too_long, e.g. row 'S3': prompt has " in out
    assert "--- prompt 1 ---\n<s><|system|>\nBe brief." in out


def test_an_engine_that_cannot_start_stops_the_job_in_one_line(job_file):
    # vLLM refuses the engine (max_num_seqs 0) inside the replica's actor, on a Ray worker:
    # the cause comes back through Ray as tracebacks and is told in one line
    result = overnight("run", job_file(engine={"args": {"max_num_seqs": 0}}))
    assert result.returncode == 2, result.stderr
    assert "Traceback" not in result.stderr, result.stderr
    last = result.stderr.strip().splitlines()[-1]
    assert last.startswith("overnight: error: the job stopped: ValidationError"), last
    assert "max_num_seqs" in last and "the same command resumes" in last
