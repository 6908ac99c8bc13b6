"""The package's imports go one way: down the layers of docs/design.md, with no cycle.

The package has two parts, told apart by path. The **lab** is every module under
``src/attnlab/lab/`` (tutorial, explain, viz, train and trained, lens, verify, zoo, bench, the
command line): it teaches and measures, and sits above the library. Everything else is the
**library** (the core: masks, functional, backends, nn, io, models, integrations, distributed and
the private low-level modules): what a model needs. The lab imports the library, never the
reverse, and no lab module sits outside ``lab/``: a library module that imports the lab or the
lab's own dependencies (matplotlib, rich, typer) is refused.

Every ``import`` statement in ``src/attnlab`` is read from the source (module level and inside
functions alike, so a lazy import cannot hide an upward edge), resolved to the attnlab module it
names, and checked against the layer table below; a fresh interpreter checks what ``import
attnlab`` really loads.
"""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "attnlab"

# Lower number = lower layer. A module may import its own layer or any lower one.
CORE = [
    ("attnlab._checks", 0), ("attnlab._flops", 0), ("attnlab._memory", 0),
    ("attnlab.masks", 1), ("attnlab.scores", 1),
    ("attnlab._call", 2),
    ("attnlab._math", 3),
    ("attnlab.backends", 4),
    ("attnlab.functional", 5), ("attnlab.linear", 5),
    ("attnlab.nn", 6), ("attnlab.io", 6), ("attnlab.integrations", 6), ("attnlab.distributed", 6),
    ("attnlab.models", 7),
    ("attnlab", 8),  # the root package re-exports the library's API
]
LAB_PACKAGE = "attnlab.lab"  # every module below it is lab, every other module library
LAB = [
    ("attnlab.lab", 9),  # the lab package itself imports nothing
    ("attnlab.lab.tutorial", 9),
    ("attnlab.lab.explain", 10), ("attnlab.lab.walks", 10), ("attnlab.lab.viz", 10), ("attnlab.lab.verify", 10), ("attnlab.lab.bench", 10),
    ("attnlab.lab.train", 10), ("attnlab.lab.trained", 10), ("attnlab.lab.lens", 10), ("attnlab.lab.zoo", 10),
    ("attnlab.lab.cli", 11),
]
# ``python -m attnlab``: a shim at the root that calls the command line; nothing imports it.
MAIN_SHIM = ("attnlab.__main__", 12)
LAYERS = CORE + LAB + [MAIN_SHIM]

# The imports from the library into the lab: the root's PEP 562 ``__getattr__`` imports
# ``attnlab.lab.tutorial`` when ``attnlab.tutorial`` is first read, and ``attnlab.lab.viz.views`` when
# ``attnlab.show`` is, so ``import attnlab`` loads no lab.
LAZY_LAB_IMPORTS = {("attnlab", "attnlab.lab.tutorial", "__getattr__"),
                    ("attnlab", "attnlab.lab.viz.views", "__getattr__")}
# The one module-level import of the lab outside it: the ``python -m attnlab`` shim.
SHIM_IMPORTS = {("attnlab.__main__", "attnlab.lab.cli", None)}
# The lab's names at the root before it had its own package: none may come back there.
OLD_LAB_NAMES = ("tutorial", "explain", "viz", "train", "trained", "lens", "verify", "zoo", "bench", "cli")

# The lab's own dependencies: no library module imports them, not even inside a function.
LAB_DEPENDENCIES = ("matplotlib", "rich", "typer")


class Edge(NamedTuple):
    target: str  # the attnlab module (or, for external_imports, the top-level package) imported
    top_level: bool  # a statement of the module body itself
    line: int
    function: str | None  # the innermost enclosing function, None outside any


def _entry(module: str) -> tuple[str, int]:
    """The ``(prefix, layer)`` of the longest prefix of ``module`` in LAYERS."""
    best = None
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    if best is None:
        raise AssertionError(f"{module} is not in the layer table of tests/test_layers.py")
    return best


def layer_of(module: str) -> int:
    return _entry(module)[1]


def in_lab(module: str) -> bool:
    """By path: a module is lab exactly when it lives under ``src/attnlab/lab/``."""
    return module == LAB_PACKAGE or module.startswith(LAB_PACKAGE + ".")


