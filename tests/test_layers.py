"""The package's imports go one way: down the layers of docs/design.md, with no cycle.

Every ``import`` statement in ``src/attnlab`` is read from the source (module level and inside
functions alike, so a lazy import cannot hide an upward edge), resolved to the attnlab module it
names, and checked against the layer table below.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "src" / "attnlab"

# Lower number = lower layer. A module may import its own layer or any lower one.
LAYERS = [
    ("attnlab._checks", 0), ("attnlab._flops", 0), ("attnlab._memory", 0),
    ("attnlab.masks", 1),
    ("attnlab._call", 2),
    ("attnlab._math", 3),
    ("attnlab.backends", 4),
    ("attnlab.functional", 5),
    ("attnlab.nn", 6), ("attnlab.tutorial", 6), ("attnlab.io", 6),
    ("attnlab.integrations", 6), ("attnlab.distributed", 6),
    ("attnlab.models", 7),
    ("attnlab", 8),  # the root package re-exports nn and tutorial, so it sits above them
    ("attnlab.explain", 9), ("attnlab.viz", 9), ("attnlab.verify", 9), ("attnlab.bench", 9),
    ("attnlab.train", 9), ("attnlab.trained", 9),
    ("attnlab.cli", 10), ("attnlab.__main__", 10),
    ("attnlab.distributed.check", 10),  # the torchrun entry point: runs the CLI command
]


def layer_of(module: str) -> int:
    """The layer of the longest prefix of ``module`` in LAYERS."""
    best = None
    for prefix, rank in LAYERS:
        if module == prefix or module.startswith(prefix + "."):
            if best is None or len(prefix) > len(best[0]):
                best = (prefix, rank)
    if best is None:
        raise AssertionError(f"{module} is not in the layer table of tests/test_layers.py")
    return best[1]


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


def imports_of(path: Path, modules: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """(imported attnlab module, at module level?, line) for every import in ``path``."""
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    return imports_in(path.read_text(), package, modules)


def imports_in(source: str, package: str, modules: dict[str, Path]) -> list[tuple[str, bool, int]]:
    """As :func:`imports_of`, for source text of a module inside ``package``."""
    tree = ast.parse(source)
    top_level = {id(node) for node in tree.body}
    found = []
    for node in ast.walk(tree):
        names: list[str] = []
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package.split(".")[: len(package.split(".")) - node.level + 1] + ([base] if base else []))
            names = [f"{base}.{alias.name}" for alias in node.names]
        for name in names:
            if name == "attnlab" or name.startswith("attnlab."):
                found.append((_resolve(name, modules), id(node) in top_level, node.lineno))
    return found


def test_every_module_has_a_layer():
    for name in all_modules():
        layer_of(name)


def test_no_import_goes_up_a_layer():
    modules = all_modules()
    upward = []
    for name, path in modules.items():
        for target, _, line in imports_of(path, modules):
            if target != name and layer_of(target) > layer_of(name):
                upward.append(f"{path.relative_to(PACKAGE.parent)}:{line}: {name} "
                              f"(layer {layer_of(name)}) imports {target} (layer {layer_of(target)})")
    assert not upward, "imports that go up a layer:\n" + "\n".join(upward)


def test_module_level_imports_form_no_cycle():
    modules = all_modules()
    graph = {name: sorted({t for t, top, _ in imports_of(path, modules) if top and t != name})
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
    assert sorted((t, top) for t, top, _ in edges) == [("attnlab.nn", False), ("attnlab.nn.cache", True)]
    assert all(layer_of(t) > layer_of("attnlab.backends.fake") for t, _, _ in edges)


def test_no_lazy_import_of_attnlab_inside_functions_except_for_cost():
    """Function-level imports of attnlab modules are not needed to dodge cycles any more."""
    modules = all_modules()
    lazy = [f"{path.relative_to(PACKAGE.parent)}:{line}: {target}"
            for name, path in modules.items() if not name.startswith("attnlab.cli")
            for target, top, line in imports_of(path, modules) if not top]
    assert not lazy, "function-level attnlab imports:\n" + "\n".join(lazy)
