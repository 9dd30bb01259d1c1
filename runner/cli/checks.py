"""Will a tool's command start in its sandbox? (``runner validate``, the deep checks.)

The command is resolved as the sandbox will resolve it: ``argv[0]`` on the tool's
``PATH`` (``sandboxes.view.DEFAULT_PATH`` unless the manifest's ``env`` sets one), a
command with a slash relative to the tool's folder, ``/tool/...`` as that folder. For the
subprocess backend that is the host's own system folders, which the sandbox shows
read-only; for docker it is the image, asked of the daemon without starting anything.
The script an interpreter runs (``argv[1]``) must be in the tool's folder and readable by
others: the sandbox user is never the files' owner.
"""

from __future__ import annotations

import contextlib
import os
import re
import stat
from collections.abc import Iterator, Sequence
from pathlib import Path, PurePosixPath

from sandboxes import ImageProbe
from sandboxes.view import TOOL_MOUNT, search_path

# What the subprocess sandbox shows of the host (sandboxes/subprocess/_layout.py binds
# /usr and this hook read-only, and /bin, /sbin, /lib... as they are on the host).
HOST_SYSTEM_ROOTS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32", "/opt/runner-system")
# Programs whose first argument is the script they run from the tool's folder.
INTERPRETER = re.compile(
    r"(python[0-9.]*|pypy[0-9.]*|sh|bash|dash|zsh|node|nodejs|deno|ruby|perl|php|lua|Rscript)"
)


def inside_to_host(path: str, tool_dir: Path) -> Path | None:
    """Where an absolute path inside the subprocess sandbox is on the host (None: hidden)."""
    pure = PurePosixPath(os.path.normpath(path))  # no ".." climbing out of /tool
    if pure == PurePosixPath(TOOL_MOUNT) or pure.is_relative_to(TOOL_MOUNT):
        return tool_dir / pure.relative_to(TOOL_MOUNT)
    if any(pure == PurePosixPath(root) or pure.is_relative_to(root) for root in HOST_SYSTEM_ROOTS):
        return Path(pure)
    return None


def _runnable_by_others(path: Path) -> bool:
    try:
        info = path.stat()
    except OSError:
        return False
    return stat.S_ISREG(info.st_mode) and bool(info.st_mode & stat.S_IXOTH)


def host_command_problem(command: Sequence[str], env: dict[str, str], tool_dir: Path) -> str | None:
    """Why ``command[0]`` will not start in the subprocess sandbox, or None when it will."""
    program = command[0]
    if "/" not in program:
        for folder in search_path(env):
            host = inside_to_host(f"{folder}/{program}", tool_dir)
            if host is not None and _runnable_by_others(host):
                return None
        return f"command {program!r} is not found on the sandbox's PATH ({':'.join(search_path(env))})"
    inside = program if program.startswith("/") else f"{TOOL_MOUNT}/{program}"
    host = inside_to_host(inside, tool_dir)
    if host is None:
        return f"command {program!r} is outside what the sandbox sees (system folders and {TOOL_MOUNT})"
    if not _runnable_by_others(host):
        return f"command {program!r} is missing or not executable by others"
    return None


def script_problem(command: Sequence[str], tool_dir: Path) -> str | None:
    """Why the script an interpreter is given cannot be read in the sandbox, or None."""
    if len(command) < 2 or not INTERPRETER.fullmatch(PurePosixPath(command[0]).name):
        return None
    script = command[1]
    if script.startswith("-"):
        return None  # an option (python3 -m module, sh -c ...): nothing to find
    inside = os.path.normpath(script if script.startswith("/") else f"{TOOL_MOUNT}/{script}")
    if not PurePosixPath(inside).is_relative_to(TOOL_MOUNT):
        return None  # a system script: the command check covers the system folders
    host = inside_to_host(inside, tool_dir)
    if host is None or not host.is_file():
        return f"script {script!r} does not exist in the tool folder"
    for part in [host, *host.parents]:
        if part == tool_dir.parent:
            break
        try:
            mode = part.stat().st_mode
        except OSError:
            return f"script {script!r} cannot be looked at"
        if part != host and not mode & stat.S_IXOTH:
            return f"script {script!r}: the sandbox user cannot enter {part.name!r} (chmod o+x)"
        if part == host and not mode & stat.S_IROTH:
            return f"script {script!r} is not readable by others, so not by the sandbox user (chmod o+r)"
    return None


@contextlib.contextmanager
def image_probe() -> Iterator[ImageProbe | str]:
    """An ``ImageProbe`` on the docker backend's images, or why there is none (the daemon
    is unreachable)."""
    from sandboxes import BackendConfigError, ProbesImages, SandboxUnavailable, plugins

    try:
        backend = plugins.create("docker")
        if not isinstance(backend, ProbesImages):
            raise SandboxUnavailable("the docker backend cannot look into its images")
        probe = backend.image_probe()
    except (BackendConfigError, SandboxUnavailable) as exc:
        yield str(exc)
        return
    except plugins.UnknownBackend:
        yield "no docker backend is installed"
        return
    try:
        yield probe
    finally:
        probe.close()
