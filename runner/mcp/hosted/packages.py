"""What ``runner mcp add`` checks in an installed package, and how it runs the package
managers: the venv's interpreters and module, npm's program, bounded subprocesses.

Nothing the package brings is run on the host: the module check is the system's
interpreter reading the venv's site-packages (``_FIND_MODULE``), the npm program is
resolved inside the package's own folder.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import signal
import stat
import subprocess
from pathlib import Path
from typing import Literal

SYSTEM_PYTHON = Path("/usr/bin/python3")  # what the sandbox runs: the venv must be made with it
VENV_DIR = "venv"
# A package manager stuck on the network is stopped, never waited for.
INSTALL_TIMEOUT_S = 600
# Finding a module reads a few directories.
CHECK_TIMEOUT_S = 60
_OUTPUT_TAIL = 2000  # characters of a package manager's output kept for the error
# The venv's interpreters (python, python3, python3.11): what the sandbox runs.
_INTERPRETER = re.compile(r"python(?:\d+(?:\.\d+)*)?")


# Found, not imported: PathFinder reads directories and runs none of the package's code
# (and -S keeps the venv's .pth files unread). Exit 3: not found; 4: a package without
# __main__, which `python -m` cannot run.
_FIND_MODULE = """\
import sys
from importlib.machinery import PathFinder
site, name = sys.argv[1], sys.argv[2]
path, prefix = [site], ""
for part in name.split("."):
    prefix += part
    spec = PathFinder.find_spec(prefix, path)
    if spec is None:
        sys.exit(3)
    path, prefix = spec.submodule_search_locations, prefix + "."
if path is not None and PathFinder.find_spec(name + ".__main__", list(path)) is None:
    sys.exit(4)
"""


Reason = Literal[
    "bad_name",
    "bad_package",
    "bad_module",
    "exists",
    "missing_program",
    "install_failed",
    "timeout",
    "no_module",
    "no_bin",
    "bin_choice",
    "bin_outside",
    "interpreter_replaced",
    "venv_tampered",
]


class McpAddError(Exception):
    """The server cannot be installed. ``reason`` says why (one word); ``output`` is the
    tail of the package manager's output, when one ran and failed."""

    def __init__(self, reason: Reason, message: str, output: str = "") -> None:
        super().__init__(message)
        self.reason = reason
        self.message = message
        self.output = output


def venv_interpreters(venv: Path) -> dict[str, str]:
    """The venv's ``bin/python*`` interpreters, each the symlink ``venv`` made (name: its
    target), as they are right after ``python3 -m venv``.

    Raises:
        McpAddError: ``venv_tampered``: one is not a symlink to SYSTEM_PYTHON.
    """
    found = _interpreter_links(venv)
    system = SYSTEM_PYTHON.resolve()
    if "python3" not in found or any(
        target is None or (venv / "bin" / name).resolve() != system for name, target in found.items()
    ):
        raise McpAddError("venv_tampered", f"{venv}/bin does not hold symlinks to {SYSTEM_PYTHON}")
    return {name: target for name, target in found.items() if target is not None}


def check_interpreters(venv: Path, before: dict[str, str], package: str) -> None:
    """Check that the venv's ``bin/python*`` are still exactly the symlinks ``before``
    (from ``venv_interpreters``): none replaced, removed or added by the package. By lstat
    and readlink only: nothing is executed.

    Raises:
        McpAddError: ``interpreter_replaced``, naming the first that changed.
    """
    now = _interpreter_links(venv)
    for name in sorted(before.keys() | now.keys()):
        if now.get(name) != before.get(name):
            raise McpAddError(
                "interpreter_replaced",
                f"{package} replaced the virtual environment's interpreter ({VENV_DIR}/bin/{name}):"
                " refused, and nothing it installed was run",
            )


def _interpreter_links(venv: Path) -> dict[str, str | None]:
    """``bin/python*`` of ``venv``: each name with its symlink's target, None when not a symlink."""
    _real_folder(venv, venv / "bin")
    links: dict[str, str | None] = {}
    for entry in (venv / "bin").iterdir():
        if _INTERPRETER.fullmatch(entry.name):
            links[entry.name] = str(entry.readlink()) if entry.is_symlink() else None
    return links


def _site_packages(venv: Path) -> Path:
    """The one ``lib/python3.X/site-packages`` of a venv just made.

    Raises:
        McpAddError: ``venv_tampered``, when there is not exactly one, as a real folder.
    """
    sites = list((venv / "lib").glob("python3*/site-packages"))
    if len(sites) != 1:
        raise McpAddError("venv_tampered", f"the virtual environment at {venv} has no single site-packages")
    _real_folder(venv, sites[0])
    return sites[0]


def _real_folder(root: Path, path: Path) -> None:
    """Check that ``path`` and every folder between ``root`` and it are real folders, no
    symlink among them (lstat: one cannot lead out of ``root``).

    Raises:
        McpAddError: ``venv_tampered``.
    """
    steps = [root]
    for part in path.relative_to(root).parts:
        steps.append(steps[-1] / part)
    for step in steps:
        try:
            mode = step.lstat().st_mode
        except OSError as exc:
            raise McpAddError("venv_tampered", f"{step} is missing: {exc.strerror or exc}") from exc
        if not stat.S_ISDIR(mode):
            raise McpAddError("venv_tampered", f"{step} is not a folder (a symlink or a file)")


