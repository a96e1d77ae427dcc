# The two set-up commands (each installs what it needs first):
#   make demo   run configs/demo.yaml on the tiny offline model (CPU is fine)
#   make test   run the test suite
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test bench clean

setup:
	@scripts/setup.sh

models/tiny/config.json: | setup
	$(BIN)/overnight tiny-model models/tiny

demo: setup models/tiny/config.json
	$(BIN)/overnight run configs/demo.yaml --overwrite
	$(BIN)/python -c "import polars as pl; print(pl.read_parquet('out/demo').select('sku', 'title', 'rewritten', 'finish_reason', 'error'))"

test: setup
	$(BIN)/python -m pytest -q

bench: setup
	$(BIN)/python benchmarks/throughput.py

# What was detected and installed, for a bug report. No install first: it reports a broken one.
.PHONY: doctor
doctor:
	@if [ -x $(BIN)/overnight ]; then $(BIN)/overnight doctor; else echo "no $(BIN)/overnight:" \
	  "run make setup (scripts/setup.sh --dry-run prints what it would install)"; fi

clean:
	rm -rf out models .pytest_cache
