"""``runner mcp add``: a third-party MCP server's package installed into a tool folder (SPEC 12).

A PyPI package goes into a virtual environment made with the system's ``/usr/bin/python3``
(the interpreter the sandbox runs, not the runner's own), an npm package into
``node_modules`` for the system's ``node``. Nothing the package brings runs as root on the
host: wheels only (no ``setup.py``), npm's install scripts off, and once pip has run nothing
in the venv is executed on the host: the module check is the system's interpreter reading
the venv's site-packages, and a wheel that replaced the venv's interpreter (a
``.data/scripts/python3``) is refused. The folder is built beside the target and renamed into
place at the end, so a failed install leaves nothing behind.
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import shutil
import signal
import stat
import subprocess
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from runner.manifest import MANIFEST_FILE
from runner.scaffold import NAME

SYSTEM_PYTHON = Path("/usr/bin/python3")  # what the sandbox runs: the venv must be made with it
VENV_DIR = "venv"
# A package manager stuck on the network is stopped, never waited for.
INSTALL_TIMEOUT_S = 600
# Finding a module reads a few directories.
CHECK_TIMEOUT_S = 60
_OUTPUT_TAIL = 2000  # characters of a package manager's output kept for the error

# A requirement: a name, extras, version clauses; never a path, URL or option (a leading
# '-' would be an option of pip's, a path or URL a source tree whose build runs code).
_PIP_CLAUSE = r"(?:===?|~=|!=|<=?|>=?)[A-Za-z0-9.*+!_-]+"
_PIP_PACKAGE = re.compile(
    rf"(?P<name>[A-Za-z0-9](?:[A-Za-z0-9._-]{{0,200}}[A-Za-z0-9])?)"
    rf"(?:\[[A-Za-z0-9._,-]+\])?(?:{_PIP_CLAUSE}(?:,{_PIP_CLAUSE})*)?"
)
# An npm name, optionally scoped, with an optional version or range; no ':' or '/' after
# the name, so never a git URL, tarball or folder.
_NPM_PACKAGE = re.compile(
    r"(?P<name>(?:@[a-z0-9][a-z0-9._~-]{0,100}/)?[a-z0-9][a-z0-9._~-]{0,213})"
    r"(?:@[A-Za-z0-9.^~<>=*+|_ -]{1,100})?"
)
_MODULE = re.compile(r"[A-Za-z_][A-Za-z0-9_]*(?:\.[A-Za-z_][A-Za-z0-9_]*)*")
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

# What the two example servers needed in the subprocess sandbox (docs/mcp-servers.md):
# ~70 MB peak RSS each, start-up 0.6 s (mcp-server-time) and 0.25 s (server-filesystem).
# node's V8 and libuv pools start ~11 threads, and max_pids counts threads.
_LIMITS = {
    "pip": {"timeout_ms": 10000, "deadline_ms": 20000, "memory_mb": 256, "max_pids": 64},
    "npm": {"timeout_ms": 10000, "deadline_ms": 20000, "memory_mb": 256, "max_pids": 32},
}

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


@dataclass(frozen=True)
class PipSource:
    """A PyPI requirement, run as ``python3 -m module``."""

    package: str
    module: str | None = None
    registry: str = "PyPI"


@dataclass(frozen=True)
class NpmSource:
    """An npm package, run as ``node`` on one of its ``bin`` files."""

    package: str
    bin: str | None = None
    registry: str = "npm"


Source = PipSource | NpmSource


@dataclass(frozen=True)
class Installed:
    """What ``add_server`` wrote."""

    name: str
    folder: Path
    manifest: Path
    source: Source
    command: tuple[str, ...]


def add_server(
    tools_dir: Path,
    name: str,
    source: Source,
    args: Sequence[str] = (),
    *,
    force: bool = False,
    asks: Asks | None = None,
) -> Installed:
    """Install ``source`` into ``tools_dir/name`` and write its ``kind: mcp`` manifest.

    Raises:
        McpAddError: a bad name, package or module, the folder exists (without ``force``),
            a program is missing, the install failed or timed out, the module or bin is
            not there.
        OSError: the folder cannot be written.
    """
    if not NAME.fullmatch(name):
        raise McpAddError("bad_name", f"server name {name!r} must match [a-z][a-z0-9_-]{{0,63}}")
    _check_source(source)
    folder = tools_dir / name
    if not force and (folder.exists() or folder.is_symlink()):
        raise McpAddError("exists", f"{folder} already exists; pass --force to replace it")
    tools_dir.mkdir(parents=True, exist_ok=True)
    # Beside the target (same filesystem: the rename at the end is atomic), a dot folder
    # without tool.yaml until the end, so a registry loaded meanwhile skips it.
    staging = Path(tempfile.mkdtemp(prefix=f".{name}.", suffix=".installing", dir=tools_dir))
    try:
        staging.chmod(0o755)  # mkdtemp's 0700 would keep the sandbox's user out
        if isinstance(source, PipSource):
            command = _install_pip(staging, source)
        else:
            command = _install_npm(staging, source)
        command = [*command, *args]
        text = manifest_text(name, source, command, asks or Asks())
        (staging / MANIFEST_FILE).write_text(text, encoding="utf-8")
        _readable_by_all(staging)
        _move_into_place(staging, folder)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return Installed(name, folder, folder / MANIFEST_FILE, source, tuple(command))


def _check_source(source: Source) -> None:
    if isinstance(source, PipSource):
        if not _PIP_PACKAGE.fullmatch(source.package):
            raise McpAddError(
                "bad_package", f"--pip {source.package!r} is not a PyPI requirement (NAME[extras]==VERSION)"
            )
        if source.module is not None and not _MODULE.fullmatch(source.module):
            raise McpAddError("bad_module", f"--module {source.module!r} is not a dotted module name")
    elif not _NPM_PACKAGE.fullmatch(source.package):
        raise McpAddError(
            "bad_package", f"--npm {source.package!r} is not an npm package name (@SCOPE/NAME@VERSION)"
        )


@dataclass(frozen=True)
class Asks:
    """What the server's manifest asks for: the workspace, secrets, fixed environment."""

    workspace: str = "none"  # none, read or write
    secrets: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()

    def lines(self) -> str:
        text = ""
        if self.workspace != "none":
            text += f"workspace: {self.workspace}   # the policy's workspace, at /workspace\n"
        else:
            text += "# workspace: read     # or write: the policy's workspace at /workspace\n"
        if self.secrets:
            text += f"secrets: [{', '.join(json.dumps(name) for name in self.secrets)}]\n"
        if self.env:
            pairs = ", ".join(f"{json.dumps(key)}: {json.dumps(value)}" for key, value in self.env)
            text += f"env: {{{pairs}}}\n"
        return text


