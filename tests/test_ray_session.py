"""The Ray a job starts (``overnight run``, and each ``overnight batch`` child of ``overnight
serve``) serves no HTTP: no dashboard, and no agent with Ray's jobs API, through which any
local user could run code as the job's user (issue #46)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile

from conftest import REPO

# What Ray starts beside a driver, read from the driver's own process tree while its session
# runs; Ray's optional dashboard packages are made to look installed (ray[default]), the case
# in which it starts both processes with HTTP servers unless told --minimal.
PROBE = """
import json, os, sys, psutil
from ray._private import utils
utils.get_dashboard_dependency_error = lambda: None  # as with ray[default] installed
from pipelines.job.resources import ray_session
with ray_session(None):
    found = {}
    for child in psutil.Process().children(recursive=True):
        try:
            line = " ".join(child.cmdline())
        except psutil.Error:
            continue
        for name in ("dashboard/dashboard.py", "dashboard/agent.py"):
            if name in line:
                found[name] = "--minimal" in line.split()
print(json.dumps(found))
"""


def test_a_jobs_ray_starts_its_dashboard_and_agent_without_http():
    scratch = tempfile.mkdtemp(prefix="ov-ray-")  # short: Ray's socket paths must fit
    try:
        run = subprocess.run([sys.executable, "-c", PROBE], cwd=REPO, capture_output=True,
                             text=True, timeout=300,
                             env={**os.environ, "RAY_USAGE_STATS_ENABLED": "0",
                                  "TMPDIR": scratch})
    finally:
        shutil.rmtree(scratch, ignore_errors=True)
    assert run.returncode == 0, run.stderr[-2000:]
    found = json.loads(run.stdout.strip().splitlines()[-1])
    # both processes run, each told to serve no HTTP
    assert found == {"dashboard/dashboard.py": True, "dashboard/agent.py": True}
