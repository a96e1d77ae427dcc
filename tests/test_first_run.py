"""A new user's first commands, without an engine: a finished job run again says it is
complete, a misspelt key or column suggests the close match, a bad ``--set`` is named as the
``--set``, and ``validate`` says how its blocks relate to ``resources.batch_size``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import cli, job_config, one_line_error, write_jsonl
from pipelines.config import load_config
from pipelines.plan.preflight import plan_job
from pipelines.write import OutputStore

ROOT = Path(__file__).resolve().parents[1]
ROWS = [{"title": f"Lamp {i}", "description": f"light {i}"} for i in range(3)]


def _job(tmp_path, tiny_model, **sections):
    write_jsonl(tmp_path / "in.jsonl", ROWS)
    config = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out")
    for name, value in sections.items():
        config[name] = {**config.get(name, {}), **value}
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    return path


def _finished_output(path, **record):
    """The output a finished run of the job at ``path`` leaves: the folder and its record."""
    config = load_config(path)
    out = OutputStore(config.output.path)
    out.path.mkdir()
    out.write_record({"state": "complete", "rows_total": 3,
                      "fingerprint": plan_job(config).fingerprint,
                      "summary": {"rows": 3, "errors": {"api": 1}}, **record})
    return out


# -- a finished job, run again


def test_a_finished_job_run_again_says_it_is_complete_and_exits_0(tiny_model, tmp_path,
                                                                   capsys):
    path = _job(tmp_path, tiny_model)
    _finished_output(path)
    code, out, err = cli("run", path, capsys=capsys)
    assert code == 0 and err == ""
    lines = out.strip().splitlines()
    assert len(lines) == 1, out
    assert lines[0] == (f"overnight: {tmp_path / 'out'} already exists and is complete: 3 rows "
                        f"of this same job, 1 with errors (overnight status {tmp_path / 'out'}); "
                        "to run it again, add --overwrite")


def test_an_output_of_a_different_job_is_still_refused_naming_what_changed(tiny_model,
                                                                          tmp_path, capsys):
    path = _job(tmp_path, tiny_model)
    _finished_output(path)
    code, _, err = cli("run", path, "--set", "sampling.max_tokens=5", capsys=capsys)
    assert code == 2
    one_line_error(err, "already exists, written by a different job (sampling changed)",
                   "pass --overwrite")


def test_an_output_whose_run_is_not_complete_is_refused(tiny_model, tmp_path, capsys):
    path = _job(tmp_path, tiny_model)
    _finished_output(path, state="retrying")  # its retry was interrupted, staging gone
    code, _, err = cli("run", path, capsys=capsys)
    assert code == 2
    one_line_error(err, "already exists (its record says 'retrying')", "pass --overwrite")


# -- errors that suggest


def test_a_misspelt_key_in_the_file_suggests_the_close_one(tiny_model, tmp_path, capsys):
    path = _job(tmp_path, tiny_model, sampling={"temprature": 0.2})
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    line = one_line_error(err)
    assert line == (f"overnight: error: {path}: sampling.temprature: unknown key "
                    "(did you mean 'temperature'?)")


def test_a_misspelt_key_in_a_tagged_section_suggests_from_that_section(tiny_model, tmp_path,
                                                                        capsys):
    path = _job(tmp_path, tiny_model, engine={"kv_cach_memory_bytes": 1 << 28})
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    one_line_error(err, "engine.kv_cach_memory_bytes: unknown key",
                   "(did you mean 'kv_cache_memory_bytes'?)")


def test_an_unknown_key_far_from_any_suggests_nothing(tiny_model, tmp_path, capsys):
    path = _job(tmp_path, tiny_model, sampling={"zzz": 1})
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    assert "did you mean" not in one_line_error(err, "sampling.zzz: unknown key")


def test_a_bad_set_is_named_as_the_set_not_the_file(tiny_model, tmp_path, capsys):
    path = _job(tmp_path, tiny_model)
    code, _, err = cli("validate", path, "--set", "sampling.temprature=0.2", capsys=capsys)
    assert code == 2
    assert one_line_error(err) == ("overnight: error: --set sampling.temprature=0.2: "
                                   "sampling.temprature: unknown key (did you mean "
                                   "'temperature'?)")
    code, _, err = cli("validate", path, "--set", "sampling.max_tokens=many", capsys=capsys)
    assert code == 2
    line = one_line_error(err, "--set sampling.max_tokens=many: sampling.max_tokens: ",
                          "valid integer")
    assert str(path) not in line
    # a --set that makes a section the file does not have
    code, _, err = cli("validate", path, "--set", "promt.template=x", capsys=capsys)
    assert code == 2
    one_line_error(err, "--set promt.template=x: promt: unknown key (did you mean 'prompt'?)")


@pytest.mark.parametrize("sections, needle", [
    ({"prompt": {"template": "{{ titel }}"}},
     "prompt.template uses column 'titel', which the input does not have "
     "(did you mean 'title'?); its columns are: title, description"),
    ({"input": {"id_column": "descripton"}},
     "input.id_column 'descripton' is not a column of the input (did you mean 'description'?)"),
], ids=["template column", "id column"])
def test_a_misspelt_column_suggests_the_close_one(tiny_model, tmp_path, capsys, sections,
                                                  needle):
    path = _job(tmp_path, tiny_model, **sections)
    code, _, err = cli("validate", path, capsys=capsys)
    assert code == 2
    one_line_error(err, needle)


# -- validate's blocks and resources.batch_size


def test_validate_says_how_small_blocks_relate_to_batch_size(tiny_model, tmp_path, capsys):
    write_jsonl(tmp_path / "in.jsonl", [{"title": f"t{i}", "description": "d"}
                                        for i in range(300)])
    config = job_config(tiny_model, tmp_path / "in.jsonl", tmp_path / "out",
                        resources={"batch_size": 64})
    path = tmp_path / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    code, out, _ = cli("validate", path, capsys=capsys)
    assert code == 0
    assert out.splitlines()[0] == (
        "input: 1 jsonl file(s), 300 rows, 16 blocks of up to 19 rows, each committed as it "
        "is done (fewer than resources.batch_size: 64, so that a table this small is "
        "committed in 16 parts; an engine still holds up to 300 rows at once)")
    # blocks of batch_size rows: nothing to explain
    path.write_text(yaml.safe_dump({**config, "resources": {"batch_size": 8}}))
    code, out, _ = cli("validate", path, capsys=capsys)
    assert code == 0
    first = out.splitlines()[0]
    assert first.endswith("blocks of up to 8 rows, each committed as it is done"), first


# -- a quiet start


def test_ray_starts_without_its_log_level_notice():
    """RAY_BACKEND_LOG_LEVEL keeps Ray's C++ core lines off the terminal, but Ray prints that
    it is set ("logging.cc:303: Set ray log level ..."): that line alone is dropped."""
    script = ("import sys\n"
              "from pipelines.job.resources import ray_session\n"
              "print('before', file=sys.stderr, flush=True)\n"
              "with ray_session():\n"
              "    print('inside', file=sys.stderr, flush=True)\n")
    env = {k: v for k, v in os.environ.items() if k != "RAY_BACKEND_LOG_LEVEL"}
    result = subprocess.run([sys.executable, "-c", script], cwd=ROOT, env=env,
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr
    assert result.stderr.splitlines() == ["before", "inside"], result.stderr
