"""Every public name has a docstring with an example, and every example runs (doctest)."""

from __future__ import annotations

import doctest
import importlib
import inspect
import pkgutil

import pytest

import attnlab

# Command modules are documented by their --help text (tested elsewhere), not by doctests.
SKIP_PREFIXES = ("attnlab.lab.cli", "attnlab.__main__")


def _modules():
    names = ["attnlab"]
    for info in pkgutil.walk_packages(attnlab.__path__, prefix="attnlab."):
        if not info.name.startswith(SKIP_PREFIXES) and not info.name.split(".")[-1].startswith("_"):
            names.append(info.name)
    return sorted(names)


def _public_objects(module):
    names = getattr(module, "__all__", None)
    if names is None:
        names = [n for n in vars(module) if not n.startswith("_")]
    for name in names:
        obj = getattr(module, name, None)
        defined_here = getattr(obj, "__module__", None) == module.__name__
        if (inspect.isfunction(obj) or inspect.isclass(obj)) and defined_here:
            yield name, obj


MODULES = _modules()


@pytest.mark.parametrize("module_name", MODULES)
def test_public_names_have_docstrings_with_examples(module_name):
    module = importlib.import_module(module_name)
    missing = [
        name
        for name, obj in _public_objects(module)
        if "Example" not in (inspect.getdoc(obj) or "")
    ]
    assert not missing, f"{module_name}: public names without a docstring example: {missing}"


@pytest.mark.parametrize("module_name", MODULES)
def test_docstring_examples_run(module_name):
    module = importlib.import_module(module_name)
    importlib.import_module("torch").manual_seed(0)  # the same draws whichever tests ran before in this process
    finder = doctest.DocTestFinder(exclude_empty=True)
    runner = doctest.DocTestRunner(optionflags=doctest.ELLIPSIS | doctest.NORMALIZE_WHITESPACE)
    for test in finder.find(module, module_name, extraglobs={"torch": importlib.import_module("torch")}):
        runner.run(test)
    result = runner.summarize(verbose=False)
    assert result.failed == 0, f"{result.failed} doctest example(s) failed in {module_name}"
