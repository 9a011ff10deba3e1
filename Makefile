# make demo   - set up .venv and run the main job (doctor, kernel demo, SGLang serving demos: a tiny Llama, a tiny V4)
# make test   - set up .venv and run the CPU test suite and the real-engine tests (what CI runs)
# make test-gpu - run the GPU tests (on a machine with a CUDA or MUSA GPU)
VENV ?= .venv
PY := $(VENV)/bin/python

.PHONY: setup demo test test-oracles test-gpu
setup:
	VENV=$(VENV) scripts/setup_env.sh

demo: setup
	VENV=$(VENV) scripts/demo.sh

test: setup
	$(PY) -m pytest tests integration_tests
	$(MAKE) --no-print-directory test-oracles

# tile-kernels 2.1.0 (and the TileLang 0.1.15 it needs) from $(VENV)/oracles: its torch references as oracles
test-oracles: setup
	PYTHONPATH=$(VENV)/oracles $(PY) -m pytest -m tilekernels tests/dsv4/test_tilekernels_oracles.py

test-gpu: setup
	$(PY) -m pytest -m gpu tests
