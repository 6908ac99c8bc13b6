# attnlab: the two commands a newcomer needs are `make demo` and `make test`; `make notebooks` opens
# the tutorials as notebooks in JupyterLab; `make docs` builds the site into docs/_build/html and checks it.
PYTHON ?= python3
VENV   ?= .venv
PY     := $(VENV)/bin/python
PIP    := $(PY) -m pip
# A pinned torch keeps pip from pulling the newest CUDA build (several GB) on a CPU machine;
# override with `make TORCH_SPEC=torch demo` to take whatever your index serves.
TORCH_SPEC ?= torch==2.13.0

.PHONY: demo test install install-test notebooks docs bench clean

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

$(VENV)/.installed-docs: $(VENV)/.installed
	$(PIP) install -q -e ".[docs]"
	@touch $@

install: $(VENV)/.installed

install-test: $(VENV)/.installed-test

demo: $(VENV)/.installed
	$(VENV)/bin/attnlab explain

test: $(VENV)/.installed-test
	$(PY) -m pytest -q -n 2

notebooks: $(VENV)/.installed-notebooks
	$(VENV)/bin/jupyter lab notebooks

# The site is built anew each time: a docstring edit is seen, no page of an older build or of a removed
# API name is left; the notebooks run again only when they changed (cached in docs/_build/.jupyter_cache).
# Warnings are errors (-W, all listed by --keep-going) and every cross-reference must resolve (-n); then
# tools/check_site.py: internal links and anchors, and pages opened in headless chromium.
docs: $(VENV)/.installed-docs
	rm -rf docs/_build/html docs/api/generated
	$(PY) -m sphinx -b html -W --keep-going -n docs docs/_build/html
	$(PY) tools/check_site.py docs/_build/html

bench: $(VENV)/.installed
	$(VENV)/bin/attnlab bench

clean:
	rm -rf $(VENV) build dist src/*.egg-info .pytest_cache .hypothesis docs/_build docs/notebooks docs/api/generated
