"""The ``docker`` backend: one container per attempt, created in ``prepare`` and removed
in ``close``.

The container gets: the tool's folder read-only at ``/tool`` (working directory), a
size-limited tmpfs ``/tmp``, a read-only root, no network unless allowed, no
capabilities, ``no-new-privileges``, a uid of its own (``sandboxes._identity``), an init
process, the memory (swap equal to memory), CPU and pids limits, and no daemon-side log
(the output is read through the attach socket only; a log would copy a flood onto the
host's disk). Never a fallback to running outside a container: every failure to get one
is ``SandboxUnavailable``.

The modules beside this one: ``_container`` (the container's configuration and the gate
its tool waits behind), ``_prepared`` (one attempt's container, cold or warm, and its
run), ``_attach`` (its attach socket), ``_outcome`` (how its run ended), ``_session`` (a
container kept for the calls of a session), ``_probe`` (questions about images, for
``runner validate``).
"""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict

from sandboxes._config import read_config
from sandboxes._deferred import DeferredTeardown
from sandboxes._identity import lease_identity
from sandboxes._owners import pid_alive
from sandboxes._prepare import Preparers, prepare_in_thread, start_ahead
from sandboxes._staging import STAGING_ROOT
from sandboxes._watchdog import prestart as prestart_watchdog
from sandboxes._watchdog import watch
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import Check, LaunchSpec, Limits, SandboxUnavailable, ToolRequirements
from sandboxes.docker._checks import TCP_V1_PROBLEM
from sandboxes.docker._client import (
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_SPACE,
    api_client,
    daemon_call,
    daemon_failures,
    gone_spaces,
    owner_space,
    shared_client,
)
from sandboxes.docker._container import create_container, gate_release
from sandboxes.docker._egress import egress_problem
from sandboxes.docker._prepared import PreparedContainer
from sandboxes.session import SessionSandbox

if TYPE_CHECKING:
    from docker import APIClient

    from sandboxes.docker._probe import DaemonImageProbe

__all__ = ["DockerConfig", "DockerSandbox", "PreparedContainer", "create", "remove_leftovers"]


