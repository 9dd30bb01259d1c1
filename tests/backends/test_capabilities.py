"""The runner reaches the backends through public names only: what a backend can do beyond
``prepare`` is a small runtime-checkable protocol of ``sandboxes.base``, and no module of
``runner`` imports a private module of ``sandboxes`` (imports inside functions counted)."""

from __future__ import annotations

import ast
from pathlib import Path

import runner
from sandboxes import ChecksMachine, Closable, PreStarts, ProbesImages, StartsEarly, plugins
from sandboxes.docker import DockerSandbox
from sandboxes.subprocess import SubprocessSandbox

RUNNER = Path(runner.__file__).resolve().parent  # the package under test, wherever it is


def _private(name: str) -> bool:
    parts = name.split(".")
    return parts[0] == "sandboxes" and any(part.startswith("_") for part in parts[1:])


def _private_sandboxes_imports(source: str) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [alias.name for alias in node.names if _private(alias.name)]
        elif isinstance(node, ast.ImportFrom) and node.module is not None and node.level == 0:
            if _private(node.module):
                found.append(node.module)
            else:
                imported = [f"{node.module}.{alias.name}" for alias in node.names]
                found += [name for name in imported if _private(name)]
    return found


def test_no_module_of_the_runner_imports_a_private_module_of_sandboxes() -> None:
    crossings = {
        str(path.relative_to(RUNNER.parent)): names
        for path in sorted(RUNNER.rglob("*.py"))
        if (names := _private_sandboxes_imports(path.read_text()))
    }
    assert crossings == {}


def test_the_check_sees_an_import_inside_a_function() -> None:
    source = (
        "def f():\n    from sandboxes._watchdog import prestart\n    from sandboxes.docker import _client\n"
    )
    assert _private_sandboxes_imports(source) == ["sandboxes._watchdog", "sandboxes.docker._client"]


def test_each_backend_offers_what_it_can_as_public_protocols() -> None:
    subprocess_backend, docker_backend = SubprocessSandbox(), DockerSandbox()  # no I/O
    for backend in (subprocess_backend, docker_backend):
        assert isinstance(backend, StartsEarly)
        assert isinstance(backend, PreStarts)
        assert isinstance(backend, ChecksMachine)
        assert isinstance(backend, Closable)
    assert isinstance(docker_backend, ProbesImages)
    assert not isinstance(subprocess_backend, ProbesImages)  # it runs the host's own programs


def test_starting_early_a_backend_that_is_not_installed_is_a_no_op() -> None:
    plugins.start_early("no-such-backend-anywhere")  # the call that uses it says what is wrong