def check_module(site: Path, module: str, *, given: bool = True) -> None:
    """Check that ``python -m module`` finds ``module`` in the venv's ``site`` (its
    site-packages). Found, not imported, and by SYSTEM_PYTHON, never the venv's own
    interpreter (a package can replace that): none of the package's code runs.

    Raises:
        McpAddError: ``no_module``, naming --module and the runnable packages there.
    """
    found = _run(
        [str(SYSTEM_PYTHON), "-I", "-S", "-c", _FIND_MODULE, str(site), module], timeout=CHECK_TIMEOUT_S
    )
    if found.returncode == 0:
        return
    runnable = sorted(
        path.parent.name
        for path in site.glob("*/__main__.py")
        if path.parent.name not in {"pip", "setuptools", "wheel"}
    )
    hint = f" (packages there with a __main__: {', '.join(runnable)})" if runnable else ""
    what = (
        "has no __main__ module, so python -m cannot run it" if found.returncode == 4 else "is not installed"
    )
    flag = "--module" if given else "the default module name; pass --module"
    raise McpAddError("no_module", f"module {module} {what}: check {flag} with the module to run{hint}")


def node_program(folder: Path, package: str, chosen: str | None) -> str:
    """The program (``bin`` of its package.json; ``chosen``, else its only one) of the npm
    ``package`` installed in ``folder``, relative to ``folder``. Resolved, so that a symlink
    the package planted cannot point it outside the folder.

    Raises:
        McpAddError: ``bin_choice`` (several, none chosen), ``no_bin``, ``bin_outside``.
    """
    root = folder.resolve()
    package_dir = folder / "node_modules" / package
    described = _inside(root, package_dir / "package.json", package)
    try:
        bins = json.loads(described.read_text(encoding="utf-8")).get("bin")
    except (OSError, ValueError, AttributeError) as exc:
        raise McpAddError("no_bin", f"cannot read {package}'s package.json: {exc}") from exc
    if isinstance(bins, str):
        bins = {package.rpartition("/")[2]: bins}
    if not isinstance(bins, dict) or not bins or not all(isinstance(v, str) for v in bins.values()):
        raise McpAddError("no_bin", f"{package} names no program in its package.json 'bin'")
    names = ", ".join(sorted(bins))
    if chosen is None and len(bins) > 1:
        raise McpAddError("bin_choice", f"{package} has several programs ({names}); pick one with --bin")
    entry = chosen if chosen is not None else next(iter(bins))
    if entry not in bins:
        raise McpAddError("no_bin", f"{package} has no program {entry!r} (it has: {names})")
    return str(_inside(root, package_dir / bins[entry], package).relative_to(root))


def _inside(root: Path, path: Path, package: str) -> Path:
    resolved = path.resolve()
    if not resolved.is_relative_to(root):
        raise McpAddError("bin_outside", f"{package}: {path.name} leads outside the tool folder (a symlink)")
    if not resolved.is_file():
        raise McpAddError("no_bin", f"{package}: {resolved.relative_to(root)} is not a file")
    return resolved


def _checked(step: str, done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        output = done.stdout[-_OUTPUT_TAIL:]
        raise McpAddError("install_failed", f"{step} failed (exit status {done.returncode})", output)


# What would make pip see, or put, packages outside the server's venv: the server runs in a
# sandbox with none of it, so everything it imports must be installed in its venv.
_NOT_PASSED = frozenset(
    {"PYTHONPATH", "PYTHONHOME", "PYTHONUSERBASE", "PIP_TARGET", "PIP_PREFIX", "PIP_ROOT", "PIP_USER"}
)


def _run(argv: list[str], *, timeout: float = INSTALL_TIMEOUT_S) -> subprocess.CompletedProcess[str]:
    """Run ``argv`` with its output (stdout and stderr together) captured. It runs in a
    session of its own whose every process is killed when it ends, times out or the caller
    is interrupted: nothing it started outlives this call.

    Raises:
        McpAddError: ``timeout``, or ``missing_program`` when ``argv[0]`` cannot be started.
    """
    try:
        process = subprocess.Popen(
            argv,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            errors="replace",
            start_new_session=True,
            cwd="/",  # not the caller's folder, where a planted module or .npmrc would be read
            env={key: value for key, value in os.environ.items() if key not in _NOT_PASSED},
        )
    except OSError as exc:
        raise McpAddError("missing_program", f"cannot start {argv[0]}: {exc.strerror or exc}") from exc
    try:
        output, _ = process.communicate(timeout=timeout)
    except subprocess.TimeoutExpired as exc:
        raise McpAddError("timeout", f"{Path(argv[0]).name} took more than {timeout:.0f} s; stopped") from exc
    finally:
        _kill_session(process)
    return subprocess.CompletedProcess(argv, process.returncode, output)


def _kill_session(process: subprocess.Popen[str]) -> None:
    with contextlib.suppress(ProcessLookupError):  # it and everything it started have exited
        os.killpg(process.pid, signal.SIGKILL)
    process.wait()
    if process.stdout is not None:
        process.stdout.close()
