"""A container made for one attempt: the gate its tool waits behind, the container's
configuration, its removal.

The tool's command waits behind a gate (a shell reading one line) until the container's
cgroup is complete: on cgroup v1 its TCP buffers get their own limit, which only counts
sockets created after it is set.
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections.abc import Mapping
from secrets import token_hex
from typing import TYPE_CHECKING, Any

from sandboxes._exec_status import EXEC_GUARD
from sandboxes._identity import IdentityLease
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import LaunchSpec, Limits, SandboxUnavailable
from sandboxes.docker._client import LABEL_MANAGED, LABEL_REQUEST, daemon_call, daemon_failures, owner_labels
from sandboxes.docker._trailer import MARKER
from sandboxes.view import LIBRARY_MOUNT, LIBRARY_SOURCE, SCRATCH_MOUNT, TOOL_MOUNT, WORKSPACE_MOUNT, tool_env

if TYPE_CHECKING:
    from docker import APIClient

SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# Networked tools' containers: a bridge of their own on which they cannot reach each other
# (on Docker's default bridge one call could connect to another's, or a session's, ports).
TOOL_NETWORK = "runner-tools"  # the start of its name
_TOOLS_LABEL = "io.runner.tools-network"
_TOOLS_LABELS = {LABEL_MANAGED: "true", _TOOLS_LABEL: "true"}
_NO_ICC = "com.docker.network.bridge.enable_icc"
_networks_lock = threading.Lock()
BUILD_HINT = "run `runner images build`"
# Holds the tool until the runner writes its release on stdin, once the cgroup is
# complete. The release is first the gate's own token (its trailer, ``_trailer``), then the
# secrets, so
# that they are in the tool's environment without being in the container's config (``Env``,
# which anyone allowed to ``docker inspect`` reads): a count of secrets, then per secret
# its name, its number of lines and those lines. Values are only ever read and assigned,
# never parsed by the shell; then the exec guard's token (``sandboxes._exec_status``: an
# exec that fails is told from a tool that exits 126 or 127 itself), read by the subshell
# that execs the tool, so the gate itself never holds it. ``read`` takes one byte at a
# time, so the tool's stdin starts right after the release. The gate waits for the tool
# and says how it ended in its trailer (``_trailer``), on stdout and stderr.
_GATE_RELEASE = r"""
unset runner_gate_token; read -r runner_gate_token || exit 125
read -r count || exit 125
while [ "$count" -gt 0 ]; do
  IFS= read -r name && IFS= read -r lines || exit 125
  value= sep=
  while [ "$lines" -gt 0 ]; do
    IFS= read -r line || exit 125
    value="$value$sep$line"
    sep='
'
    lines=$((lines - 1))
  done
  export "$name=$value" || exit 125
  count=$((count - 1))
done
unset count name lines value sep line PWD
"""
GATE = (
    _GATE_RELEASE
    + "("
    + EXEC_GUARD
    + r"""; exec "$@")
status=$?
printf '%s %s %s\n' """
    + MARKER.decode()
    + r""" "$runner_gate_token" "$status"
printf '%s %s %s\n' """
    + MARKER.decode()
    + r""" "$runner_gate_token" "$status" >&2
exit "$status"
"""
)
# Under another OCI runtime (gVisor) the gate execs the tool and says nothing after it:
# there, the host cgroup shows the runtime's processes, not the tool's, so no trailer
# could be trusted to mean the end, and gVisor counts the waiting gate against the
# container's pids limit (its fork was refused). The release it reads is the same.
PLAIN_GATE = _GATE_RELEASE + EXEC_GUARD + '\nexec "$@"\n'


def create_container(
    client: APIClient,
    spec: LaunchSpec,
    limits: Limits,
    lease: IdentityLease,
    workspace: GrantedWorkspace | None,
    runtime: str | None,
) -> str:
    from docker.errors import APIError, ImageNotFound
    from docker.types import LogConfig, Ulimit

    env = tool_env(spec, SCRATCH_MOUNT, WORKSPACE_MOUNT if workspace is not None else None)
    binds: dict[str, Mapping[str, str]] = {
        str(spec.tool_dir): {"bind": TOOL_MOUNT, "mode": "ro"},
        str(LIBRARY_SOURCE): {"bind": LIBRARY_MOUNT, "mode": "ro"},
    }
    if workspace is not None:
        binds[str(workspace.source)] = {
            "bind": WORKSPACE_MOUNT,
            "mode": "rw" if spec.workspace_mode == "write" else "ro",
        }
    memory = f"{limits.memory_mb}m"
    try:
        # Checked against the daemon's API version (InvalidVersion): inside the try.
        host_config = client.create_host_config(
            binds=binds,
            tmpfs={SCRATCH_MOUNT: f"rw,nosuid,nodev,size={limits.disk_mb}m,mode=1777"},
            shm_size=f"{limits.disk_mb}m",  # not Docker's 64 MB: /dev/shm is scratch too
            read_only=True,
            network_mode=tool_network(client) if limits.network else "none",
            cap_drop=["ALL"],
            security_opt=["no-new-privileges"],
            init=True,
            mem_limit=memory,
            memswap_limit=memory,
            pids_limit=limits.max_pids,
            nano_cpus=1_000_000_000,  # one CPU at most: a spinner cannot starve the host
            ulimits=[Ulimit(name="cpu", soft=limits.cpu_seconds, hard=limits.cpu_seconds + 1)],
            runtime=spec.runtime or runtime,
            log_config=LogConfig(type=LogConfig.types.NONE),
        )
        created = client.create_container(
            spec.image,
            # The image's own ENTRYPOINT would get the gate as its arguments, and the release.
            entrypoint=["/bin/sh", "-c", PLAIN_GATE if spec.runtime or runtime else GATE, "sh"],
            command=list(spec.command),
            stdin_open=True,
            detach=False,  # with stdin_open: StdinOnce, so our half-close ends its input
            tty=False,
            user=f"{lease.uid}:{lease.gid}",  # a uid of its own, as in the subprocess backend
            working_dir=TOOL_MOUNT,
            environment=env,
            labels=owner_labels() | {LABEL_REQUEST: spec.request_id},
            network_disabled=not limits.network,
            host_config=host_config,
        )
    except ImageNotFound as exc:
        raise SandboxUnavailable(f"image {spec.image} not found; {BUILD_HINT}") from exc
    except APIError as exc:
        explanation = " ".join(str(exc.explanation or exc).split())[:200]
        raise SandboxUnavailable(f"docker refused the container: {explanation}") from exc
    except daemon_failures() as exc:
        raise SandboxUnavailable(f"docker failed to create the container: {type(exc).__name__}") from exc
    return str(created["Id"])


def tool_network(client: APIClient) -> str:
    """The name of the network of networked tools (made when missing), its containers cut
    off from one another. Looked up for each container: one removed meanwhile is made again.

    Raises:
        SandboxUnavailable: the daemon failed, or a network labelled as the tools' lets its
            containers reach each other.
    """
    with _networks_lock, daemon_call("find or make the tools' network"):
        found = _tool_networks(client)
        if not found:
            # A name of its own: the daemon resolves a container's network by name when it
            # starts it, and two networks of one name (made by runners at the same moment)
            # would name neither.
            name = f"{TOOL_NETWORK}-{token_hex(6)}"
            client.create_network(name, "bridge", {_NO_ICC: "false"}, labels=_TOOLS_LABELS)
            found = _tool_networks(client)
        open_ones = [n for n in found if (n.get("Options") or {}).get(_NO_ICC) != "false"]
        if open_ones or not found:
            raise SandboxUnavailable(
                "a Docker network labelled as the tools' lets its containers reach each other;"
                f" remove it (docker network rm {open_ones[0]['Name'] if open_ones else TOOL_NETWORK})"
            )
        # Several only when runners made one at the same moment (each that looked before the
        # others' showed takes its own): each is cut off alike, later lookups take the first
        # by id, and none is removed (a container made on one, not started yet, would fail).
        return str(min(found, key=lambda n: str(n["Id"]))["Name"])


def _tool_networks(client: APIClient) -> list[dict[str, Any]]:
    return list(client.networks(filters={"label": f"{_TOOLS_LABEL}=true"}))


def gate_release(secrets: Mapping[str, str]) -> bytes:
    """What the gate reads before it lets the tool run: the secrets, as ``GATE`` says.

    Raises:
        SandboxUnavailable: a name the shell could not export, or a NUL in a value.
    """
    parts = [str(len(secrets))]
    for name, value in secrets.items():
        if not SECRET_NAME.fullmatch(name) or "\0" in value:
            raise SandboxUnavailable("a secret's name or value cannot be passed to the container")
        lines = value.split("\n")
        parts += [name, str(len(lines)), *lines]
    return ("\n".join(parts) + "\n").encode("utf-8")


def remove_container(client: APIClient, container_id: str) -> None:
    # A daemon failure leaves the container to the watchdog, which removes this process's
    # containers when it exits, or to the next runner's sweep (remove_leftovers).
    with contextlib.suppress(*daemon_failures()):
        client.remove_container(container_id, v=True, force=True)  # v: an image VOLUME's too
