# One way to run everything. `make test` and `make demo` work on a fresh machine:
# they create .venv, install what is needed (torch 2.13.0 CPU, grpcio, ...) and
# generate the gRPC stubs first.

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
PIP := $(PY) -m pip
STAMP := $(VENV)/.pshard-installed
DATA_DIR ?= /usr/share/datasets/fashion-mnist
PROTOS := $(wildcard proto/pshard/api/v1/*.proto)
STUBS := pshard/api/v1/parameter_server_pb2.py
COMPOSE_BIN = $(shell $(PY) -c "import importlib.util, pathlib; print(pathlib.Path(importlib.util.find_spec('compose').origin).parent / 'docker-compose')")
PYTEST_ARGS ?=

.PHONY: gpu-carry gpu-check install proto data test test-unit test-service test-e2e soak demo demo-args up bench bench-tls lint docs clean help

help:
	@echo "make install   create $(VENV) and install pshard with torch (CPU), grpc and the dev tools"
	@echo "make proto     regenerate the gRPC stubs (pshard/api/v1) from proto/"
	@echo "make test      run the whole test suite (unit, service, e2e)"
	@echo "make soak      the chaos tests (replicas and checkpoints) on seeds 1-8, one after the other (SEEDS=... to choose), and a chief killed with the scheduler"
	@echo "make demo      train Fashion-MNIST with a local cluster: scheduler, 2 servers, 2 workers"
	@echo "make demo-ctr  train a CTR model with sparse embeddings on a synthetic click log (same cluster)"
	@echo "make up        docker compose up (needs a Docker engine)"
	@echo "make bench     run the benchmarks in bench/ and print JSON lines"
	@echo "make bench-disk-tier  a table 4x its memory_mb (zipf ids) against the same table in RAM: rows/s ratio"
	@echo "make bench-compression-accuracy  compressed vs uncompressed Fashion-MNIST accuracy (issue 19)"
	@echo "make bench-links  W1 step time per compressor on a tc-shaped 1 Gbit/s link, compressors' CPU cost"
	@echo "make bench-priority layer priority against FIFO, a 24-layer MLP over the same 1 Gbit/s link"
	@echo "make bench-drain  a server drained mid-training: longest step against the median (issue 20)"
	@echo "make bench-join-kill  a joining server SIGKILLed mid-copy: longest step against the median (issue 20)"
	@echo "make bench-rebalance  a zipf(1.1) table on 3 servers: hottest/mean before and after pshard rebalance (issue 20)"
	@echo "make bench-rebalance-auto  the same, moved by the scheduler's --rebalance-auto policy, and its time to settle"
	@echo "make bench-coordinator  a scheduled no-op's p50/p99, coordinator vs worker-driven training steps/s"
	@echo "make demo-coordinator   Fashion-MNIST trained by a coordinator (examples/coordinator_mnist.py)"
	@echo "make bench-checkpoints  steps during a background checkpoint, incremental checkpoint size (JSON lines)"
	@echo "make bench-tls one Python stream: clear, SSLSocket, the fast path's TlsStream (JSON lines)"
	@echo "make bench-hosts  the benchmarks across hosts on the namespace bed (root): stream, W1 clear/TLS, p50, 1 Gbit/s"
	@echo "make gpu-carry build .gpu-carry/ (pshard installed, stubs for the GPU machine's grpcio) to carry there"
	@echo "make gpu-check the GPU check (CUDA tests, PSTrainer vs torch.optim, CTR) here, JSON lines in runs/gpu"
	@echo "make lint      ruff, mypy, buf lint (proto/), compose config, hadolint and the strict docs build"
	@echo "make docs      the documentation site (docs/, mkdocs.yml) into site/"
	@echo "make proto-breaking  buf breaking: proto/ against the previous commit's (CI runs it)"

$(STAMP): pyproject.toml setup.py
	test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PIP) install --quiet --upgrade pip
	# Every pin lives in pyproject.toml; torch==2.13.0 there is the CPU build on this disk (an unpinned
	# torch pulls multi-GB CUDA wheels). The editable install generates the stubs (setup.py).
	$(PIP) install --quiet -e ".[worker,dev]"
	touch $(STAMP)

install: $(STAMP) $(STUBS)

# Editing a .proto regenerates the stubs through the same build hook that pip uses.
$(STUBS): $(PROTOS) | $(STAMP)
	$(PIP) install --quiet --no-deps -e .

proto: $(STAMP)
	$(PIP) install --quiet --no-deps -e .

# Fashion-MNIST from Debian's dataset-fashion-mnist package; without it (not root, no apt)
# the workers fall back to scikit-learn's bundled digits and say so.
data:
	@if [ -d "$(DATA_DIR)" ]; then echo "dataset: $(DATA_DIR)"; \
	elif [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null; then \
		{ apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq dataset-fashion-mnist; } \
			|| echo "dataset: apt-get install dataset-fashion-mnist failed; workers will use scikit-learn digits"; \
	else echo "dataset: $(DATA_DIR) missing and cannot apt-get install dataset-fashion-mnist; the demo will use scikit-learn digits"; fi

# The slowest tests are listed at the end, so that a CI log shows where the 30-minute budget goes.
test: install data
	$(PY) -m pytest -q --durations=40 $(PYTEST_ARGS)

test-unit: install
	$(PY) -m pytest -q tests/unit $(PYTEST_ARGS)

test-service: install
	$(PY) -m pytest -q tests/service $(PYTEST_ARGS)

test-e2e: install data
	$(PY) -m pytest -q tests/e2e $(PYTEST_ARGS)

# Chaos, with --replicas 1 and with checkpoints, on more seeds than make test's one (2-4 min each): every
# seed must pass.
SEEDS ?= 1 2 3 4 5 6 7 8
soak: install data
	PSHARD_SOAK=1 $(PY) -m pytest -q \
		"tests/e2e/test_chaos.py::test_a_chief_restarted_just_before_the_scheduler_joins_the_layout_its_servers_hold" \
		$(PYTEST_ARGS)
	for seed in $(SEEDS); do \
		PSHARD_SOAK=1 PSHARD_CHAOS_SEED=$$seed PSHARD_CHAOS_EPOCHS=800 $(PY) -m pytest -q \
			"tests/e2e/test_chaos.py::test_a_job_survives_a_seeded_schedule_of_kills" $(PYTEST_ARGS) || exit 1; \
	done

# The demo's training flags; tests/e2e/test_demo.py runs exactly these (make demo-args prints them).
DEMO_ARGS := --mode sync --epochs 2 --model cnn --optimizer sgd --lr 0.05 --momentum 0.9

# Mutual TLS on every channel, with certificates made on first use in runs/certs and kept
# (docs/operations/security.md); `make demo LAUNCH_SECURITY=--insecure` turns it off, loudly.
LAUNCH_SECURITY ?= --certs-dir runs/certs

demo: install data
	$(VENV)/bin/pshard launch $(LAUNCH_SECURITY) --ps 2 --workers 2 -- $(DEMO_ARGS) \
		--output runs/demo/model.pt --metrics runs/demo/metrics.jsonl

demo-args:
	@echo $(DEMO_ARGS)

# The CTR demo (issue 9): a sparse table of the click log's ids (async, per-row Adagrad) and an MLP (sync),
# 3 M impressions over 4 M ids; the chief prints the test AUC beside the planted model's (the ceiling).
CTR_DEMO_ARGS := --model ctr --mode sync --optimizer adam --lr 0.001 --epochs 1 --batch-size 1024 \
	--ctr-samples 3000000 --ctr-ids 4000000 --table-lr 0.05

.PHONY: demo-ctr demo-ctr-args
demo-ctr: install
	$(VENV)/bin/pshard launch $(LAUNCH_SECURITY) --ps 2 --workers 2 -- $(CTR_DEMO_ARGS) --metrics runs/demo-ctr/metrics.jsonl

demo-ctr-args:
	@echo $(CTR_DEMO_ARGS)

up:
	docker compose up --build

bench: install
	$(PY) -m bench.run_all

# Issue 21: a scheduled no-op's p50/p99, and coordinator training steps/s against the worker-driven loop
# (PSTrainer) in the same run; bar 0.8x.
.PHONY: bench-coordinator
bench-coordinator: install
	$(PY) -m bench.coordinator

# Issue 21: Fashion-MNIST trained by a coordinator (examples/coordinator_mnist.py); its last line is the
# test accuracy (>= 0.85). A minute or two on the 2-core machine: not part of make test.
.PHONY: demo-coordinator
demo-coordinator: install data
	$(VENV)/bin/pshard launch $(LAUNCH_SECURITY) --ps 2 --workers 2 --coordinator examples/coordinator_mnist.py

# Issue 19: test accuracy with --compression topk:0.01 and sign (error feedback on) against uncompressed
# training, same epochs and seed, 2 servers and 2 workers in sync mode (minutes: 3 trainings of
# COMPRESSION_EPOCHS epochs each). Exits 1 when a compressor ends more than 0.5 pp behind.
# Measured within 0.5 pp after 15 epochs (sign at a tenth of the lr: see docs/guide/compression.md).
COMPRESSION_EPOCHS ?= 15
# The disk tier (issue 22): rows/s of a table 4x its memory_mb against the same table in RAM, same run.
.PHONY: bench-disk-tier
bench-disk-tier: install
	$(PY) -m bench.disk_tier

.PHONY: bench-compression-accuracy
bench-compression-accuracy: install data
	$(PY) -m bench.compression_accuracy --epochs $(COMPRESSION_EPOCHS) --sign-lr 0.005

# Issue 19: W1 (25 M float32, 2 servers x 2 workers, sync, raw TCP) on hosts of the namespace test bed
# (bench/hostbed) with each worker's link shaped to LINK_MBIT by tc tbf, per compressor; then each
# compressor's CPU cost per 100 MB. Needs root.
LINK_MBIT ?= 1000
.PHONY: bench-links
bench-links: install
	$(PY) -m bench.compression_link --mbit $(LINK_MBIT)
	$(PY) -m bench.compression_cost
	$(PY) -m bench.priority_link --mbit $(LINK_MBIT)

# Layer priority against FIFO order alone: a 24-layer MLP, PSTrainer(overlap=True), on the bed (root).
.PHONY: bench-priority
bench-priority: install
	$(PY) -m bench.priority_link --mbit $(LINK_MBIT)

# A server drained on SIGTERM mid-training (issue 20): the longest step while it hands over.
.PHONY: bench-drain
bench-drain: install
	$(PY) -m bench.drain

.PHONY: bench-join-kill
bench-join-kill: install
	$(PY) -m bench.join_kill

.PHONY: bench-rebalance
bench-rebalance: install
	$(PY) -m bench.rebalance

.PHONY: bench-rebalance-auto
bench-rebalance-auto: install
	$(PY) -m bench.rebalance --auto

# Global checkpoints (issue 22): the step time while a server writes a full checkpoint in the background
# over the steps around it, and an incremental checkpoint's bytes after 1 % of the rows were pushed over
# the full one's. 25 M dense parameters and a 10 M-row table: about 1.3 GB of server memory, 1.2 GB of disk.
.PHONY: bench-checkpoints
bench-checkpoints: install
	$(PY) -m bench.checkpoints

# One Python stream in clear, over an SSLSocket and over the fast path's TlsStream (issue 24).
bench-tls: install
	$(PY) -m bench.tls_ceiling

# Across hosts (issue 24): the same figures between network namespaces on a bridge (bench/hostbed), in one
# run, with links shaped by tc tbf for the last two. Needs root; JSON lines, then a table.
.PHONY: bench-hosts
bench-hosts: install
	$(PY) -m bench.hosts

# The fuzzer in tests/fuzz, at length: 100,000 cases shared by its tests (or PSHARD_FUZZ_SECONDS of them)
# from a random seed that is printed; PSHARD_FUZZ_SEED=<seed> replays a run. `make test` runs a fixed,
# derandomized share of more than 5,000 cases.
.PHONY: fuzz
fuzz: install
	@seed=$${PSHARD_FUZZ_SEED:-$$(od -An -N4 -tu4 /dev/urandom | tr -d ' ')}; \
	echo "fuzz seed: $$seed (replay: make fuzz PSHARD_FUZZ_SEED=$$seed)"; \
	PSHARD_FUZZ=1 PSHARD_FUZZ_SEED=$$seed $(PY) -m pytest -q -p no:cacheprovider --timeout=3600 tests/fuzz $(PYTEST_ARGS)

lint: install
	$(VENV)/bin/ruff check .
	$(VENV)/bin/mypy common client ps_server scheduler worker launcher coordinator pshard
	$(VENV)/bin/mypy --explicit-package-bases $$(git ls-files 'tests/*.py' 'bench/*.py')
	$(VENV)/bin/buf lint proto
	$(COMPOSE_BIN) -f docker-compose.yml config -q
	$(VENV)/bin/hadolint docker/Dockerfile.server docker/Dockerfile.worker
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict --quiet

# The documentation site from docs/ (mkdocs.yml) into site/, strict: a broken link fails it.
docs: install
	NO_MKDOCS_2_WARNING=1 $(VENV)/bin/mkdocs build --strict

# The wire contract changes only compatibly: proto/ against the previous commit's, by buf's FILE rules
# (proto/buf.yaml). Nothing to compare on a first commit or one whose parent had no proto/ yet; a shallow
# clone without the parent is an error rather than a silent pass.
.PHONY: proto-breaking
proto-breaking: install
	@git rev-parse --verify --quiet HEAD >/dev/null 2>&1 || { echo "proto-breaking: not a git checkout" >&2; exit 1; }
	@if ! git rev-parse --verify --quiet HEAD~1 >/dev/null; then \
		if [ "$$(git rev-parse --is-shallow-repository)" = true ]; then \
			echo "proto-breaking: WARNING: shallow clone without HEAD~1, the contract was NOT checked (fetch at least 2 commits)" >&2; exit 0; \
		fi; \
		echo "proto-breaking: no previous commit, nothing to compare"; \
	elif ! git cat-file -e HEAD~1:proto 2>/dev/null; then \
		echo "proto-breaking: HEAD~1 has no proto/, nothing to compare"; \
	else \
		$(VENV)/bin/buf breaking proto --against '.git#ref=HEAD~1,subdir=proto'; \
	fi

clean:
	rm -rf pshard/api/v1/*_pb2* runs site .pytest_cache .ruff_cache .mypy_cache .hypothesis

# The GPU check (docs/operations/gpu.md). gpu-carry builds what a bare GPU machine without a registry
# needs (GPU_GRPC: its grpcio version); there, run `bash bench/gpu_check.sh OUT_DIR`.
GPU_GRPC ?= 1.84.0
GPU_OUT ?= runs/gpu
gpu-carry: install
	bash bench/gpu_carry.sh $(PY) $(GPU_GRPC)

gpu-check: install
	$(PY) -m bench.gpu_check --device auto --out $(GPU_OUT)/gpu_check.jsonl
