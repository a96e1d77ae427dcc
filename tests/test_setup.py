"""scripts/setup.sh's choices, read from its dry run, and ``overnight doctor`` on this machine.

The set-up script runs for real against stub ``nvidia-smi`` / ``rocm-smi`` commands, a stub
ROCm version file, a local HTTP server standing in for vLLM's ROCm wheel index, and pip's own
look-up of torch; only the pip commands themselves are printed instead of run.
"""

from __future__ import annotations

import functools
import http.server
import os
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from udfs.engines.platform import auto_dtype, cpu_flags

ROOT = Path(__file__).resolve().parents[1]
SETUP = ROOT / "scripts" / "setup.sh"
TORCH_CPU_INDEX = "https://download.pytorch.org/whl/cpu"


def _stub(bin_dir: Path, name: str, body: str) -> None:
    path = bin_dir / name
    path.write_text(f"#!/bin/sh\n{body}\n")
    path.chmod(0o755)


@pytest.fixture
def machine(tmp_path):
    """A machine to run the set-up script on: no GPU, this Python, a venv not yet made."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    # Both tools always exist as stubs, so a real one on a GPU machine never answers instead.
    _stub(bin_dir, "nvidia-smi", "exit 9")
    _stub(bin_dir, "rocm-smi", "exit 9")
    # A Python that says it is 3.12 (or 3.10) when asked its version, and is this one otherwise.
    for version in ("3.12", "3.10"):
        _stub(bin_dir, f"python{version}",
              f'case "$*" in *version_info*) echo {version}; exit 0;; esac\n'
              f'exec "{sys.executable}" "$@"')
    env = {k: v for k, v in os.environ.items()
           if not k.startswith(("OVERNIGHT_", "ROCM_", "VENV", "PYTHON"))}
    env.update(PATH=f"{bin_dir}{os.pathsep}{env['PATH']}", PYTHON=sys.executable,
               VENV=str(tmp_path / "venv"), ROCM_PATH=str(tmp_path / "rocm"),
               no_proxy="127.0.0.1,localhost", NO_PROXY="127.0.0.1,localhost")

    class Machine:
        bin = bin_dir
        environ = env
        venv = tmp_path / "venv"

        def gpu(self, tool: str, rocm_version: str | None = None) -> None:
            _stub(bin_dir, tool, 'echo "GPU 0: stub"')
            if rocm_version:
                info = tmp_path / "rocm" / ".info"
                info.mkdir(parents=True)
                (info / "version").write_text(f"{rocm_version}-123\n")

        def setup(self, **settings: str) -> subprocess.CompletedProcess:
            result = subprocess.run(["bash", str(SETUP), "--dry-run"], env={**env, **settings},
                                    capture_output=True, text=True, timeout=120)
            assert not self.venv.exists(), "a dry run made the venv"
            return result

    return Machine()


@pytest.fixture
def rocm_index(tmp_path):
    """vLLM's ROCm wheel index for 0.32.0 with the rocm721 and rocm700 variants, served locally
    the way the real one is laid out: <base>/<version>/<variant>/vllm/."""
    root = tmp_path / "index"
    for variant in ("rocm721", "rocm700"):
        page = root / "0.32.0" / variant / "vllm"
        page.mkdir(parents=True)
        wheel = f"vllm-0.32.0%2B{variant}-cp312-cp312-manylinux_2_35_x86_64.whl"
        (page / "index.html").write_text(f'<a href="{wheel}">{wheel}</a>\n')
    handler = functools.partial(_QuietHandler, directory=str(root))
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


class _QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, *args):
        pass


def _pip_install(result: subprocess.CompletedProcess) -> str:
    lines = [ln for ln in result.stdout.splitlines() if " -m pip install " in ln]
    assert len(lines) == 1, result.stdout + result.stderr
    return lines[0]


def _one_line_error(result: subprocess.CompletedProcess) -> str:
    assert result.returncode == 1
    assert "+ " not in result.stdout, "a failed check still printed pip commands"
    lines = result.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("overnight: "), result.stderr
    return lines[0]


def test_nvidia_gpu_installs_the_cuda_build_from_pypi(machine):
    machine.gpu("nvidia-smi")
    result = machine.setup()
    assert result.returncode == 0, result.stderr
    assert f"+ {sys.executable} -m venv {machine.venv}" in result.stdout
    install = _pip_install(result)
    assert install.endswith("-m pip install -q -e '.[gpu,demo]'")
    assert "uninstall" not in result.stdout


def test_forced_build_cuda_is_the_nvidia_build(machine):
    result = machine.setup(OVERNIGHT_BUILD="cuda")
    assert _pip_install(result).endswith("-e '.[gpu,demo]'")


def test_a_venv_holding_another_build_is_not_installed_over(machine):
    machine.venv.mkdir()
    (machine.venv / ".installed-cpu").touch()
    machine.gpu("nvidia-smi")
    result = subprocess.run(["bash", str(SETUP), "--dry-run"], env=machine.environ,
                            capture_output=True, text=True, timeout=60)
    error = _one_line_error(result)
    assert "holds the cpu build, this machine gets the gpu build" in error
    assert "OVERNIGHT_BUILD=cpu" in error


def test_unknown_build_stops_with_one_line(machine):
    assert "choose cpu, gpu (NVIDIA) or rocm (AMD)" in _one_line_error(
        machine.setup(OVERNIGHT_BUILD="tpu"))


def test_amd_gpu_installs_vllms_rocm_wheel_for_the_rocm_version_found(machine, rocm_index):
    machine.gpu("rocm-smi", rocm_version="7.2.1")
    result = machine.setup(PYTHON="python3.12", OVERNIGHT_ROCM_INDEX=rocm_index)
    assert result.returncode == 0, result.stderr
    install = _pip_install(result)
    assert install.endswith(f"-e '.[demo]' vllm==0.32.0+rocm721 "
                            f"--extra-index-url {rocm_index}/0.32.0/rocm721")
    assert "ROCm 7.2.1: vLLM's rocm721 wheel" in result.stdout


def test_amd_patch_release_takes_the_wheel_built_for_its_minor_release(machine, rocm_index):
    machine.gpu("rocm-smi", rocm_version="7.0.2")
    result = machine.setup(PYTHON="python3.12", OVERNIGHT_ROCM_INDEX=rocm_index)
    assert "vllm==0.32.0+rocm700 --extra-index-url" in _pip_install(result)


def test_amd_rocm_version_without_a_wheel_names_the_container_image(machine, rocm_index):
    machine.gpu("rocm-smi", rocm_version="6.4.1")
    error = _one_line_error(machine.setup(PYTHON="python3.12", OVERNIGHT_ROCM_INDEX=rocm_index))
    assert "no vLLM 0.32.0 wheel for ROCm 6.4.1" in error
    assert "(looked for rocm641, rocm640)" in error and "vllm/vllm-openai-rocm" in error


def test_amd_with_the_wheel_index_out_of_reach_says_so_in_one_line(machine):
    machine.gpu("rocm-smi", rocm_version="7.2.1")
    error = _one_line_error(machine.setup(PYTHON="python3.12",
                                          OVERNIGHT_ROCM_INDEX="http://127.0.0.1:9"))
    assert "wheel index http://127.0.0.1:9/0.32.0/ cannot be reached" in error
    assert "vllm/vllm-openai-rocm" in error


def test_amd_variant_setting_skips_the_look_up(machine):
    machine.gpu("rocm-smi", rocm_version="7.2.1")
    result = machine.setup(PYTHON="python3.12", OVERNIGHT_ROCM_VARIANT="rocm721",
                           OVERNIGHT_ROCM_INDEX="http://127.0.0.1:9")  # nothing listens there
    assert "--extra-index-url http://127.0.0.1:9/0.32.0/rocm721" in _pip_install(result)


def test_amd_on_another_python_stops_with_one_line_naming_python_3_12(machine):
    machine.gpu("rocm-smi", rocm_version="7.2.1")
    error = _one_line_error(machine.setup(PYTHON=str(machine.bin / "python3.10")))
    assert "the rocm build needs Python 3.12" in error
    assert "PYTHON=python3.12" in error and "vllm/vllm-openai-rocm" in error


@pytest.mark.parametrize("build", ["cpu", "gpu"])
def test_python_outside_3_11_to_3_14_stops_with_one_line(machine, build):
    error = _one_line_error(machine.setup(OVERNIGHT_BUILD=build,
                                          PYTHON=str(machine.bin / "python3.10")))
    assert f"the {build} build needs Python 3.11, 3.12, 3.13, 3.14" in error
    assert "is Python 3.10: run again with PYTHON=python3.1" in error


def test_cpu_adds_pytorchs_cpu_index_when_pip_does_not_find_its_torch(machine):
    # pip with no configuration and no index: it cannot find torch 2.13.0+cpu
    result = machine.setup(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS="", PIP_NO_INDEX="1")
    assert result.returncode == 0, result.stderr
    assert _pip_install(result).endswith(
        f"-e '.[cpu,demo]' --extra-index-url {TORCH_CPU_INDEX}")
    assert f"adding PyTorch's CPU wheel index {TORCH_CPU_INDEX}" in result.stdout
    assert "pip uninstall -q -y torchvision torchaudio torchcodec triton" in result.stdout


def test_cpu_adds_no_index_where_pip_already_finds_its_torch(machine, tmp_path):
    links = tmp_path / "wheels"
    links.mkdir()
    (links / "torch-2.13.0+cpu-py3-none-any.whl").touch()  # pip lists it by its name
    result = machine.setup(PIP_CONFIG_FILE=os.devnull, PIP_FIND_LINKS=str(links),
                           PIP_NO_INDEX="1")
    assert _pip_install(result).endswith("-e '.[cpu,demo]'")
    assert "pip already finds torch 2.13.0+cpu" in result.stdout


@pytest.mark.parametrize("url", ["https://mirror.example/whl/cpu", ""])
def test_cpu_torch_index_setting_replaces_the_look_up(machine, url):
    result = machine.setup(OVERNIGHT_TORCH_INDEX_URL=url, PIP_CONFIG_FILE=os.devnull,
                           PIP_NO_INDEX="1")
    expected = f" --extra-index-url {url}" if url else ""
    assert _pip_install(result).endswith(f"-e '.[cpu,demo]'{expected}")


def test_auto_dtype_is_float32_on_a_cpu_without_amx():
    assert auto_dtype("cpu", frozenset({"avx512f", "avx512_bf16"})) == "float32"
    assert auto_dtype("cpu", frozenset({"avx512_bf16", "amx_bf16", "amx_tile"})) == "bfloat16"
    assert auto_dtype("cuda", frozenset()) == "auto"
    assert auto_dtype("rocm") == "auto"


def test_cpu_flags_are_read_from_cpuinfo(tmp_path):
    cpuinfo = tmp_path / "cpuinfo"
    cpuinfo.write_text("processor\t: 0\nflags\t\t: fpu avx512f amx_bf16\n\n"
                       "processor\t: 1\nflags\t\t: fpu\n")
    assert cpu_flags(cpuinfo) == {"fpu", "avx512f", "amx_bf16"}
    assert cpu_flags(tmp_path / "missing") == frozenset()


def _doctor(*code: str) -> subprocess.CompletedProcess:
    script = "\n".join([*code, "from pipelines.cli import main", "main(['doctor'])"])
    return subprocess.run([sys.executable, "-c", script], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_doctor_prints_one_fact_a_line():
    result = _doctor()
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    facts = dict(line.split(":", 1) for line in result.stdout.splitlines())
    assert list(facts) == ["overnight", "python", "system", "cpu", "gpu tools", "build", "vllm",
                           "torch", "ray", "gpus (ray)", "dtype"]
    assert facts["build"].split()[0] in ("cpu", "cpu:", "gpu", "gpu:", "rocm", "rocm:")
    assert facts["vllm"].split()[0] == "0.32.0" and "platform" in facts["vllm"]
    assert facts["ray"].strip() == "2.60.0"
    assert facts["dtype"].strip().startswith("auto -> ")


def test_doctor_says_in_one_line_that_vllm_is_missing():
    result = _doctor("import sys", "sys.modules['vllm'] = None  # import vllm raises ImportError")
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    vllm = [line for line in result.stdout.splitlines() if line.startswith("vllm:")]
    assert len(vllm) == 1 and "not installed" in vllm[0] and "make setup" in vllm[0]
