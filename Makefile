# segkv developer commands. `make test` works on a fresh machine: it creates the virtual
# environment, installs what is missing (a CPU torch where none is importable) and runs
# the suite.
PYTHON ?= python3
VENV ?= .venv
BIN := $(VENV)/bin
# Used only when the environment has no torch yet; any torch >= 2.4 works.
TORCH_SPEC ?= torch==2.13.0
PYTEST_WORKERS ?= 2

.PHONY: install install-runtime test bench-memory run clean chromium
PORT ?= 8000

$(BIN)/python:
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install -q --upgrade pip

# Serving needs the runtime dependencies only; the test extras (transformers, playwright,
# triton, hypothesis...) are installed by `make test`. Each stamp records what is installed.
$(VENV)/.runtime: pyproject.toml | $(BIN)/python
	$(BIN)/python -c "import torch" 2>/dev/null || $(BIN)/python -m pip install -q "$(TORCH_SPEC)"
	$(BIN)/python -m pip install -q -e .
	touch $@

$(VENV)/.installed: $(VENV)/.runtime
	$(BIN)/python -m pip install -q -e ".[test]"
	touch $@

install-runtime: $(VENV)/.runtime
install: $(VENV)/.installed

# The dashboard is tested in Debian's Chromium (Playwright's own browser download is unreachable).
chromium:
	@command -v chromium >/dev/null 2>&1 || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)

test: install chromium
	$(BIN)/python -m pytest -q -n $(PYTEST_WORKERS) --dist worksteal tests

bench-memory: install
	$(BIN)/python -m benchmarks.cache_memory

# The main job: the OpenAI-compatible server with the built-in default model.
run: install-runtime
	$(BIN)/segkv serve --model default --port $(PORT)

clean:
	rm -rf $(VENV) build *.egg-info
