# make demo  — set up .venv from the project's own files, then run the main job (shapes GRPO on the tiny SD3)
# make test  — set up .venv, then run the whole test suite
# make bench — set up .venv, then run every benchmark in --quick mode
# grove needs Python >= 3.12 (LeRobot 0.6's π0 / π0.5 import path uses PEP 695 syntax): the first of python3.12,
# a pyenv 3.12, python3, python3.13, a pyenv 3.13 that runs and is >= 3.12; override with make PYTHON=...
ifeq ($(origin PYTHON), undefined)
PYTHON := $(shell for p in python3.12 $$HOME/.pyenv/versions/3.12*/bin/python3 python3 python3.13 \
	$$HOME/.pyenv/versions/3.13*/bin/python3; do $$p -c 'import sys; assert sys.version_info >= (3, 12)' \
	2>/dev/null && { command -v $$p || echo $$p; } && break; done)
endif
VENV ?= .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.grove-installed
export MUJOCO_GL ?= egl
export PYOPENGL_PLATFORM ?= egl
export HF_HUB_OFFLINE ?= 1
export TOKENIZERS_PARALLELISM ?= false

.PHONY: setup demo test bench clean

$(STAMP): pyproject.toml constraints.txt
	@test -n "$(PYTHON)" || { echo "grove: error: no Python >= 3.12 found (tried python3.12, python3, python3.13, \
	~/.pyenv/versions/3.1[23]*); install one or run make PYTHON=/path/to/python3.12" >&2; exit 2; }
	@if test -x $(PY) && ! $(PY) -c 'import sys; assert sys.version_info >= (3, 12)' 2>/dev/null; then \
		echo "grove: $(VENV) is an older Python; rebuilding it with $(PYTHON)"; rm -rf $(VENV); fi
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
BENCHMARKS := scale llm robotics-sim robotics-libero robotics-libero-rl robotics-demos robotics-world-model robotics-wm-probe visgen-trees visgen-rewards visgen-methods \
	visgen-two-stage visgen-video gpu gpu-two-stage cold-start

bench: setup
	@set -e; for b in $(BENCHMARKS); do echo "== grove bench $$b --quick"; \
		$(VENV)/bin/grove bench $$b --quick --out runs/bench-$$b; done

clean:
	rm -rf runs .pytest_cache
