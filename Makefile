# make demo  — set up .venv from the project's own files, then run the main job (shapes GRPO on the tiny SD3)
# make test  — set up .venv, then run the whole test suite
# make bench — set up .venv, then run every benchmark in --quick mode
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grove-installed
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade "pip>=24"
	$(PY) -m pip install -q -c constraints.txt -e ".[dev,robotics,ocr]"
	$(PY) -m pip install -q --no-deps -c constraints.txt lerobot
	@touch $(STAMP)

setup: $(STAMP)

demo: setup
	$(VENV)/bin/grove train

test: setup
	$(PY) -m pytest -q

# every registered benchmark (grove list names them; tests/core/test_docs_match.py keeps this list complete): the
# gpu ones write a page saying they were not run on a machine without CUDA (gpu) or run their CPU rehearsal
# (gpu-two-stage)
BENCHMARKS := scale llm robotics-sim robotics-world-model visgen-trees visgen-rewards visgen-methods \
	visgen-two-stage visgen-video gpu gpu-two-stage

bench: setup
	@set -e; for b in $(BENCHMARKS); do echo "== grove bench $$b --quick"; \
		$(VENV)/bin/grove bench $$b --quick --out runs/bench-$$b; done

clean:
	rm -rf runs .pytest_cache
