# Everything runs from the virtual environment at .venv/ that `make setup` builds.
PY      := .venv/bin/python
MODEL   ?= .models/qwen3-next-tiny
ARCH    ?= qwen3_next
PORT    ?= 30000
TRACES  ?= ../shared/traces
SGLANG_WHEEL = $(firstword $(wildcard .cache/wheels/sglang-0.5.23-*.whl))

.PHONY: setup serve model test test-fast check-patches bench-replay clean

setup:
	bash scripts/setup.sh

$(MODEL)/config.json: | setup
	$(PY) -m sglang.test.tiny_models --arch $(ARCH) --out $(MODEL)

model: $(MODEL)/config.json

serve: setup model
	bash scripts/serve.sh $(MODEL) $(PORT) $(ARGS)

check-patches: setup
	$(PY) scripts/patch_queue.py check --wheel $(SGLANG_WHEEL)

test: setup check-patches
	$(PY) -m pytest test -q -ra

bench-replay: setup model
	$(PY) benchmark/e2e/agent_replay.py --traces $(TRACES)

clean:
	rm -rf .venv .models .cache sgl-kernel/build