def manifest_text(name: str, source: Source, command: Sequence[str], asks: Asks) -> str:
    """The ``tool.yaml`` of an installed server. Strings are written as JSON, which YAML
    reads as double-quoted scalars, whatever they hold."""
    kind = "pip" if isinstance(source, PipSource) else "npm"
    limits = ", ".join(f"{key}: {value}" for key, value in _LIMITS[kind].items())
    description = f"MCP server {source.package} ({source.registry}), installed by runner mcp add"
    return (
        f"name: {name}\n"
        "kind: mcp\n"
        f"description: {json.dumps(description)}\n"
        f"command: [{', '.join(json.dumps(part) for part in command)}]\n"
        "sandbox: subprocess\n"
        "# tools: [a, b]       # optional: expose only these\n"
        '# prefix: ""          # optional: keep the server\'s own tool names\n'
        f"{asks.lines()}"
        f"limits: {{{limits}}}\n"
    )


def _install_pip(folder: Path, source: PipSource) -> list[str]:
    if not SYSTEM_PYTHON.is_file():
        raise McpAddError("missing_program", f"{SYSTEM_PYTHON} is missing (Debian package python3)")
    probe = _run([str(SYSTEM_PYTHON), "-c", "import venv, ensurepip"], timeout=CHECK_TIMEOUT_S)
    if probe.returncode != 0:
        raise McpAddError(
            "missing_program",
            f"{SYSTEM_PYTHON} cannot make a virtual environment: install the Debian package python3-venv",
        )
    venv = folder / VENV_DIR
    _checked("python3 -m venv", _run([str(SYSTEM_PYTHON), "-m", "venv", str(venv)]))
    # Taken before pip: afterwards the venv holds the package's files, which may add a
    # decoy lib/python3.X/site-packages or replace bin/python3.
    interpreters = venv_interpreters(venv)
    site = _site_packages(venv)
    # The venv's python3 is still the symlink to SYSTEM_PYTHON here: nothing of the package
    # is installed yet. Wheels only: a source distribution's setup.py would run, as root.
    pip = [str(venv / "bin" / "python3"), "-m", "pip", "install", "--disable-pip-version-check", "--no-input"]
    _checked(f"pip install {source.package}", _run([*pip, "--only-binary", ":all:", source.package]))
    # From here on nothing in the venv is executed on the host.
    check_interpreters(venv, interpreters, source.package)
    _real_folder(venv, site)
    match = _PIP_PACKAGE.fullmatch(source.package)
    assert match is not None  # _check_source matched it
    module = source.module or match["name"].replace("-", "_")
    check_module(site, module, given=source.module is not None)
    return [f"{VENV_DIR}/bin/python3", "-m", module]


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


def _install_npm(folder: Path, source: NpmSource) -> list[str]:
    npm = shutil.which("npm")
    if npm is None or shutil.which("node") is None:
        raise McpAddError(
            "missing_program", "node and npm are needed: install the Debian packages nodejs and npm"
        )
    # --ignore-scripts: no install script of the package or its dependencies runs as root on the host.
    argv = [
        npm,
        "install",
        "--prefix",
        str(folder),
        "--no-audit",
        "--no-fund",
        "--ignore-scripts",
        "--omit=dev",
    ]
    _checked(f"npm install {source.package}", _run([*argv, source.package]))
    match = _NPM_PACKAGE.fullmatch(source.package)
    assert match is not None  # _check_source matched it
    return ["node", node_program(folder, match["name"], source.bin)]


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


def _readable_by_all(folder: Path) -> None:
    """Files readable and folders searchable by everyone: the sandbox's user is not root.
    Symlinks are left alone (chmod would follow them out of the folder)."""
    for directory, subdirs, files in os.walk(folder):
        for entry in (*subdirs, *files):
            path = Path(directory, entry)
            if path.is_symlink():
                continue
            mode = path.stat().st_mode
            wanted = mode | 0o444 | (0o111 if path.is_dir() or mode & 0o100 else 0)
            if wanted != mode:
                path.chmod(wanted)


def _move_into_place(staging: Path, folder: Path) -> None:
    if not (folder.exists() or folder.is_symlink()):
        staging.rename(folder)  # fails rather than merging if the folder appeared meanwhile
        return
    old = folder.with_name(f".{folder.name}.replaced-{os.getpid()}")
    folder.rename(old)  # a symlink is moved itself, never followed
    staging.rename(folder)
    if old.is_symlink() or not old.is_dir():
        old.unlink()
    else:
        shutil.rmtree(old)


def _checked(step: str, done: subprocess.CompletedProcess[str]) -> None:
    if done.returncode != 0:
        output = done.stdout[-_OUTPUT_TAIL:]
        raise McpAddError("install_failed", f"{step} failed (exit status {done.returncode})", output)


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
