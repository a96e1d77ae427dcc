"""One job (``hardened``: sparse JSONL keys, a column that is ``{}`` in every row, per-row
overrides good and bad, two samples a row with dedupe) run again the ways a user would:
``--retry-errors``, a resume of an interrupted ``--overwrite`` run, an interrupted retry, an
output behind a symlink; and what its report, its rows and its fingerprint say."""

from __future__ import annotations

import json
import os
import shutil

import polars as pl
import pytest
import yaml

from pipelines.config import load_config
from pipelines.plan.preflight import plan_job
from pipelines.write import OutputStore, part_name
from udfs.columns import ErrorKind

from conftest import BAD_OVERRIDES, cli, job_config
from conftest import OVERRIDE_ROWS as ROWS
from conftest import override_rows as rows


@pytest.fixture(scope="session")
def hardened(tiny_model, ray_cluster, tmp_path_factory):
    root = tmp_path_factory.mktemp("hardened")
    (root / "in.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows()))
    config = job_config(tiny_model, root / "in.jsonl", root / "out",
                        input={"id_column": "sku"},
                        sampling={"temperature": 0.0, "max_tokens": 6, "n": 2,
                                  "overrides_column": "opts"},
                        output={"path": str(root / "out"), "column": "rewritten",
                                "dedupe": True},
                        resources={"batch_size": 4})
    config["model"]["dtype"] = "auto"  # float32 on a CPU without native bfloat16
    path = root / "job.yaml"
    path.write_text(yaml.safe_dump(config))
    assert cli("run", path, "--quiet") == (0, "", "")
    return root, path, pl.read_parquet(root / "out")


def test_dtype_auto_on_a_cpu_is_what_the_processor_runs_fast_and_the_report_says_so(
        hardened, capsys):
    from udfs.engines.platform import auto_dtype

    root, path, _ = hardened
    code, out, _ = cli("report", root / "out", capsys=capsys)
    assert code == 0 and f"CPU threads), {auto_dtype('cpu')}:" in out
    code, out, _ = cli("validate", path, capsys=capsys)
    assert code == 0 and f"dtype: auto: {auto_dtype('cpu')} where the engine runs" in out


def test_jsonl_keys_missing_from_the_first_row_are_kept(hardened):
    _, _, out = hardened
    notes = dict(out.select("sku", "notes").unique().iter_rows())
    assert notes == {f"K{i:02d}": (f"keep me {i}" if i % 4 == 3 else None) for i in range(ROWS)}


def test_a_column_that_is_an_empty_object_in_every_row_is_kept_as_json_text(hardened):
    _, _, out = hardened
    assert out["meta"].to_list() == ["{}"] * out.height


def test_bad_per_row_overrides_are_that_rows_error_and_the_job_goes_on(hardened):
    _, _, out = hardened
    assert out["sku"].unique(maintain_order=True).to_list() == [f"K{i:02d}" for i in range(ROWS)]
    for i, (_, needle) in BAD_OVERRIDES.items():
        row = out.filter(pl.col("sku") == f"K{i:02d}")
        assert row.height == 1, row  # one row, not n samples, and never none
        assert row["error_kind"][0] == ErrorKind.OVERRIDES
        assert row["error"][0].startswith("opts: ") and needle in row["error"][0]
        assert row["rewritten"][0] is None
    good = out.filter(~pl.col("sku").is_in([f"K{i:02d}" for i in BAD_OVERRIDES]))
    assert good["error"].null_count() == good.height and good["rewritten"].null_count() == 0
    # greedy samples deduped to one; the seeded row's override of n gives it three samples
    assert good.filter(pl.col("sku") == "K07").height == 1
    assert good.filter(pl.col("sku") == "K06").height == 3


def test_an_interrupted_retry_is_retried_with_dedupe_and_samples(hardened, capsys):
    """--retry-errors with dedupe and n > 1 (it raised ArrowIndexError), started from the state
    an interrupted retry leaves (which `status` said to retry, and the retry refused)."""
    root, path, before = hardened
    store = OutputStore(str(root / "out"))
    store.write_record({**store.read_record(), "state": "retrying"})
    store.staging.mkdir()
    code, out, _ = cli("status", root / "out", capsys=capsys)
    assert code == 0 and "run with --retry-errors again" in out
    code, out, err = cli("run", path, "--retry-errors", "--quiet", capsys=capsys)
    assert code == 0, err
    assert store.read_record()["state"] == "complete"
    after = pl.read_parquet(root / "out")
    assert after.drop("error").equals(before.drop("error"))  # the bad rows fail again, alike


def interrupted(root, path, parts_done: int, name: str):
    """The state an interrupted run of this job leaves: its record 'running', some parts
    staged, and (it was started with --overwrite) the old output still in place. The staged
    rows are marked ('staged: ' before the text), so the test can tell them from rows
    generated again."""
    out = root / name
    shutil.rmtree(out, ignore_errors=True)
    shutil.copytree(root / "out", out)
    config = load_config(path, [f"output.path={out}"])
    store = OutputStore(str(out))
    store.staging.remove()
    store.staging.mkdir()
    rows = pl.read_parquet(out).with_columns(
        pl.col("sku").str.slice(1).cast(pl.Int64).alias("i"),  # K07: input row 7
        ("staged: " + pl.col("rewritten")).alias("rewritten"))
    for start in range(0, 4 * parts_done, 4):
        rows.filter(pl.col("i").is_between(start, start + 3)).drop("i").write_parquet(
            root / f"{name}.partial" / part_name(start, start + 4))
    store.write_record({"state": "running", "started": 0, "rows_total": ROWS,
                        "fingerprint": plan_job(config).fingerprint})
    return out


@pytest.mark.parametrize("flag", ["--overwrite", None])
def test_an_interrupted_overwrite_run_resumes_with_or_without_the_flag(hardened, capsys, flag):
    root, path, before = hardened
    out = interrupted(root, path, 2, "again")
    code, _, err = cli("run", path, "--set", f"output.path={out}", "--quiet",
                       *([flag] if flag else []), capsys=capsys)
    assert code == 0, err
    after = pl.read_parquet(out)
    # the staged parts were kept, not generated again; the rest generated as before
    staged = pl.col("sku").is_in([f"K{i:02d}" for i in range(8)])
    assert after.filter(staged)["rewritten"].to_list() == [
        None if t is None else "staged: " + t for t in before.filter(staged)["rewritten"]]
    assert after.drop("rewritten").equals(before.drop("rewritten"))
    assert after.filter(~staged).equals(before.filter(~staged))
    assert OutputStore(str(out)).read_record()["summary"]["rows_resumed"] == 8


def test_a_symlinked_output_is_replaced_through_the_link(hardened, tmp_path, capsys):
    root, path, before = hardened
    real = tmp_path / "real"
    real.mkdir()
    (real / "stale.parquet").write_bytes(b"old")
    link = tmp_path / "link"
    link.symlink_to(real)
    code, _, err = cli("run", path, "--set", f"output.path={link}", "--overwrite", "--quiet",
                       capsys=capsys)
    assert code == 0, err
    assert link.is_symlink() and os.path.realpath(link) == str(real)
    assert not (real / "stale.parquet").exists()
    assert pl.read_parquet(real).equals(before)
    assert OutputStore(str(link)).read_record()["state"] == "complete"


def test_engine_settings_that_change_results_are_in_the_fingerprint(hardened):
    """A resume never mixes two engines' outputs; a resource knob may change between runs."""
    from pipelines.write import diff_fingerprints

    _, path, _ = hardened
    base = plan_job(load_config(path)).fingerprint
    changed = plan_job(load_config(path, ["engine.args={seed: 1}"])).fingerprint
    assert diff_fingerprints(base, changed) == ["engine"]
    resized = plan_job(load_config(path, ["engine.kv_cache_memory_bytes=1048576"])).fingerprint
    assert diff_fingerprints(base, resized) == []