def module_name(path: Path) -> str:
    parts = list(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def all_modules() -> dict[str, Path]:
    return {module_name(path): path for path in sorted(PACKAGE.rglob("*.py"))}


def _resolve(name: str, modules: dict[str, Path]) -> str:
    """The attnlab module a dotted name refers to (``attnlab.x.func`` -> ``attnlab.x``)."""
    while name not in modules and "." in name:
        name = name.rsplit(".", 1)[0]
    return name


def _imports(tree: ast.Module, package: str):
    """(dotted names imported, node, enclosing function) for every import statement in ``tree``."""

    def walk(node: ast.AST, function: str | None):
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.Import):
                yield [alias.name for alias in child.names], child, function
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    kept = package.split(".")[: len(package.split(".")) - child.level + 1]
                    base = ".".join(kept + ([base] if base else []))
                yield [f"{base}.{alias.name}" for alias in child.names], child, function
            inner = child.name if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)) else function
            yield from walk(child, inner)

    yield from walk(tree, None)


def imports_of(path: Path, modules: dict[str, Path]) -> list[Edge]:
    """Every import of an attnlab module in ``path``."""
    return imports_in(path.read_text(), _package_of(path), modules)


def _package_of(path: Path) -> str:
    name = module_name(path)
    return name if path.name == "__init__.py" else name.rsplit(".", 1)[0]


def imports_in(source: str, package: str, modules: dict[str, Path]) -> list[Edge]:
    """As :func:`imports_of`, for source text of a module inside ``package``."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    return [Edge(_resolve(name, modules), id(node) in top_level, node.lineno, function)
            for names, node, function in _imports(tree, package)
            for name in names if name == "attnlab" or name.startswith("attnlab.")]


def external_imports(source: str, package: str) -> list[Edge]:
    """Every import of a package other than attnlab, by its top-level name."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    return [Edge(name.split(".")[0], id(node) in top_level, node.lineno, function)
            for names, node, function in _imports(tree, package)
            for name in names if name.split(".")[0] != "attnlab"]


def _sanctioned(name: str, edge: Edge) -> bool:
    return (name, edge.target, edge.function) in LAZY_LAB_IMPORTS | SHIM_IMPORTS


def refusals_outside_the_lab(name: str, source: str, modules: dict[str, Path]) -> list[str]:
    """Why the library module ``name`` (at the root or under a library folder) is really lab: each
    import of the lab (but the sanctioned ones) or of the lab's dependencies, as ``line: target``."""
    package = name if name == "attnlab" else name.rsplit(".", 1)[0]
    lab = [f"{edge.line}: {edge.target}" for edge in imports_in(source, package, modules)
           if in_lab(edge.target) and not _sanctioned(name, edge)]
    return lab + [f"{edge.line}: {edge.target}" for edge in external_imports(source, package)
                  if edge.target in LAB_DEPENDENCIES]


def test_every_module_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_the_lab_sits_above_the_library():
    assert max(rank for _, rank in CORE) < min(rank for _, rank in LAB)
    lab = sorted(name for name in all_modules() if in_lab(name))
    assert "attnlab.lab.tutorial" in lab and "attnlab.lab.cli._cp_check" in lab and "attnlab.lab.viz.html" in lab
    assert "attnlab.lab.train.loop" in lab
    assert not any(in_lab(name) for name in ("attnlab", "attnlab.nn.multihead", "attnlab.distributed.ring",
                                             "attnlab.__main__", "attnlab.labels", "attnlab.masks.spans"))


def test_the_layer_table_follows_the_paths():
    """The table's lab rows are the folders under ``lab/`` and its library rows are not; every
    module's part is the one its path gives."""
    assert all(in_lab(prefix) for prefix, _ in LAB) and not any(in_lab(prefix) for prefix, _ in CORE)
    lab_files = {module_name(path) for path in (PACKAGE / "lab").rglob("*.py")}
    assert lab_files == {name for name in all_modules() if in_lab(name)}


def test_no_lab_module_sits_at_the_root():
    """The lab's old modules and folders are gone from the root (their names live in ``attnlab.lab``)."""
    left = [name for name in OLD_LAB_NAMES
            if (PACKAGE / f"{name}.py").exists() or any((PACKAGE / name).rglob("*.py"))]
    assert left == [], f"lab modules at the package root: {left}"


def test_the_old_lab_import_paths_are_gone():
    """``import attnlab.viz`` and the like fail (README.md's table gives the new paths); a folder left
    behind by the move with only ``__pycache__`` in it would make them import as empty namespace
    packages instead, so it is named here to be deleted."""
    stale = [name for name in OLD_LAB_NAMES if (PACKAGE / name).is_dir()]
    assert stale == [], f"folders left at src/attnlab by the lab's move (delete them): {stale}"
    script = "\n".join([
        "import importlib.util, attnlab",
        f"print([n for n in {OLD_LAB_NAMES!r} if importlib.util.find_spec('attnlab.' + n) is not None])",
    ])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert result.returncode == 0 and result.stdout.strip() == "[]", (result.stdout, result.stderr[-2000:])


