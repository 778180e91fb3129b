# readie: `make run` and `make test` do all their own set-up on a fresh Debian machine.
SHELL := /bin/bash
.DEFAULT_GOAL := help
export UV_PYTHON_DOWNLOADS := never
PYTHON_VERSION := 3.11
UV := uv
RUN := $(UV) run --frozen --python $(PYTHON_VERSION)
CHECKPOINTS := build/checkpoints

.PHONY: help setup deps rootfs capture test test-fast fixtures proto unasync run bench bench-smoke soak clean

help: ## list the targets
	@grep -hE '^[a-z-]+:.*## ' $(MAKEFILE_LIST) | awk -F ':.*## ' '{printf "  %-12s %s\n", $$1, $$2}'

setup: ## install what the host lacks (runsc, debootstrap, uv); needs root
	@bash scripts/setup-host.sh

deps: setup ## create the workspace venv from uv.lock
	$(UV) sync --frozen --python $(PYTHON_VERSION)

rootfs: deps ## build (or reuse from ~/.cache/readie) the sandbox rootfs
	$(RUN) readie rootfs

capture: deps ## capture the planned checkpoints into build/checkpoints (skips up-to-date ones), link ~/.cache/readie/checkpoints to it
	$(RUN) readie capture --output $(CHECKPOINTS) --link-default

fixtures: deps ## regenerate fixtures/frames.golden.json
	$(RUN) python fixtures/generate_golden.py

proto: deps ## regenerate the gRPC code in rpc/src/readie_rpc/_proto from proto/
	$(RUN) python proto/generate.py

unasync: deps ## regenerate the client's sync Session from its async source (decision 0029)
	$(RUN) python scripts/unasync.py

test: capture ## run every test, gVisor ones included
	$(RUN) pytest

test-fast: deps ## run the tests that need no gVisor
	$(RUN) pytest -m "not runsc"

bench: capture ## run the benchmarks (~10 min), write build/bench/latest.json
	$(RUN) python -m bench.run --output build/bench/latest.json

soak: capture ## the soak at bench size (~1 h: 20,000 jobs, 64 sessions), print the leak curve, write build/bench/soak.json
	$(RUN) python -m bench.run --only soak --output build/bench/soak.json

bench-smoke: capture ## one iteration of every benchmark scenario (< 1 min), write build/bench/smoke.json
	$(RUN) python -m bench.run --smoke --output build/bench/smoke.json

run: capture ## set up everything, then run the demo jobs through `readie pool`
	cd examples/demo && $(abspath .venv/bin/readie) pool --config readie.toml \
	  --checkpoints $(abspath $(CHECKPOINTS)) < jobs.jsonl

clean: ## remove build/ (the rootfs cache in ~/.cache/readie stays)
	rm -rf build
