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
    with pytest.raises(ConfigError, match=rf"{path} line \d+: not valid YAML"):
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
