# Everything runs from the virtual environment at .venv/ that `make setup` builds.
PY      := .venv/bin/python
MODEL   ?= .models/qwen3-next-tiny
ARCH    ?= qwen3_next
PORT    ?= 30000
TRACES  ?= ../shared/traces
SGLANG_WHEEL = $(firstword $(wildcard .cache/wheels/sglang-0.5.23-*.whl))
# The git repository of pristine upstream + one commit per patch (docs/patches.md).
QUEUE   ?= .patch-queue
NO_WHEEL = $(error no .cache/wheels/sglang-0.5.23-*.whl: run make setup first)

.PHONY: setup serve model test lint format check-patches patches-import patches-export patches-rebase bench-replay gpu-wheels agents test-agents clean

setup:
	bash scripts/setup.sh

$(MODEL)/config.json: | setup
	$(PY) -m sglang.test.tiny_models --arch $(ARCH) --out $(MODEL)

model: $(MODEL)/config.json

serve: setup model
	bash scripts/serve.sh $(MODEL) $(PORT) $(ARGS)

check-patches: setup
	$(PY) scripts/patch_queue.py check --wheel $(SGLANG_WHEEL)

# Edit the series as git commits: import, commit in $(QUEUE), export (FORCE=1 replaces a queue).
patches-import:
	python3 scripts/patch_queue.py import --wheel $(or $(SGLANG_WHEEL),$(NO_WHEEL)) --dir $(QUEUE) $(if $(FORCE),--force)

patches-export:
	python3 scripts/patch_queue.py export --dir $(QUEUE)

# Upstream bump: make patches-rebase WHEEL=path/to/sglang-NEW-*.whl
patches-rebase:
	python3 scripts/patch_queue.py rebase --wheel $(or $(WHEEL),$(error WHEEL=path/to/the/new/sglang wheel)) --dir $(QUEUE)

# Our C++ and CUDA sources (git-tracked, so a build tree is never linted).
CXX_SOURCES = $(shell git ls-files 'sgl-kernel/*.cpp' 'sgl-kernel/*.h' 'sgl-kernel/*.cu')

lint: setup
	$(PY) -m ruff check .
	$(PY) -m ruff format --check .
	.venv/bin/clang-format --dry-run --Werror $(CXX_SOURCES)

format: setup
	$(PY) -m ruff check --fix .
	$(PY) -m ruff format .
	.venv/bin/clang-format -i $(CXX_SOURCES)

# The agent clients are installed first (cached in .cache/agents; cold ~2.5-4.5 min): their e2e
# tests (test/e2e/test_endpoints_agent_clients.py) run with the rest and fail without them;
# SGLANG_TEST_SKIP_AGENTS=1 (no npm registry) skips both the install and those tests.
test: setup lint check-patches $(if $(filter 1,$(SGLANG_TEST_SKIP_AGENTS)),,agents)
	$(PY) -m pytest test -q -ra --durations=25

bench-replay: setup model
	$(PY) benchmark/e2e/agent_replay.py --traces $(TRACES)

# The cp312 wheels scripts/gpu_checks.sh installs on the lent GPU machine (no registry there),
# into .gpu-wheels/; prints their size and the working tree's against the 64 MiB a call carries.
gpu-wheels:
	python3 scripts/gpu_carry.py download
	python3 scripts/gpu_carry.py size

# The agent clients (OpenClaw, OpenCode, Claude Code) at pinned versions into .cache/agents.
agents:
	bash scripts/install_agents.sh

# Only the clients' turns against the real server (test/e2e/test_endpoints_agent_clients.py,
# also part of `make test`); the install is skipped when .cache/agents holds the pinned set.
test-agents: setup agents
	$(PY) -m pytest test/e2e/test_endpoints_agent_clients.py -q -ra

clean:
	rm -rf .venv .models .cache .gpu-wheels .gpu-checks sgl-kernel/build
