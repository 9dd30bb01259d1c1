"""``runner mcp add``: a third-party MCP server's package installed into a tool folder.

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

import json
import os
import re
import shutil
import tempfile
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from runner.mcp.hosted.packages import (
    CHECK_TIMEOUT_S,
    SYSTEM_PYTHON,
    VENV_DIR,
    McpAddError,
    _checked,
    _real_folder,
    _run,
    _site_packages,
    check_interpreters,
    check_module,
    node_program,
    venv_interpreters,
)
from runner.tools.manifest import MANIFEST_FILE
from runner.tools.scaffold import NAME

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

# Room for what the two example servers needed in the subprocess sandbox (measured in
# docs/performance.md, "Figures behind the code"); max_pids counts threads, and node's
# V8 and libuv pools start a dozen.
_LIMITS = {
    "pip": {"timeout_ms": 10000, "deadline_ms": 20000, "memory_mb": 256, "max_pids": 64},
    "npm": {"timeout_ms": 10000, "deadline_ms": 20000, "memory_mb": 256, "max_pids": 32},
}


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
    """What the server's manifest asks for: the workspace, secrets, fixed environment, and
    whether it is kept for a session."""

    workspace: str = "none"  # none, read or write
    secrets: tuple[str, ...] = ()
    env: tuple[tuple[str, str], ...] = ()
    session: bool = False

    def lines(self) -> str:
        text = ""
        if self.workspace != "none":
            text += f"workspace: {self.workspace}   # the policy's workspace, at /workspace\n"
        else:
            text += "# workspace: read     # or write: the policy's workspace at /workspace\n"
        if self.session:
            text += "session: true   # one server per session, kept between its calls\n"
        else:
            text += "# session: true       # optional: one server per session, kept between its calls\n"
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
    # -I, and a fixed working folder (_run): a module planted in the folder the command was
    # run from would be imported first, as root.
    probe = _run([str(SYSTEM_PYTHON), "-I", "-c", "import venv, ensurepip"], timeout=CHECK_TIMEOUT_S)
    if probe.returncode != 0:
        raise McpAddError(
            "missing_program",
            f"{SYSTEM_PYTHON} cannot make a virtual environment: install the Debian package python3-venv",
        )
    venv = folder / VENV_DIR
    _checked("python3 -m venv", _run([str(SYSTEM_PYTHON), "-I", "-m", "venv", str(venv)]))
    # Taken before pip: afterwards the venv holds the package's files, which may add a
    # decoy lib/python3.X/site-packages or replace bin/python3.
    interpreters = venv_interpreters(venv)
    site = _site_packages(venv)
    # The venv's python3 is still the symlink to SYSTEM_PYTHON here: nothing of the package
    # is installed yet. Wheels only: a source distribution's setup.py would run, as root.
    pip = [
        str(venv / "bin" / "python3"),
        "-I",
        "-m",
        "pip",
        "install",
        "--disable-pip-version-check",
        "--no-input",
    ]
    _checked(f"pip install {source.package}", _run([*pip, "--only-binary", ":all:", source.package]))
    # From here on nothing in the venv is executed on the host.
    check_interpreters(venv, interpreters, source.package)
    _real_folder(venv, site)
    match = _PIP_PACKAGE.fullmatch(source.package)
    assert match is not None  # _check_source matched it
    module = source.module or match["name"].replace("-", "_")
    check_module(site, module, given=source.module is not None)
    return [f"{VENV_DIR}/bin/python3", "-m", module]


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
