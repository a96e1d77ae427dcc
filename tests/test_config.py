"""Config loading: unknown keys, bad values and overrides give one line naming the key."""

from pathlib import Path

import pytest

from pipelines.config import load_config
from pipelines.errors import ConfigError

from conftest import REPO

BASE = {
    "input": {"path": "in.parquet"},
    "model": {"name": "m"},
    "prompt": {"template": "{{ title }}"},
    "output": {"path": "out"},
}


def test_minimal_config_gets_defaults():
    config = load_config(BASE)
    assert config.sampling.max_tokens == 256
    assert config.output.column == "generated"
    assert config.resources.replicas == "auto"
    assert config.generated_columns()[:2] == ["row_id", "generated"]


def test_unknown_key_is_named():
    with pytest.raises(ConfigError, match=r"sampling\.max_tokenz: unknown key"):
        load_config({**BASE, "sampling": {"max_tokenz": 3}})


def test_unknown_section_is_named():
    with pytest.raises(ConfigError, match=r"config: samplin: unknown key"):
        load_config({**BASE, "samplin": {}})


def test_missing_key_is_named():
    with pytest.raises(ConfigError, match=r"model\.name: required key is missing"):
        load_config({**BASE, "model": {"dtype": "float32"}})


def test_template_or_messages_column():
    with pytest.raises(ConfigError, match=r"prompt: .*exactly one of template, messages_column"):
        load_config({**BASE, "prompt": {"system": "x"}})


def test_bad_value_is_named_with_the_value():
    with pytest.raises(ConfigError, match=r"sampling\.max_tokens: .*greater than 0.*got -1"):
        load_config({**BASE, "sampling": {"max_tokens": -1}})


def test_set_overrides_any_key_and_parses_yaml_values():
    config = load_config(BASE, ["sampling.max_tokens=32", "input.path=x.jsonl",
                                'sampling.stop=["\\n", "."]', "prompt.chat=false"])
    assert config.sampling.max_tokens == 32
    assert config.input.path == "x.jsonl"
    assert config.sampling.stop == ["\n", "."]
    assert config.prompt.chat is False


def test_set_with_a_typo_is_named():
    with pytest.raises(ConfigError, match=r"sampling\.max_tokns: unknown key"):
        load_config(BASE, ["sampling.max_tokns=3"])


def test_set_without_equals():
    with pytest.raises(ConfigError, match="expected KEY=VALUE"):
        load_config(BASE, ["sampling.max_tokens"])


def test_reserved_output_column():
    with pytest.raises(ConfigError, match="output.column 'error' is reserved"):
        load_config({**BASE, "output": {"path": "o", "column": "error"}})


