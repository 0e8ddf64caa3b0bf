# The two commands of the README: `make run` (the main job: a short training run) and `make test`.
# Both create .venv on first use and install the project with its test extras into it.
# torch is pinned to 2.13.0 here because that CPU wheel is what a fresh CPU machine can install
# without pulling several GB of CUDA packages; on a GPU machine install the project over the
# torch that is already there (see README).

PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
TORCH_SPEC ?= torch==2.13.0

.PHONY: run test clean

$(VENV)/.installed: pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet "$(TORCH_SPEC)"
	$(PY) -m pip install --quiet -e ".[test,plot]"
	touch $@

run: $(VENV)/.installed
	$(PY) -m fused_remat.train --out runs/main $(if $(wildcard runs/main/checkpoint.pt),--resume)

test: $(VENV)/.installed
	$(PY) -m pytest -q -n auto -p no:cacheprovider --benchmark-disable
clean:
	rm -rf $(VENV) build *.egg-info
