"""A tool's template in fork mode: the runner starts it in the tool's sandbox as

    python3 /opt/runner/python/runner_fork.py main.py

It compiles the tool's script, runs the script's top-level imports (and the helper's),
says ready on stdout and blocks reading stdin. The runner then stops it there for good,
from outside, and never lets it run again: each call's process is cloned from it, and
returns from that read into the tool's script, in its own namespaces and cgroup.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import gc
import os
import sys
import types
from pathlib import Path


def _imports(tree: ast.Module) -> list[ast.stmt]:
    """The script's top-level ``import`` statements (not those under ``if __name__``)."""
    return [node for node in tree.body if isinstance(node, (ast.Import, ast.ImportFrom))]


def _run(code: types.CodeType, script: str) -> None:
    """The tool's script, in a call: as ``python3 main.py`` would run it."""
    helper = sys.modules.get("runner_tool")
    if helper is not None:
        # The helper noted at import what 0, 1 and 2 were: now the call's own.
        vars(helper)["_STANDARD_FDS"] = {fd: helper._identity(fd) for fd in (0, 1, 2)}
    sys.argv = [script]
    # The script's globals are __main__'s, as when it is run: nothing of this file's (which
    # is __main__ too, so all it uses from here on is made first).
    fresh = {"__name__": "__main__", "__file__": script, "__builtins__": builtins}
    namespace = sys.modules["__main__"].__dict__
    namespace.clear()
    namespace.update(fresh)
    exec(code, namespace)  # noqa: S102 - the tool's own script, as python3 would run it


def main() -> None:
    script = sys.argv[1]
    source = Path(script).read_bytes()
    tree = ast.parse(source, script)
    code = compile(tree, script, "exec")
    imports = ast.Module(body=_imports(tree), type_ignores=[])
    sys.path[0] = str(Path(script).absolute().parent)  # as for python3 main.py
    with contextlib.suppress(ImportError):
        import runner_tool  # type: ignore[import-not-found]  # noqa: F401 - once here, for every call
    # A failing import fails each call the same way, which reports it.
    with contextlib.suppress(Exception):
        exec(compile(imports, script, "exec"), {"__name__": "__runner_fork__"})  # noqa: S102
    gc.freeze()  # the collector would touch, and so copy, every page in each call
    sys.stdout.flush()
    os.write(1, b"r")
    os.read(0, 1)  # in the template never returns: it is stopped here for good
    _run(code, script)


if __name__ == "__main__":
    main()
