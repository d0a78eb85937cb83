"""The tree is the architecture: rules on the package's imports, checked by parsing the source (no imports run).

* the plain-torch core (everything but ``lightning/``, ``_compat/lightning.py`` and the package ``__init__``) never
  imports Lightning, nor the adapter, nor the package root (which registers the strategy with Lightning);
* nothing in the package imports Hydra / OmegaConf or the recipes;
* the package's import graph has no cycle;
* the floor rule: each folder imports only the folders below it (:data:`FLOORS`), and the package root holds only
  the public facade (settings live in ``config/``);
* no module imports our own modules by string (``importlib`` / ``__import__`` / a ``"lightning_pipe.x:Y"`` name), so
  every dependency is an import the rules above see;
* no module is over 400 lines and no function over 60 (counted from its ``def`` to its last line).
"""

from __future__ import annotations

import ast
import re
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


# The layers of the package, bottom first: a module may import its own folder and the folders on lower floors only.
# ``<root>`` is the package facade (``lightning_pipe/__init__.py``).
FLOORS: dict[str, int] = {
    "config": 0, "_compat": 0,
    "layers": 1, "checkpoint": 1, "trace": 1,
    "parallel": 2, "hf": 2,  # hf: layer lists of transformers models, on layers/ (aux losses: hf/moe.py)
    "runtime": 3,
    "schedules": 4,
    "planner": 5, "rebalance": 5,
    "lightning": 6,
    "<root>": 7,
}


def folder_of(name: str) -> str:
    parts = name.split(".")
    return parts[1] if len(parts) > 1 else "<root>"


def floor_violations(graph: dict[str, set[str]]) -> list[str]:
    """Every import that goes up, or sideways into another folder of the same floor."""
    bad = []
    for name, deps in sorted(graph.items()):
        here = folder_of(name)
        for dep in sorted(deps):
            there = folder_of(dep)
            if there != here and FLOORS[there] >= FLOORS[here]:
                bad.append(f"{name} ({here}, floor {FLOORS[here]}) imports {dep} ({there}, floor {FLOORS[there]})")
    return bad


def test_every_folder_has_a_floor() -> None:
    assert {folder_of(name) for name in MODULES} == set(FLOORS)


def test_the_package_root_holds_only_the_facade() -> None:
    loose = sorted(p.name for p in ROOT.glob("*.py"))
    assert loose == ["__init__.py"], f"modules outside a folder: {loose}"


def test_each_folder_imports_only_folders_below_it() -> None:
    assert not floor_violations(GRAPH), "\n".join(floor_violations(GRAPH))


def test_the_floor_rule_can_fail() -> None:
    graph = {f"{PACKAGE}.parallel.grads": {f"{PACKAGE}.runtime.spec"}, f"{PACKAGE}.planner.auto": {f"{PACKAGE}.rebalance"},
             f"{PACKAGE}.runtime.engine": {f"{PACKAGE}.parallel.grads", f"{PACKAGE}.runtime.spec"}}
    assert len(floor_violations(graph)) == 2


STRING_IMPORTERS = {
    f"{PACKAGE}.planner.__main__": "the user's model factory, given on the command line as module:factory",
    f"{PACKAGE}._compat.torch_release": "torch's private modules, resolved with a versioned message",
    f"{PACKAGE}._compat.lightning": "Lightning's private modules, likewise",
}
"""Modules that may import by string, and what they import that way: never a module of ours."""
OUR_CLASS_NAME = re.compile(rf"{PACKAGE}(\.\w+)*:\w+")


def string_imports_in(source: str, name: str) -> list[str]:
    """Imports by string in the source of module ``name``: of our own modules anywhere, of anything outside
    :data:`STRING_IMPORTERS`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Call):
            func = node.func
            called = func.attr if isinstance(func, ast.Attribute) else func.id if isinstance(func, ast.Name) else ""
            if called not in ("import_module", "__import__"):
                continue
            arg = node.args[0] if node.args else None
            ours = isinstance(arg, ast.Constant) and str(arg.value).startswith(PACKAGE)
            if ours or name not in STRING_IMPORTERS:
                found.append(f"line {node.lineno}: {ast.unparse(node)}")
        elif isinstance(node, ast.Constant) and isinstance(node.value, str) and OUR_CLASS_NAME.fullmatch(node.value):
            found.append(f"line {node.lineno}: {node.value!r} names our class by string")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_import_of_our_modules_by_string(name: str) -> None:
    found = string_imports_in(MODULES[name].read_text(), name)
    assert not found, f"{name} imports by string: {found}"


def test_the_string_import_rule_can_fail() -> None:
    source = ("import importlib\nENGINE = 'lightning_pipe.schedules.chimera.engine:ChimeraEngine'\n"
              "def f(m):\n    importlib.import_module(m)\n    __import__('lightning_pipe.runtime')\n")
    assert len(string_imports_in(source, f"{PACKAGE}.runtime.build")) == 3
    assert len(string_imports_in(source, f"{PACKAGE}._compat.torch_release")) == 2  # ours, even where strings are allowed


# Sizes: a module past ~400 lines or a function past ~60 splits along a real seam (the house rule, BRIEF.md).
MAX_MODULE_LINES = 400
MAX_FUNCTION_LINES = 60


def long_functions(source: str, where: str, limit: int = MAX_FUNCTION_LINES) -> list[str]:
    """Every function (method, nested function) of ``source`` longer than ``limit`` lines, counted from its ``def``
    line to its last line, as ``where:line qualified.name (N lines)``."""
    found: list[str] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = f"{prefix}{child.name}"
                if not isinstance(child, ast.ClassDef):
                    length = (child.end_lineno or child.lineno) - child.lineno + 1
                    if length > limit:
                        found.append(f"{where}:{child.lineno} {name} ({length} lines)")
                visit(child, name + ".")
            else:
                visit(child, prefix)

    visit(ast.parse(source), "")
    return found


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_module_over_the_line_limit(name: str) -> None:
    lines = len(MODULES[name].read_text().splitlines())
    assert lines <= MAX_MODULE_LINES, (f"{MODULES[name].relative_to(ROOT.parent)} has {lines} lines, over "
                                       f"{MAX_MODULE_LINES}: split it along a real seam")


@pytest.mark.parametrize("name", sorted(MODULES))
def test_no_function_over_the_line_limit(name: str) -> None:
    long = long_functions(MODULES[name].read_text(), str(MODULES[name].relative_to(ROOT.parent)))
    assert not long, f"functions over {MAX_FUNCTION_LINES} lines (split along a real seam): {', '.join(long)}"


def test_the_size_rules_can_fail() -> None:
    def body(lines: int, indent: str) -> str:
        return "".join(f"{indent}x{i} = {i}\n" for i in range(lines))

    source = (f"class A:\n    @property\n    def short(self):\n        return 1\n\n    def long(self):\n{body(60, ' ' * 8)}"
              f"def outer():\n    def inner():\n{body(60, ' ' * 8)}    return inner\n")
    assert long_functions(source, "m.py") == ["m.py:6 A.long (61 lines)", "m.py:67 outer (63 lines)",
                                              "m.py:68 outer.inner (61 lines)"]
    assert long_functions("def f():\n" + body(59, "    "), "m.py") == []  # 60 lines from the def: at the limit