def test_no_module_outside_the_lab_is_lab_by_its_imports():
    """A module at the root or under a library folder that imports the lab or matplotlib, rich or
    typer (module level or in a function) belongs in ``lab/``; the root's lazy attributes and the
    ``python -m attnlab`` shim are the exceptions."""
    modules = all_modules()
    found = {name: why for name, path in modules.items() if not in_lab(name)
             for why in [refusals_outside_the_lab(name, path.read_text(), modules)] if why}
    assert found == {}, f"library modules that are lab by their imports: {found}"


def test_the_check_refuses_a_lab_module_at_the_root_or_in_a_library_folder():
    """The checker itself, on made-up sources: plotting at the root, a CLI helper in ``nn``, an
    upward import of the lab from ``masks``; the sanctioned imports pass."""
    modules = all_modules()
    plotting = "import torch\nimport matplotlib.pyplot as plt\n"
    assert refusals_outside_the_lab("attnlab.plots", plotting, modules) == ["2: matplotlib"]
    command = "def main():\n    import typer\n    from rich.console import Console\n"
    assert refusals_outside_the_lab("attnlab.nn.command", command, modules) == ["2: typer", "3: rich"]
    upward = "from attnlab.lab.viz import heatmap\n"
    assert refusals_outside_the_lab("attnlab.masks.draw", upward, modules) == ["1: attnlab.lab.viz.heatmap"]
    assert refusals_outside_the_lab("attnlab.__main__", (PACKAGE / "__main__.py").read_text(), modules) == []
    assert refusals_outside_the_lab("attnlab.io", "from attnlab.lab.cli import main\n", modules) == [
        "1: attnlab.lab.cli"]


def test_the_main_module_is_a_shim():
    """``src/attnlab/__main__.py`` only calls the command line: one import of ``attnlab.lab.cli.main``."""
    source = (PACKAGE / "__main__.py").read_text()
    modules = all_modules()
    assert [(e.target, e.top_level) for e in imports_in(source, "attnlab", modules)] == [("attnlab.lab.cli", True)]
    assert external_imports(source, "attnlab") == []
    assert len([line for line in source.splitlines() if line.strip()]) <= 4


def test_design_md_layer_table_lists_every_module_in_its_part():
    """docs/design.md's "## Layers" table names every module once, in the part this file gives it."""
    text = (PACKAGE.parents[1] / "docs" / "design.md").read_text()
    section = text[text.index("## Layers\n"):]
    section = section[: section.index("\n## ", 1)]
    listed = {}
    for row in section.splitlines():
        cells = [cell.strip() for cell in row.split("|")]
        if len(cells) > 4 and cells[1] in ("library", "lab"):
            for path in re.findall(r"`([^`]+)`", cells[3]):
                listed[".".join(["attnlab", *path.split("/")]).removesuffix(".__init__")] = cells[1]
    assert sorted(listed) == sorted(all_modules())
    assert [name for name, part in listed.items() if (part == "lab") != in_lab(name)] == []


def test_no_import_goes_up_a_layer():
    modules = all_modules()
    upward = []
    for name, path in modules.items():
        for edge in imports_of(path, modules):
            if edge.target != name and layer_of(edge.target) > layer_of(name) and not _sanctioned(name, edge):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{edge.line}: {name} "
                              f"(layer {layer_of(name)}) imports {edge.target} (layer {layer_of(edge.target)})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_no_library_module_imports_a_lab_module():
    """Module level or inside a function; the root's lazy ``attnlab.tutorial`` and ``attnlab.show`` are the exceptions."""
    modules = all_modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{edge.line}: {name} imports {edge.target}"
             for name, path in modules.items() if not in_lab(name)
             for edge in imports_of(path, modules) if in_lab(edge.target) and not _sanctioned(name, edge)]
    assert not found, "library modules that import the lab:\n" + "\n".join(found)


def test_the_lazy_lab_imports_are_in_the_roots_getattr():
    modules = all_modules()
    lazy = {(name, edge.target, edge.function) for name, path in modules.items() if not in_lab(name)
            for edge in imports_of(path, modules) if in_lab(edge.target)}
    assert lazy == LAZY_LAB_IMPORTS | SHIM_IMPORTS


def test_no_library_module_imports_the_labs_dependencies():
    modules = all_modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{edge.line}: {name} imports {edge.target}"
             for name, path in modules.items() if not in_lab(name)
             for edge in external_imports(path.read_text(), _package_of(path)) if edge.target in LAB_DEPENDENCIES]
    assert not found, "library modules that import the lab's dependencies:\n" + "\n".join(found)


