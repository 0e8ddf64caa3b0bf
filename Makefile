# The two commands of the README: `make run` (the main job: a short training run) and `make test`.
# Both create .venv on first use and install the project with its test extras into it.
# torch is pinned to 2.13.0 here because that CPU wheel is what a fresh CPU machine can install
# without pulling several GB of CUDA packages; on a GPU machine install the project over the
# torch that is already there (see README).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0
# The Hugging Face integration is tested on the newest transformers the test extra allows (in .venv)
# and on the oldest (here): its tests run a second time against it.
OLDEST_VENV ?= .venv-transformers-oldest
OLDEST_PY := $(OLDEST_VENV)/bin/python
OLDEST_TRANSFORMERS ?= transformers==4.57.6
HF_TESTS := tests/test_huggingface.py tests/test_huggingface_batches.py tests/test_huggingface_model_ops.py

.PHONY: run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,train]"
	touch $@

$(OLDEST_VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(OLDEST_VENV)
	$(OLDEST_PY) -m pip install --quiet --upgrade pip
	$(OLDEST_PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(OLDEST_PY) -m pip install --quiet -e ".[test]" "$(OLDEST_TRANSFORMERS)"
	touch $@

run: $(VENV)/.installed
	$(PY) -m fused_remat.train --out runs/main $(if $(wildcard runs/main/checkpoint.pt),--resume)

test: $(VENV)/.installed $(OLDEST_VENV)/.installed
	$(PY) -m pytest -q -n auto -p no:cacheprovider --benchmark-disable
	$(OLDEST_PY) -m pytest -q -n auto -p no:cacheprovider --benchmark-disable $(HF_TESTS)
clean:
	rm -rf $(VENV) $(OLDEST_VENV) build *.egg-info
