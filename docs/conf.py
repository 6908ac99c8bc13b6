"""Sphinx configuration of attnlab's site: `make docs` builds it into docs/_build/html (docs/site.md).

The guides are the Markdown files of docs/ (MyST), the API reference is one page per public name
(autosummary, from the Google-style docstrings through napoleon), and the notebooks of notebooks/ are
executed into pages by MyST-NB. Sphinx reads only this folder, so the notebooks are copied into
docs/notebooks/ (ignored by git) each build, every notebooks/*.ipynb by glob.
"""

from __future__ import annotations

import importlib
import importlib.util
import inspect
import pkgutil
import re
import shutil
import sys
from pathlib import Path

DOCS = Path(__file__).resolve().parent
ROOT = DOCS.parent


project = "attnlab"
author = "attnlab contributors"
copyright = "attnlab contributors"
root_doc = "index"

extensions = [
    "sphinx.ext.autodoc",
    "sphinx.ext.autosummary",
    "sphinx.ext.napoleon",
    "myst_nb",  # MyST Markdown (the guides) and executed notebooks
]
templates_path = ["_templates"]
exclude_patterns = ["_build", "**/.ipynb_checkpoints"]

# The API reference: one page per public name, generated at build time into api/generated (ignored by git).
autosummary_generate = True
autosummary_imported_members = False
autodoc_typehints = "description"
autodoc_typehints_description_target = "documented_params"
autodoc_member_order = "bysource"
autodoc_class_signature = "separated"
napoleon_google_docstring = True
napoleon_numpy_docstring = False
napoleon_use_rtype = False
napoleon_attr_annotations = True

# Markdown: GitHub's heading anchors (the guides link "#the-fast-paths---walk" as a repository page does).
myst_heading_anchors = 4
myst_enable_extensions = ["dollarmath", "colon_fence"]

# Notebooks: executed at build time (stored without outputs), cached by content in _build/.jupyter_cache
# so that a rebuild with unchanged notebooks runs none; a cell that raises fails the build, and so does
# a cell that writes to stderr (the suite holds the notebooks to the same rule).
nb_execution_mode = "cache"
nb_execution_cache_path = str(DOCS / "_build" / ".jupyter_cache")
nb_execution_timeout = 600
nb_execution_raise_on_error = True
nb_execution_show_tb = True
nb_output_stderr = "warn"
nb_merge_streams = True

# Cross-references are checked (-n): every name a signature or docstring mentions must resolve, except
# types of other libraries (no intersphinx: the build runs offline).
nitpicky = True
nitpick_ignore_regex = [
    (r"py:.*", r"(torch|numpy|np|transformers|safetensors|collections|typing|typing_extensions|pathlib|os)\b.*"),
    (r"py:class", r"(nn\.)?Module"),  # torch.nn.Module as annotations write it (``nn.Module``)
]

html_theme = "pydata_sphinx_theme"
html_title = "attnlab"
html_static_path: list[str] = []
html_theme_options = {
    "navigation_with_keys": False,
    "show_toc_level": 2,
    "header_links_before_dropdown": 5,
    "secondary_sidebar_items": ["page-toc"],
    "footer_start": ["copyright"],
    "footer_end": [],
}
html_show_sourcelink = False
# The theme's script reads the light/dark mode from this (empty, it logs a console error on a first visit).
html_context = {"default_mode": "auto"}


def notebook_slug(path: Path) -> str:
    """The page name of a notebook: "6 Attention in a real model.ipynb" -> "6-attention-in-a-real-model"."""
    return re.sub(r"[^a-z0-9]+", "-", path.stem.lower()).strip("-")


def copy_notebooks(source: Path, target: Path) -> list[str]:
    """Mirror ``source``/*.ipynb into ``target`` under their slugs (unchanged files are not rewritten, so
    the execution cache and Sphinx's environment keep them); returns the page names in order."""
    target.mkdir(exist_ok=True)
    names = []
    for path in sorted(source.glob("*.ipynb")):
        names.append(notebook_slug(path))
        copy = target / f"{names[-1]}.ipynb"
        if not copy.exists() or copy.read_bytes() != path.read_bytes():
            shutil.copyfile(path, copy)
    for stale in target.glob("*.ipynb"):
        if stale.stem not in names:
            stale.unlink()
    return names


NOTEBOOKS = copy_notebooks(ROOT / "notebooks", DOCS / "notebooks")

# The public modules of the API reference, in the order of the site's menu; each page lists every name
# of the module's __all__ (submodules it re-exports and __version__ aside), one generated page per name.
API_MODULES = {
    "attnlab": "The core functions",
    "attnlab.nn": "Modules (attnlab.nn)",
    "attnlab.masks": "Masks (attnlab.masks)",
    "attnlab.scores": "Score mods (attnlab.scores)",
    "attnlab.backends": "Backends (attnlab.backends)",
    "attnlab.linear": "Linear attention (attnlab.linear)",
    "attnlab.models": "Models (attnlab.models)",
    "attnlab.distributed": "Context parallelism (attnlab.distributed)",
    "attnlab.io": "Safe weights (attnlab.io)",
    "attnlab.integrations.transformers": "The transformers integration",
}


def public_names(module_name: str) -> dict[str, list[str]]:
    """The names of ``module_name.__all__`` by kind: functions, classes and data (submodules left out)."""
    module = importlib.import_module(module_name)
    kinds: dict[str, list[str]] = {"Functions": [], "Classes": [], "Constants": []}
    for name in module.__all__:
        value = getattr(module, name)
        if inspect.ismodule(value) or name.startswith("__"):
            continue
        kind = "Classes" if inspect.isclass(value) else "Functions" if callable(value) else "Constants"
        kinds[kind].append(name)
    return kinds