def test_import_attnlab_loads_the_library_only():
    """A fresh interpreter: ``import attnlab`` and every library module load no lab module and
    none of the lab's dependencies; ``attnlab.tutorial`` still works, imported on first use."""
    library = sorted(name for name in all_modules() if not in_lab(name) and name != MAIN_SHIM[0])
    lab_prefixes = (LAB_PACKAGE,)
    script = "\n".join([
        "import importlib, sys",
        "import attnlab",
        f"for name in {library!r}:",
        "    importlib.import_module(name)",
        f"lab = sorted(m for m in sys.modules if m.startswith({lab_prefixes!r}) or m.split('.')[0] in {LAB_DEPENDENCIES!r})",
        "assert not lab, lab",
        "assert attnlab.tutorial.CausalAttention.__module__ == 'attnlab.lab.tutorial' and 'tutorial' in dir(attnlab)",
        "assert attnlab.show.__module__ == 'attnlab.lab.viz.views' and 'show' in dir(attnlab)",
        "print('ok')",
    ])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert result.returncode == 0 and result.stdout.strip() == "ok", result.stderr[-2000:]


def test_import_attnlab_loads_no_distributed_cli_or_lab_module():
    """A fresh interpreter: ``import attnlab`` alone loads the core (functional, backends, masks,
    scores, nn) and no ``attnlab.distributed`` module (context parallelism is a wrapper the user
    imports), no command line and no lab module; ``import attnlab.nn`` loads no distributed
    module either (the layers take their attention part, they do not import it)."""
    script = "\n".join([
        "import sys",
        "import attnlab, attnlab.nn, attnlab.models",
        "print(sorted(m for m in sys.modules if m.startswith('attnlab')))",
    ])
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                            env={**os.environ, "PYTHONPATH": str(PACKAGE.parent)})
    assert result.returncode == 0, result.stderr[-2000:]
    loaded = eval(result.stdout.strip())  # a printed list of module names
    assert "attnlab.nn.multihead" in loaded and "attnlab.functional" in loaded
    refused = ("attnlab.distributed", "attnlab.__main__", LAB_PACKAGE)
    assert [m for m in loaded if m.startswith(refused)] == []


def test_no_library_module_imports_the_command_line():
    modules = all_modules()
    found = [f"{path.relative_to(PACKAGE.parent)}:{edge.line}: {name} imports {edge.target}"
             for name, path in modules.items() if not in_lab(name)
             for edge in imports_of(path, modules) if edge.target.startswith(("attnlab.lab.cli", "attnlab.__main__"))
             and not _sanctioned(name, edge)]
    assert not found, found


def test_module_level_imports_form_no_cycle():
    modules = all_modules()
    graph = {name: sorted({edge.target for edge in imports_of(path, modules) if edge.top_level and edge.target != name})
             for name, path in modules.items()}
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done

    def visit(node: str, trail: list[str]) -> None:
        state[node] = 1
        for nxt in graph.get(node, []):
            if state.get(nxt) == 1:
                cycle = trail[trail.index(nxt):] + [node, nxt] if nxt in trail else [node, nxt]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt, trail + [node])
        state[node] = 2

    for name in graph:
        if name not in state:
            visit(name, [])


def test_layering_check_catches_an_upward_and_a_relative_import():
    """The checker itself: a backend importing attnlab.nn, even lazily or relatively, is seen."""
    modules = all_modules()
    source = "import torch\ndef f():\n    from attnlab.nn import MultiHeadAttention\nfrom ..nn import cache\n"
    edges = imports_in(source, "attnlab.backends", modules)
    assert sorted((e.target, e.top_level, e.function) for e in edges) == [
        ("attnlab.nn", False, "f"), ("attnlab.nn.cache", True, None)]
    assert all(layer_of(e.target) > layer_of("attnlab.backends.fake") for e in edges)


def test_layering_check_sees_a_lazy_lab_import_and_a_lazy_lab_dependency():
    modules = all_modules()
    source = "class A:\n    def draw(self):\n        import matplotlib.pyplot as plt\n        from attnlab.lab import viz\n"
    edges = imports_in(source, "attnlab.nn", modules)
    assert [(e.target, e.function) for e in edges] == [("attnlab.lab.viz", "draw")] and in_lab(edges[0].target)
    assert not _sanctioned("attnlab.nn.blocks", edges[0])
    assert [(e.target, e.top_level) for e in external_imports(source, "attnlab.nn")] == [("matplotlib", False)]


def test_no_lazy_import_of_attnlab_inside_functions_except_for_cost():
    """Function-level imports of attnlab modules are not needed to dodge cycles any more."""
    modules = all_modules()
    lazy = [f"{path.relative_to(PACKAGE.parent)}:{edge.line}: {edge.target}"
            for name, path in modules.items() if not name.startswith("attnlab.lab.cli")
            for edge in imports_of(path, modules) if not edge.top_level and not _sanctioned(name, edge)]
    assert not lazy, "function-level attnlab imports:\n" + "\n".join(lazy)