def test_yaml_syntax_error_names_file_and_line(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("input:\n  path: a\nmodel: [unclosed\n")
    with pytest.raises(ConfigError, match=rf"{path}:\d+: not valid YAML"):
        load_config(path)


def test_missing_config_file(tmp_path: Path):
    with pytest.raises(ConfigError, match="no such config file"):
        load_config(tmp_path / "nope.yaml")


@pytest.mark.parametrize("path", sorted((REPO / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_config_loads(path: Path):
    config = load_config(path)
    assert config.output.path
    prompts = [s.prompt for s in config.steps if s.prompt] if config.steps else [config.prompt]
    assert prompts and all(p.template for p in prompts)


# -- a key given twice: one line naming the file, the line and the key (YAML keeps the last
# value silently)

def test_a_key_given_twice_is_refused_naming_the_file_and_line(tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("input:\n  path: a\nmodel:\n  name: m\noutput:\n  path: o\n"
                    "sampling:\n  max_tokens: 8\n  temperature: 0\n  max_tokens: 99\n")
    with pytest.raises(ConfigError) as caught:
        load_config(path)
    assert str(caught.value).startswith(f"{path}:10: key 'max_tokens' is given twice")
    assert "\n" not in str(caught.value)
    path.write_text("input: {path: a}\nmodel: {name: m}\ninput: {path: b}\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: key 'input' is given twice"):
        load_config(path)


def test_a_merge_keys_values_may_be_overridden_and_keys_may_repeat_in_other_mappings(
        tmp_path: Path):
    path = tmp_path / "job.yaml"
    path.write_text("defaults: &d {max_tokens: 8, temperature: 0}\n"
                    "input: {path: a}\nmodel: {name: m}\noutput: {path: o}\n"
                    "sampling:\n  <<: *d\n  max_tokens: 12\n")
    from pipelines.config import read_yaml

    raw = read_yaml(path)
    assert raw["sampling"] == {"max_tokens": 12, "temperature": 0}


def test_every_yaml_a_user_writes_refuses_a_key_given_twice(tmp_path: Path):
    """The job's --set, the DataFrame API's config, serve's and batch's --config: each read
    through the one loader (pipelines/config/load.py: read_yaml)."""
    from pipelines.api import _raw_config
    from serve.server import load_settings

    path = tmp_path / "serve.yaml"
    path.write_text("model:\n  name: m\n  name: n\n")
    with pytest.raises(ConfigError, match=rf"^{path}:3: key 'name' is given twice"):
        _raw_config(path)
    with pytest.raises(ConfigError, match=rf"^{path}:3: key 'name' is given twice"):
        load_settings(config=str(path), model=None, overrides=[], data_dir=str(tmp_path),
                      host="127.0.0.1", port=0, max_upload_mb=1)
    from pipelines.batchfile.run import run_batch_file

    requests = tmp_path / "requests.jsonl"
    requests.write_text('{"custom_id": "a", "method": "POST", "url": "/v1/chat/completions", '
                        '"body": {"messages": [{"role": "user", "content": "x"}]}}\n')
    with pytest.raises(ConfigError, match=rf"^{path}:3: key 'name' is given twice"):
        run_batch_file(requests, tmp_path / "results.jsonl", model="m", config=path)
    with pytest.raises(ConfigError, match=r"^--set sampling: key 'a' is given twice"):
        load_config(BASE, ["sampling={a: 1, a: 2}"])
    with pytest.raises(ConfigError, match=r"^--set sampling: value is not valid YAML"):
        load_config(BASE, ["sampling={a: 1"])


# -- max_model_len: a job of steps takes each step's sampling; the model's own limit; every
# suggestion the error prints is a --set that then works

def _suggested(message: str) -> list[str]:
    """The ``--set KEY=VALUE`` an error line suggests."""
    import re

    found = re.findall(r"--set (\S+=[^\s)]+)", message)
    assert found, message
    return found


def _steps_job(tiny_model, tmp_path: Path, **model) -> dict:
    (tmp_path / "in.jsonl").write_text('{"sku": "a", "title": "lamp"}\n'
                                       '{"sku": "b", "title": "chair"}\n')
    return {"input": {"path": str(tmp_path / "in.jsonl"), "id_column": "sku"},
            "model": {"name": tiny_model, "max_model_len": 200, **model},
            "steps": [{"name": "write", "prompt": {"template": "Describe {{ title }}"},
                       "sampling": {"max_tokens": 16}},
                      {"name": "judge", "prompt": {"template": "Judge {{ write }}"}}],
            "output": {"path": str(tmp_path / "out")}}


def test_a_job_of_steps_on_a_short_context_takes_each_steps_sampling(tiny_model, tmp_path):
    """The top-level sampling.max_tokens default (256) refused every job of steps on a
    model with max_model_len <= 256, and its fix (--set sampling.max_tokens) is refused in
    a job of steps: only each step's own max_tokens counts, and the line suggests the step's
    key, which then works."""
    from pipelines.plan.preflight import plan_job

    raw = _steps_job(tiny_model, tmp_path)
    with pytest.raises(ConfigError) as caught:  # judge's own default, 256
        plan_job(load_config(raw))
    message = str(caught.value)
    assert message.startswith("steps[1] (judge): sampling.max_tokens 256 leaves no room for "
                              "a prompt in max_model_len 200"), message
    assert _suggested(message) == ["steps.1.sampling.max_tokens=100"]
    plan = plan_job(load_config(raw, _suggested(message)))
    assert [s.sampling.max_tokens for s in plan.steps] == [16, 100]


def test_a_one_step_jobs_max_tokens_suggestion_works(tiny_model, tmp_path):
    from pipelines.plan.preflight import plan_job

    raw = _steps_job(tiny_model, tmp_path)
    del raw["steps"]
    raw["prompt"] = {"template": "Describe {{ title }}"}
    with pytest.raises(ConfigError, match="sampling.max_tokens 256 leaves no room") as caught:
        plan_job(load_config(raw))
    assert plan_job(load_config(raw, _suggested(str(caught.value)))).render.max_tokens == 100


def test_max_model_len_past_the_models_own_is_refused_before_any_engine(tiny_model, tmp_path,
                                                                       monkeypatch):
    from pipelines.plan.preflight import plan_job

    raw = _steps_job(tiny_model, tmp_path)
    raw["steps"][1]["sampling"] = {"max_tokens": 8}
    for too_long in (99999999, 2049):
        with pytest.raises(ConfigError) as caught:
            plan_job(load_config(raw, [f"model.max_model_len={too_long}"]))
        assert str(caught.value) == (
            f"model.max_model_len {too_long} is more than {tiny_model!r} takes: 2048 "
            "(max_position_embeddings in its config); set it to 2048 or less "
            "(--set model.max_model_len=2048), as vLLM would refuse it")
    plan = plan_job(load_config(raw, [f"model.max_model_len={too_long}", *_suggested(
        str(caught.value))]))
    assert plan.render.max_model_len == 2048
    monkeypatch.setenv("VLLM_ALLOW_LONG_MAX_MODEL_LEN", "1")  # vLLM's own escape hatch
    assert plan_job(load_config(raw, ["model.max_model_len=4096"])).render.max_model_len == 4096


@pytest.mark.parametrize("config, expected", [
    ({"max_position_embeddings": 4096}, (4096, "max_position_embeddings")),
    ({"max_position_embeddings": 4096, "n_positions": 1024}, (1024, "n_positions")),
    ({"max_position_embeddings": 4096, "model_max_length": 8192}, (8192, "model_max_length")),
    # RoPE scaling: linear and dynamic multiply the length; llama3 and yarn have it already
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "linear",
                                                           "factor": 4.0}}, (16384, None)),
    ({"max_position_embeddings": 4096, "rope_scaling": {"type": "dynamic", "factor": 2}},
     (8192, None)),
    ({"max_position_embeddings": 4096, "rope_parameters": {"rope_type": "llama3",
                                                           "factor": 8.0}}, (4096, None)),
    ({"max_position_embeddings": 4096, "rope_parameters": {
        "full_attention": {"rope_type": "linear", "factor": 2.0},
        "sliding_attention": {"rope_type": "default"}}}, (8192, None)),
    # a vision-language model's text config
    ({"vision_config": {"image_size": 32}, "text_config": {"max_position_embeddings": 2048}},
     (2048, "max_position_embeddings")),
    ({"vocab_size": 10}, None),  # no length: vLLM takes what it is given
])
def test_the_models_limit_is_derived_as_vllm_derives_it(config, expected):
    from pipelines.plan.max_model_len import derived_length

    found = derived_length(config)
    if expected is None or expected[1] is None:
        assert (found and found[0]) == (expected and expected[0])
    else:
        assert found == expected
