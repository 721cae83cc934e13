# make demo  — set up .venv from the project's own files, then run the main job (shapes GRPO on the tiny SD3)
# make test  — set up .venv, then run the whole test suite
# make bench — set up .venv, then run the quick benchmarks
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

bench: setup
	$(VENV)/bin/grove bench scale --quick --out runs/bench-scale
	$(VENV)/bin/grove bench visgen-trees --quick --out runs/bench-visgen-trees
	$(VENV)/bin/grove bench visgen-rewards --quick --out runs/bench-visgen-rewards
	$(VENV)/bin/grove bench visgen-methods --quick --out runs/bench-visgen-methods
	$(VENV)/bin/grove bench visgen-two-stage --quick --out runs/bench-visgen-two-stage
	$(VENV)/bin/grove bench visgen-video --quick --out runs/bench-visgen-video
	$(VENV)/bin/grove bench llm --quick --out runs/bench-llm
	$(VENV)/bin/grove bench robotics-sim --quick --out runs/bench-robotics-sim

clean:
	rm -rf runs .pytest_cache
