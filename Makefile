# attnlab: the two commands a newcomer needs are `make demo` and `make test`; `make notebooks` opens
# the tutorials as notebooks in JupyterLab.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# A pinned torch keeps pip from pulling the newest CUDA build (several GB) on a CPU machine;
# override with `make TORCH_SPEC=torch demo` to take whatever your index serves.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install install-test notebooks bench clean

$(VENV)/.installed: pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	@$(PY) -c "import torch" 2>/dev/null || $(PIP) install -q "$(TORCH_SPEC)"
	$(PIP) install -q -e ".[models]"
	@touch $@

$(VENV)/.installed-test: $(VENV)/.installed
	$(PIP) install -q -e ".[test]"
	@touch $@

$(VENV)/.installed-notebooks: $(VENV)/.installed
	$(PIP) install -q -e ".[notebooks]"
	@touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/attnlab explain

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2

notebooks: $(VENV)/.installed-notebooks
	$(VENV)/bin/jupyter lab notebooks

bench: $(VENV)/.installed
	$(VENV)/bin/attnlab bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis
