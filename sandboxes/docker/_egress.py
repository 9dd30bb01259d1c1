"""The egress proxy inside a container that has no network (``network_mode: none``).

The runner (root, beside a local daemon) makes the proxy's listener inside the
container's own network namespace, found through its init's ``/proc/PID/ns/net``,
while the tool is still held by the gate: the proxy is there before the tool reads its
input, and the container has loopback only, as in the subprocess backend.
"""

from __future__ import annotations

import os
import socket
from typing import TYPE_CHECKING

from sandboxes._netns import NamespaceError, listen_inside
from sandboxes.base import LaunchSpec, SandboxUnavailable
from sandboxes.docker._client import daemon_call

if TYPE_CHECKING:
    from docker import APIClient

# gVisor's network stack lives inside its sandbox: a listener in the namespace of its
# host-side process would never be seen by the tool.
USERSPACE_NETWORK_RUNTIMES = frozenset({"runsc"})


def egress_problem(spec: LaunchSpec, runtime: str | None) -> str | None:
    """Why an allow-list cannot be given to this container here; None when it can."""
    if spec.egress is None:
        return None
    if os.geteuid() != 0:
        return "an allow-list in a container needs the runner to run as root beside the daemon"
    if runtime in USERSPACE_NETWORK_RUNTIMES:
        return f"an allow-list cannot be given to the {runtime} runtime's own network stack"
    return None


def listener_in(client: APIClient, container_id: str, port: int) -> socket.socket:
    """A listener on ``127.0.0.1:port`` inside the started container's namespace.

    Raises:
        SandboxUnavailable: the container's process is not on this host or is gone.
    """
    with daemon_call("inspect the container"):
        pid = int(client.inspect_container(container_id)["State"].get("Pid") or 0)
    if pid <= 0:
        raise SandboxUnavailable("the container stopped before its egress proxy was set up")
    try:
        return listen_inside(f"/proc/{pid}/ns/net", port)
    except NamespaceError as exc:
        raise SandboxUnavailable(f"cannot open the egress proxy in the container: {exc.strerror}") from exc
