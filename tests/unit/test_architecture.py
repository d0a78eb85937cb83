"""The tree is the architecture: rules on the package's imports, checked by parsing the source (no imports run).

* the plain-torch core (everything but ``lightning/``, ``_compat/lightning.py`` and the package ``__init__``) never
  imports Lightning, nor the adapter, nor the package root (which registers the strategy with Lightning);
* nothing in the package imports Hydra / OmegaConf or the recipes;
* the package's import graph has no cycle.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = "lightning_pipe"
ROOT = Path(__file__).resolve().parents[2] / PACKAGE
LIGHTNING_PACKAGES = ("lightning", "pytorch_lightning", "lightning_utilities", "lightning_fabric")
ADAPTER = (f"{PACKAGE}.lightning", f"{PACKAGE}._compat.lightning")


def module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imports_of(name: str) -> set[str]:
    return imports_in(MODULES[name].read_text(), name, is_package(name))


def imports_in(source: str, name: str, package: bool) -> set[str]:
    """Every module the source of module ``name`` imports, anywhere in the file (absolute names; ``from pkg import
    submodule`` counts as the submodule)."""
    tree = ast.parse(source)
    base = name if package else name.rpartition(".")[0]
    found: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                anchor = base.split(".")[: len(base.split(".")) - (node.level - 1)]
                target = ".".join(anchor + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names if f"{target}.{alias.name}" in MODULES)
    return found


def in_adapter(name: str) -> bool:
    return name == PACKAGE or any(name == a or name.startswith(a + ".") for a in ADAPTER)


GRAPH = {name: {m for m in imports_of(name) if m in MODULES and m != name} for name in MODULES}


def test_the_package_is_found() -> None:
    assert f"{PACKAGE}.runtime.engine" in MODULES and f"{PACKAGE}.lightning.strategy" in MODULES


@pytest.mark.parametrize("name", sorted(n for n in MODULES if not in_adapter(n)))
def test_core_never_imports_lightning_or_the_adapter(name: str) -> None:
    external = {m.split(".")[0] for m in imports_of(name)}
    assert not external & set(LIGHTNING_PACKAGES), f"{name} (plain-torch core) imports {external & set(LIGHTNING_PACKAGES)}"
    upward = sorted(m for m in GRAPH[name] if in_adapter(m))
    assert not upward, f"{name} (plain-torch core) imports the Lightning adapter / package root: {upward}"


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_hydra_and_no_recipes_in_the_library(name: str) -> None:
    external = {m.split(".")[0] for m in imports_of(name)}
    assert not external & {"hydra", "omegaconf", "recipes", "tests", "bench"}, f"{name} imports {external}"


def test_no_import_cycles() -> None:
    state: dict[str, int] = {}  # 1: on the stack, 2: done
    stack: list[str] = []

    def visit(name: str) -> None:
        state[name] = 1
        stack.append(name)
        for dep in sorted(GRAPH[name]):
            if state.get(dep) == 1:
                cycle = stack[stack.index(dep):] + [dep]
                pytest.fail("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        stack.pop()
        state[name] = 2

    for name in sorted(GRAPH):
        if name not in state:
            visit(name)


def test_the_parser_sees_local_and_relative_imports() -> None:
    """A rule that cannot fail proves nothing: function-local and relative imports are seen and resolved."""
    source = "def f():\n    from ..lightning.strategy import PipelineStrategy\n    import lightning.pytorch\n"
    found = imports_in(source, f"{PACKAGE}.runtime.engine", package=False)
    assert f"{PACKAGE}.lightning.strategy" in found and "lightning.pytorch" in found
    assert in_adapter(f"{PACKAGE}.lightning.strategy") and not in_adapter(f"{PACKAGE}.runtime.engine")