class DockerConfig(BaseModel):
    """The policy's ``sandbox.backends.docker`` mapping."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    runtime: str | None = None  # OCI runtime of every docker tool (e.g. runsc); per tool: tools.NAME.runtime


def create(config: Mapping[str, Any]) -> DockerSandbox:
    """The entry point of ``docker`` in ``runner.sandboxes``.

    Raises:
        BackendConfigError: an unknown key or a wrong type in ``config``.
    """
    return DockerSandbox(read_config(DockerConfig, "docker", config))


class DockerSandbox:
    """Creates a fresh container per attempt. The daemon is contacted on first use."""

    name = "docker"

    def __init__(self, config: DockerConfig | None = None) -> None:
        self.config = config or DockerConfig()
        self._swept = False
        self._lock = threading.Lock()
        self._cgroup_v1: bool | None = None
        self._sequence = itertools.count(1)
        # Removing containers already dead (``PreparedContainer.close``), off the call's path.
        self.teardowns = DeferredTeardown("runner-teardown-docker")
        self.preparers = Preparers("runner-prepare-docker")

    async def aclose(self) -> None:
        """Wait until every deferred removal is done (``sandboxes._deferred``), and join
        the preparation threads."""
        await asyncio.to_thread(self._join_threads)

    def _join_threads(self) -> None:
        self.preparers.shutdown()
        self.teardowns.wait()

    def tool_problems(self, tool: ToolRequirements) -> list[str]:
        return [] if tool.image else ["image: required when sandbox is docker"]

    def start_early(self) -> None:
        """Begin starting the runner's watchdog, which removes this process's containers
        should it die, without waiting for it (``StartsEarly``)."""
        prestart_watchdog()

    def image_probe(self) -> DaemonImageProbe:
        """Questions about images to the daemon (``ProbesImages``); the caller closes it.

        Raises:
            SandboxUnavailable: the daemon cannot be reached.
        """
        from sandboxes.docker._probe import DaemonImageProbe

        return DaemonImageProbe(api_client())

    def checks(self) -> list[Check]:
        """``runner doctor``: the daemon, the base image, gVisor."""
        from sandboxes.docker._checks import daemon_checks

        return daemon_checks()

    def client(self) -> APIClient:
        client = shared_client()
        with self._lock:
            if not self._swept:
                remove_leftovers(client)
                self._swept = True
        return client

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedContainer:
        return await prepare_in_thread(lambda: self._prepare(spec, limits), self.preparers)

    def prestart(self, spec: LaunchSpec, limits: Limits) -> PreparedContainer:
        """A container already started, its cgroup complete and its tool released from the
        gate, waiting on stdin for its payload (blocking: the pool's thread)."""
        return start_ahead(spec, lambda: self._prepare(spec, limits))

    async def open_session(self, spec: LaunchSpec, limits: Limits) -> SessionSandbox:
        """A container kept for the calls of one session (``HoldsSessions``)."""
        from sandboxes.docker._session import open_session

        return await open_session(self, spec, limits)

    def _prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedContainer:
        """A created container, not yet started (blocking)."""
        if not spec.image:
            raise SandboxUnavailable("the docker sandbox needs an image")
        gate_input = gate_release(spec.secrets)  # before any container exists: it may refuse
        try:
            # Before any container exists: this process's watchdog removes every container
            # labelled with our pid should we die (the daemon, not we, is their parent).
            watch("docker")
            if os.geteuid() == 0:
                watch("staging", str(STAGING_ROOT))
        except OSError as exc:
            raise SandboxUnavailable(f"cannot start the runner's watchdog: {exc.strerror}") from exc
        problem = egress_problem(spec, spec.runtime or self.config.runtime)
        if problem is not None:
            raise SandboxUnavailable(problem)
        client = self.client()
        cgroup_v1 = self._daemon_cgroup_v1(client)
        if cgroup_v1 and os.geteuid() != 0:
            raise SandboxUnavailable(f"not root: {TCP_V1_PROBLEM}")
        lease = lease_identity()
        workspace = None
        try:
            name = f"{os.getpid()}-docker-{next(self._sequence)}"
            workspace = GrantedWorkspace.open(spec, limits.disk_mb, name)
            container_id = create_container(client, spec, limits, lease, workspace, self.config.runtime)
        except BaseException:
            if workspace is not None:
                workspace.release()
            lease.release()
            raise
        return PreparedContainer(
            client,
            container_id,
            limits,
            cgroup_v1=cgroup_v1,
            release=gate_input,
            teardowns=self.teardowns,
            egress=spec.egress,  # a warm container has none (``start_ahead``)
            # Under another OCI runtime (gVisor) the host cgroup holds the runtime's own
            # processes, alive until the container is deleted: its emptiness proves nothing.
            cgroup_shows_processes=not (spec.runtime or self.config.runtime),
            lease=lease,
            workspace=workspace,
        )

    def _daemon_cgroup_v1(self, client: APIClient) -> bool:
        """Whether the daemon's containers live in cgroup v1 (an older daemon that does not
        say is taken to be v1: the stricter case)."""
        if self._cgroup_v1 is None:
            with daemon_call("describe itself (docker info)"):
                info = client.info()
            self._cgroup_v1 = str(info.get("CgroupVersion", "1")) != "2"
        return self._cgroup_v1


def remove_leftovers(client: APIClient) -> int:
    """Remove containers of ours whose runner process is gone (a killed runner): of this
    process's pid namespace (or not labelled with one), when that pid is gone; of another
    pid namespace of this machine, when no process is left in it.

    Raises:
        SandboxUnavailable: the daemon cannot list containers.
    """
    removed = 0
    with daemon_call("list containers"):
        containers = client.containers(all=True, filters={"label": f"{LABEL_MANAGED}=true"})
    here = owner_space()
    elsewhere = {(c.get("Labels") or {}).get(LABEL_SPACE, here) for c in containers} - {here}
    gone = gone_spaces(elsewhere) if elsewhere else set()
    for container in containers:
        labels = container.get("Labels") or {}
        owner = labels.get(LABEL_OWNER, "")
        space = labels.get(LABEL_SPACE, here)
        if space != here and space not in gone:
            continue  # another pid namespace's (alive, or not seen from here), or machine's
        if space == here and owner.isdigit() and pid_alive(int(owner)):
            continue
        # Best effort: another runner may be removing the same leftover right now.
        with contextlib.suppress(*daemon_failures()):
            client.remove_container(container["Id"], v=True, force=True)
            removed += 1
    return removed
