"""The layout the code keeps: no import cycle between modules of ``runner`` (an import
inside a function counts, as it does at run time), no module over 450 lines, and no
import of a private module of ``sandboxes`` from ``runner``.

Read from the installed packages (``runner.__file__``), so they hold for what users get.
``lint-imports`` (in .ci/run) keeps the layers; these catch what it does not: a cycle
between two modules of one layer, and size.
"""

from __future__ import annotations

import ast
import tomllib
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import checkout

import runner
import sandboxes

MAX_LINES = 450
RUNNER = Path(runner.__file__).resolve().parent
SANDBOXES = Path(sandboxes.__file__).resolve().parent


def _modules(package: Path) -> dict[str, Path]:
    found = {}
    for path in sorted(package.rglob("*.py")):
        parts = [package.name, *path.relative_to(package).with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


def _imported(module: str, path: Path) -> Iterator[str]:
    """Every module ``module`` names in an import, wherever the import is."""
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            yield base
            yield from (f"{base}.{alias.name}" for alias in node.names)


def _graph() -> dict[str, set[str]]:
    modules = _modules(RUNNER)
    return {
        module: {name for name in _imported(module, path) if name in modules and name != module}
        for module, path in modules.items()
    }


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in sorted(graph[node]):
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_no_import_cycle_between_modules_of_runner() -> None:
    assert _cycles(_graph()) == []


def test_the_cycle_finder_finds_a_cycle_through_an_import_inside_a_function() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": set()}
    assert _cycles(graph) == []
    graph["c"].add("a")
    assert _cycles(graph) == [["a", "b", "c"]]


def test_an_import_inside_a_function_is_seen(tmp_path: Path) -> None:
    module = tmp_path / "m.py"
    module.write_text("def f():\n    from runner.call import executor\n    import runner.api\n")
    assert {"runner.call", "runner.call.executor", "runner.api"} <= set(_imported("runner.x.m", module))


@pytest.mark.parametrize("package", [RUNNER, SANDBOXES], ids=["runner", "sandboxes"])
def test_no_module_over_450_lines(package: Path) -> None:
    too_long = {
        str(path.relative_to(package)): lines
        for path in package.rglob("*.py")
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert too_long == {}


def test_runner_imports_no_private_module_of_sandboxes() -> None:
    crossings = [
        f"{module} -> {name}"
        for module, path in _modules(RUNNER).items()
        for name in _imported(module, path)
        if name.startswith("sandboxes.")
        and any(part.startswith("_") and not part.startswith("__") for part in name.split("."))
    ]
    assert crossings == []


def test_the_import_linter_contract_names_every_private_module_of_sandboxes() -> None:
    """import-linter forbids modules by name: one added to sandboxes must be added there."""
    root = checkout()
    if root is None:
        pytest.skip(
            "no checkout beside the suite (RUNNER_CHECKOUT unset): pyproject.toml is not in the wheel"
        )
    config = tomllib.loads((root / "pyproject.toml").read_text(encoding="utf-8"))
    (listed,) = [
        set(contract["forbidden_modules"])
        for contract in config["tool"]["importlinter"]["contracts"]
        if contract["name"].startswith("runner imports no private module")
    ]
    private = set()
    for path in SANDBOXES.rglob("*.py"):
        parts = ["sandboxes", *path.relative_to(SANDBOXES).with_suffix("").parts]
        first = next(
            (i for i, part in enumerate(parts[1:], 1) if part.startswith("_") and part != "__init__"), None
        )
        if first is not None:
            private.add(".".join(parts[: first + 1]))
    assert private - listed == set()
