#!/usr/bin/env bash
# The HTTP engine against a real llama.cpp server (llama-cpp-python), by hand; not in CI (the
# llama.cpp build from source takes several minutes). Run from the repo root after `make demo`.
set -euo pipefail
LLAMA_VENV=${LLAMA_VENV:-.work/llama-venv}
PORT=${PORT:-8799}
[ -x "$LLAMA_VENV/bin/python" ] || python3 -m venv "$LLAMA_VENV"
"$LLAMA_VENV/bin/pip" install -q 'llama-cpp-python[server]'       # builds llama.cpp from source
mkdir -p .work/llama-src
[ -d .work/llama-src/llama_cpp_python-* ] || {
  "$LLAMA_VENV/bin/pip" download -q --no-deps --no-binary :all: llama-cpp-python -d .work/llama-src
  tar xzf .work/llama-src/llama_cpp_python-*.tar.gz -C .work/llama-src; }
root=$(pwd)
(cd .work/llama-src/llama_cpp_python-*/vendor/llama.cpp &&
  "$root/.venv/bin/python" "$root/scripts/convert_tiny_to_gguf.py" "$root/models/tiny" \
    --outfile "$root/.work/tiny.gguf" --outtype f32)
"$LLAMA_VENV/bin/python" -m llama_cpp.server --model .work/tiny.gguf --model_alias tiny \
  --host 127.0.0.1 --port "$PORT" --n_ctx 1024 > .work/llama-server.log 2>&1 &
server=$!
trap 'kill $server' EXIT
for _ in $(seq 60); do curl -sf "127.0.0.1:$PORT/v1/models" >/dev/null && break; sleep 1; done
# llama-cpp-python's server takes no token-id prompts: the chat endpoint sends messages.
.venv/bin/overnight run configs/demo.yaml --overwrite --set output.path=out/demo_llamacpp \
  --set "engine={kind: http, base_url: 'http://127.0.0.1:$PORT/v1', model: tiny, endpoint: chat, max_concurrency: 4}"