def shadowed(module_name: str, name: str) -> bool:
    """Whether ``module_name.name`` is also a submodule (``attnlab.backends.verdicts`` is a function and
    a module): autosummary would import and document the module, so these pages are written here."""
    return importlib.util.find_spec(module_name).submodule_search_locations is not None and \
        importlib.util.find_spec(f"{module_name}.{name}") is not None


def _is_module(parent: str, leaf: str) -> bool:
    return inspect.ismodule(getattr(importlib.import_module(parent), leaf, None))


def shadowed_entries(target: Path, module_name: str, names: list[str]) -> list[str]:
    """Pages for shadowed names (autodoc's ``module::name`` form picks the attribute), and their links."""
    lines = []
    for name in names:
        title = f"{module_name}.{name}"
        text = "\n".join([title, "=" * len(title), "", f".. currentmodule:: {module_name}", "",
                          f".. autofunction:: {module_name}::{name}", ""])
        page = target / f"{title}.rst"
        if not page.exists() or page.read_text() != text:
            page.write_text(text)
        lines += [f"* :func:`{title}`"]
    if not names:
        return []
    return [*lines, "", ".. toctree::", "   :hidden:", "", *(f"   {module_name}.{n}" for n in names), ""]


def write_api_pages(target: Path) -> None:
    """One page per module of API_MODULES in ``target``: its docstring, then an autosummary table per
    kind whose entries autosummary turns into one page each (rewritten only when changed)."""
    target.mkdir(parents=True, exist_ok=True)
    for module_name, title in API_MODULES.items():
        lines = [title, "=" * len(title), "", f".. automodule:: {module_name}", "   :no-members:", "",
                 f".. currentmodule:: {module_name}", ""]
        for kind, names in public_names(module_name).items():
            if names:
                lines += [kind, "-" * len(kind), "", ".. autosummary::", "   :toctree: .", "   :nosignatures:", "",
                          *(f"   {name}" for name in names if not shadowed(module_name, name)), ""]
                lines += shadowed_entries(target, module_name, [n for n in names if shadowed(module_name, n)])
        page = target / f"{module_name}.rst"
        text = "\n".join(lines)
        if not page.exists() or page.read_text() != text:
            page.write_text(text)


def library_modules() -> list[str]:
    """Every module of the package whose dotted name has no private part, in import order."""
    import attnlab  # the package as installed into the venv that runs the build

    names = ["attnlab", *(m.name for m in pkgutil.walk_packages(attnlab.__path__, "attnlab."))]
    return [name for name in names if not any(part.startswith("_") for part in name.split("."))]


def write_module_page(page: Path) -> None:
    """The modules page: each public module's docstring (what it holds and why), so that a docstring's
    :mod: reference to any module lands somewhere; the API pages above document the names."""
    lines = ["Modules", "=======", "",
             "What each module of the package holds, from its docstring. The public names are documented",
             "on the pages of the :doc:`API reference </api/index>`.", ""]
    for name in library_modules():
        parent, _, leaf = name.rpartition(".")
        if name in API_MODULES or shadowed(parent, leaf) and not _is_module(parent, leaf):
            continue  # an API page carries its docstring, or the name is a function's page
        lines += [name, "-" * len(name), "", f".. automodule:: {name}", "   :no-members:", ""]
    text = "\n".join(lines)
    if not page.exists() or page.read_text() != text:
        page.write_text(text)


write_api_pages(DOCS / "api" / "generated")
write_module_page(DOCS / "api" / "generated" / "modules.rst")


def resolve_existing(app, env, node, contnode):
    """A Python reference no page documents under its written name, resolved as the code resolves it.

    Docstrings name things where they live (``attnlab.backends.base.Backend``, or ``Backend.prepare``
    relative to the module): when the object is documented under a public name
    (``attnlab.backends.Backend``), the reference links to that page; when it exists but has no page (a
    helper of a module), it stays as code text without a link. A reference to nothing that exists
    stays unresolved and -n reports it: a misspelt or stale name fails the build."""
    if node.get("refdomain") != "py":
        return None
    value = _find(node)
    if value is _MISSING:
        return None
    domain = env.get_domain("py")
    for public, entry in domain.objects.items():
        if public.startswith("attnlab") and not entry.aliased and _lookup(public) is value:
            return domain.resolve_xref(env, node.get("refdoc"), app.builder, node.get("reftype"),
                                       public, node, contnode)
    return contnode


_MISSING = object()


def _find(node):
    """The object a Python reference names, tried as written, then in its module and class."""
    target = node.get("reftarget", "").lstrip("~.")
    module, cls = node.get("py:module"), node.get("py:class")
    candidates = [target]
    if module:
        candidates += [f"{module}.{cls}.{target}", f"{module}.{target}"] if cls else [f"{module}.{target}"]
    # a name a module's docstring uses unqualified: any module of the package that defines it
    first = target.split(".")[0]
    candidates += [f"{name}.{target}" for name, mod in list(sys.modules.items())
                   if name.startswith("attnlab") and first in vars(mod or object)]
    for dotted in candidates:
        if dotted.startswith("attnlab"):
            value = _lookup(dotted)
            if value is not _MISSING:
                return value
    return _MISSING


def _lookup(dotted: str):
    """The object at ``dotted`` (the longest importable module, then attributes), or _MISSING."""
    parts = dotted.split(".")
    for cut in range(len(parts), 0, -1):
        try:
            value = importlib.import_module(".".join(parts[:cut]))
        except ImportError:
            continue
        for part in parts[cut:]:
            try:
                value = getattr(value, part)
            except AttributeError:  # lazily imported attributes raise it too when absent
                return _MISSING
        return value
    return _MISSING


def setup(app):
    app.connect("missing-reference", resolve_existing)
