"""Reaching the Docker daemon, with every wait bounded and every failure named."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from docker import APIClient

import contextlib
import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

from sandboxes.base import SandboxUnavailable

# A daemon that does not answer a ping in this long is treated as unreachable.
CONNECT_TIMEOUT_S = 2
# API calls (create, start, inspect, remove) on a healthy daemon take milliseconds.
API_TIMEOUT_S = 15
LABEL_MANAGED = "io.runner.managed"
LABEL_REQUEST = "io.runner.request-id"
LABEL_OWNER = "io.runner.owner-pid"
# A pid names a process only within one pid namespace of one machine: a runner in a
# container given the host's socket, or on another machine sharing the daemon, sees other
# pids. (Not the boot: a leftover of a boot before must still be swept after it.)
LABEL_SPACE = "io.runner.owner-space"
START_DOCKER_HINT = "start the Docker daemon (dockerd) or set DOCKER_HOST"
JOIN_GROUP_HINT = (
    "add this user to the docker group (usermod -aG docker USER, then log in again), "
    "or use rootless Docker: DOCKER_HOST=unix://$XDG_RUNTIME_DIR/docker.sock"
)


def _permission_denied(exc: BaseException) -> bool:
    """Whether a PermissionError is anywhere in ``exc``'s causes or arguments (the SDK
    wraps the socket's error in two layers of its own)."""
    seen: BaseException | None = exc
    for _ in range(8):
        if seen is None:
            return False
        if isinstance(seen, PermissionError) or "Permission denied" in str(seen):
            return True
        seen = seen.__cause__ or seen.__context__
    return False


def reach_fix(exc: BaseException | None) -> str:
    """The fix for a daemon ``api_client`` could not reach, from why it could not."""
    return JOIN_GROUP_HINT if exc is not None and _permission_denied(exc) else START_DOCKER_HINT


def api_client() -> APIClient:
    """A low-level client (``docker.APIClient``) that has answered a ping.

    Raises:
        SandboxUnavailable: the SDK is missing or the daemon cannot be reached.
    """
    try:
        import docker
        from docker.errors import DockerException
    except ImportError as exc:
        raise SandboxUnavailable("the docker Python package is not installed") from exc
    base_url = os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"
    client = None
    try:
        client = docker.APIClient(base_url=base_url, version="auto", timeout=CONNECT_TIMEOUT_S)
        client.ping()
    except (DockerException, OSError) as exc:
        if client is not None:
            client.close()
        if _permission_denied(exc):
            why = f"permission denied on the Docker socket {base_url.removeprefix('unix://')}"
            raise SandboxUnavailable(f"{why}; {JOIN_GROUP_HINT}") from exc
        raise SandboxUnavailable(f"cannot reach the Docker daemon; {START_DOCKER_HINT}") from exc
    client.timeout = API_TIMEOUT_S
    return client


@functools.cache
def owner_space() -> str:
    """This process's machine and pid namespace (``MACHINE:PIDNS_INODE``): where its owner
    label's pid means what it says. The machine is its machine id, else its host name."""
    machine = ""
    for source in ("/etc/machine-id", "/var/lib/dbus/machine-id"):
        with contextlib.suppress(OSError):
            machine = machine or Path(source).read_text().strip()
    try:
        space = Path("/proc/self/ns/pid").stat().st_ino
    except OSError:
        space = 0
    return f"{machine or os.uname().nodename}:{space}"


INIT_PID_NAMESPACE = 0xEFFFFFFC  # the kernel's inode of the first pid namespace (PROC_PID_INIT_INO)


def gone_spaces(spaces: set[str]) -> set[str]:
    """Of ``spaces`` (owner spaces of other pid namespaces), those of this machine whose
    namespace has no process left, as root in the first pid namespace sees them; none when
    not that (another user's processes' namespaces cannot be read: it cannot tell)."""
    machine, _, ours = owner_space().rpartition(":")
    if ours != str(INIT_PID_NAMESPACE) or os.geteuid() != 0:
        return set()
    live: set[str] = set()
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            # Gone meanwhile, or one root may not look into (this machine's own init, when
            # it is itself a container's): not a runner's of this machine.
            with contextlib.suppress(OSError):
                live.add(f"{machine}:{(entry / 'ns' / 'pid').stat().st_ino}")
    return {space for space in spaces if space.rpartition(":")[0] == machine and space not in live}


def owner_labels() -> dict[str, str]:
    """The labels that say which runner a container is, for the sweeps of leftovers."""
    return {LABEL_MANAGED: "true", LABEL_OWNER: str(os.getpid()), LABEL_SPACE: owner_space()}


def owner_filter(pid: int) -> list[str]:
    """The label filter for runner ``pid``'s containers, in this process's pid space."""
    return [f"{LABEL_OWNER}={pid}", f"{LABEL_SPACE}={owner_space()}"]


_shared: dict[str, APIClient] = {}
_shared_lock = threading.Lock()


def image_exists(client: APIClient, tag: str) -> bool:
    """Whether the daemon has image ``tag``.

    Raises:
        SandboxUnavailable: the daemon could not say.
    """
    from docker.errors import ImageNotFound

    try:
        client.inspect_image(tag)  # type: ignore[no-untyped-call]  # untyped in types-docker
    except ImageNotFound:
        return False
    except daemon_failures() as exc:
        raise SandboxUnavailable(f"docker failed to inspect image {tag}: {type(exc).__name__}") from exc
    return True


def shared_client() -> APIClient:
    """One client per daemon address per process: its connection pool is reused by
    every sandbox and every ``Runner``, and lives as long as the process.

    Raises:
        SandboxUnavailable: as ``api_client``.
    """
    key = os.environ.get("DOCKER_HOST") or ""
    with _shared_lock:
        client = _shared.get(key)
        if client is None:
            client = api_client()
            _shared[key] = client
        return client


@functools.cache
def daemon_failures() -> tuple[type[Exception], ...]:
    """The exceptions through which the daemon fails a call, and only those (anything else
    is a bug of ours and goes up, for the runner to report as ``internal``)::

        docker.errors.DockerException   the daemon refused or answered an error (APIError,
                                        NotFound, ImageNotFound, InvalidVersion, ...)
        requests.RequestException       the HTTP exchange failed: connection refused or
                                        reset, read timeout (a subclass of OSError)
        urllib3.exceptions.HTTPError    the same, raised from below requests (an answer
                                        cut off mid-stream)
        OSError                         the socket itself: the connection to the daemon lost
    """
    from docker.errors import DockerException
    from requests.exceptions import RequestException
    from urllib3.exceptions import HTTPError

    return (DockerException, RequestException, HTTPError, OSError)


@contextlib.contextmanager
def daemon_call(doing: str) -> Iterator[None]:
    """Turn the daemon's known failures inside the block into ``SandboxUnavailable``.

    Raises:
        SandboxUnavailable: the block raised one of ``daemon_failures()``; the message
            names what was being done and the exception's type, never its text (which may
            hold host paths).
    """
    try:
        yield
    except daemon_failures() as exc:
        raise SandboxUnavailable(f"docker failed to {doing}: {type(exc).__name__}") from exc
