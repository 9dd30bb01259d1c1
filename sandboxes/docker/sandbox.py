"""One container per attempt, created in ``prepare`` and removed in ``close``.

The container gets: the tool's folder read-only at ``/tool`` (working directory), a
size-limited tmpfs ``/tmp``, a read-only root, no network unless allowed, no
capabilities, ``no-new-privileges``, a uid of its own (``sandboxes._identity``), an init
process, the memory (swap equal to memory), CPU and pids limits, and no daemon-side log
(the output is read through the attach socket only; a log would copy a flood onto the
host's disk). Never a fallback
to running outside a container: every failure to get one is ``SandboxUnavailable``.

The tool's command waits behind a gate (a shell reading one line) until the container's
cgroup is complete: on cgroup v1 its TCP buffers get their own limit, which only counts
sockets created after it is set. While the container runs its cgroup is polled, so a
limit broken by any of its processes ends the attempt with that limit's reason.

A warm container (``prestart``, SPEC 11) goes as far ahead of its call as the payload
allows: created, attached, started, its cgroup completed and its gate released, so its
tool waits on stdin; its run writes the payload and attends as a cold one, the timeout
counting from the payload. It serves that one call and is removed after it. A warm
container of an MCP server may also be primed (``prime``: its ``initialize`` said ahead
through the attach socket, ``sandboxes._priming``); its dialogue then starts past it.

SDK pitfalls handled here: the attach socket is written through its underlying socket;
end of input is a half-close (``stdin_once`` makes Docker pass it on); stdout and stderr
arrive multiplexed in 8-byte-header frames (no TTY); reads run under our own deadline.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from docker import APIClient

import asyncio
import contextlib
import dataclasses
import enum
import itertools
import math
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Mapping
from typing import Any

from pydantic import BaseModel, ConfigDict

from sandboxes._config import read_config
from sandboxes._deferred import DeferredTeardown
from sandboxes._exchange import DialogueExchange, Exchange, PayloadExchange, StdoutSink
from sandboxes._exec_status import EXEC_GUARD, exec_failure, new_token, token_line
from sandboxes._identity import IdentityLease, lease_identity
from sandboxes._kernel import signal_from_init_status
from sandboxes._netns_sockets import SandboxSockets
from sandboxes._owners import pid_alive
from sandboxes._prepare import Preparers, prepare_in_thread, start_ahead
from sandboxes._priming import Opened, prime_with
from sandboxes._socket_memory import tcp_budget
from sandboxes._staging import STAGING_ROOT
from sandboxes._streams import OutputOverflow, TailBuffer
from sandboxes._watchdog import watch
from sandboxes._workspace import GrantedWorkspace
from sandboxes.base import (
    Check,
    Dialogue,
    EgressEndpoint,
    LaunchSpec,
    Limits,
    Opening,
    OpeningFailed,
    SandboxOutcome,
    SandboxUnavailable,
    StopReason,
    ToolRequirements,
)
from sandboxes.docker._cgroup import ContainerCgroup
from sandboxes.docker._client import (
    LABEL_MANAGED,
    LABEL_OWNER,
    LABEL_REQUEST,
    daemon_call,
    daemon_failures,
    shared_client,
)
from sandboxes.docker._egress import egress_problem, listener_in
from sandboxes.docker._frames import STDOUT, FrameDecoder
from sandboxes.docker._prime import SocketPipe
from sandboxes.docker._trailer import MARKER, TrailerReader, both_said
from sandboxes.view import (
    LIBRARY_MOUNT,
    LIBRARY_SOURCE,
    READ_CHUNK,
    SCRATCH_MOUNT,
    STDERR_TAIL_BYTES,
    TOOL_MOUNT,
    WORKSPACE_MOUNT,
    tool_env,
)

SECRET_NAME = re.compile(r"[A-Za-z_][A-Za-z0-9_]*")
# After the output ends, the exit status is a moment away; bound the wait anyway.
EXIT_GRACE_S = 5.0
BUILD_HINT = "run `runner images build`"
# How often the container's cgroup is read: CPU time, OOM kills and refused forks of all
# its processes. A fork bomb that gives up and exits within one poll can still slip past.
LIMITS_POLL_S = 0.02
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
        prepared = await prepare_in_thread(lambda: self._prepare(spec, limits), self.preparers)
        prepared.egress = spec.egress
        return prepared

    def prestart(self, spec: LaunchSpec, limits: Limits) -> PreparedContainer:
        """A container already started, its cgroup complete and its tool released from the
        gate, waiting on stdin for its payload (blocking: the pool's thread)."""
        return start_ahead(spec, lambda: self._prepare(spec, limits))

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
        lease = lease_identity()
        workspace = None
        try:
            name = f"{os.getpid()}-docker-{next(self._sequence)}"
            workspace = GrantedWorkspace.open(spec, limits.disk_mb, name)
            container_id = _create(client, spec, limits, lease, workspace, self.config.runtime)
        except BaseException:
            if workspace is not None:
                workspace.release()
            lease.release()
            raise
        prepared = PreparedContainer(
            client, container_id, limits, cgroup_v1=cgroup_v1, release=gate_input, teardowns=self.teardowns
        )
        # Under another OCI runtime (gVisor) the host cgroup holds the runtime's own
        # processes, alive until the container is deleted: its emptiness proves nothing.
        prepared.cgroup_shows_processes = not (spec.runtime or self.config.runtime)
        prepared.hold(lease, workspace)
        return prepared

    def _daemon_cgroup_v1(self, client: APIClient) -> bool:
        """Whether the daemon's containers live in cgroup v1 (an older daemon that does not
        say is taken to be v1: the stricter case)."""
        if self._cgroup_v1 is None:
            with daemon_call("describe itself (docker info)"):
                info = client.info()
            self._cgroup_v1 = str(info.get("CgroupVersion", "1")) != "2"
        return self._cgroup_v1


def remove_leftovers(client: APIClient) -> int:
    """Remove containers of ours whose runner process is gone (a killed runner).

    Raises:
        SandboxUnavailable: the daemon cannot list containers.
    """
    removed = 0
    with daemon_call("list containers"):
        containers = client.containers(all=True, filters={"label": f"{LABEL_MANAGED}=true"})
    for container in containers:
        owner = container.get("Labels", {}).get(LABEL_OWNER, "")
        if owner.isdigit() and pid_alive(int(owner)):
            continue
        # Best effort: another runner may be removing the same leftover right now.
        with contextlib.suppress(*daemon_failures()):
            client.remove_container(container["Id"], force=True)
            removed += 1
    return removed


def _create(
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
            read_only=True,
            network_mode="bridge" if limits.network else "none",
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
            command=["/bin/sh", "-c", PLAIN_GATE if spec.runtime or runtime else GATE, "sh", *spec.command],
            stdin_open=True,
            detach=False,  # with stdin_open: StdinOnce, so our half-close ends its input
            tty=False,
            user=f"{lease.uid}:{lease.gid}",  # a uid of its own, as in the subprocess backend
            working_dir=TOOL_MOUNT,
            environment=env,
            labels={LABEL_MANAGED: "true", LABEL_REQUEST: spec.request_id, LABEL_OWNER: str(os.getpid())},
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


class PreparedContainer:
    def __init__(
        self,
        client: APIClient,
        container_id: str,
        limits: Limits,
        *,
        cgroup_v1: bool,
        release: bytes = b"0\n",
        teardowns: DeferredTeardown | None = None,
    ) -> None:
        self._client = client
        self._teardowns = teardowns
        self._dead = False  # every process of the container is known to have ended
        self.cgroup_shows_processes = True  # its processes, and only they, are in its cgroup
        self._release = release
        self.container_id = container_id
        self._limits = limits
        self._cgroup_v1 = cgroup_v1
        self._closed = False
        self._lease: IdentityLease | None = None
        self._workspace: GrantedWorkspace | None = None
        self._pids_refused = 0
        self._oom_killed = False
        self._sockets = SandboxSockets(tcp_budget(limits.memory_mb))  # what its cgroup does not count
        self.egress: EgressEndpoint | None = None
        self._waiting: _Attached | None = None  # started ahead of its call
        self._opened: Opened | None = None  # primed: what the opening left for the call

    async def run(self, payload: bytes) -> SandboxOutcome:
        if self._opened is not None:
            raise SandboxUnavailable("a primed sandbox holds a dialogue, not a payload")
        return await self._hold(PayloadExchange(payload, self._limits.max_output_bytes))

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        exchange = DialogueExchange(dialogue, self._limits.max_output_bytes, self._opened)
        outcome = await self._hold(exchange)
        exchange.raise_failure()
        return outcome

    async def _hold(self, exchange: Exchange) -> SandboxOutcome:
        """Start the container (or take the one started ahead) and let ``exchange`` speak
        with its tool until the run ends.

        Raises:
            SandboxUnavailable: the daemon failed, or the connection to it was lost.
        """
        started = time.monotonic()
        stderr = self._opened.stderr if self._opened is not None else TailBuffer(STDERR_TAIL_BYTES)
        attached, self._waiting = self._waiting, None
        try:
            if attached is None:
                attached = await self._start()
            # The timeout counts from here (``_attend``): for a warm container, the
            # moment of the payload (or the dialogue's start), whenever it was started.
            preamble, attached.unsent = attached.unsent, b""
            ending = await self._attend(attached, exchange, preamble, stderr)
            if ending is _FINISHED:
                # The dialogue's end. The daemon copies stdout and stderr apart: what the
                # tool wrote on stderr before its last answer may still be on its way.
                # Kill, then read the stream to its end (bounded), as the subprocess
                # backend drains its pipes.
                await asyncio.to_thread(self._kill)
                await _drain(attached, stderr)
        except OSError as exc:
            await asyncio.to_thread(self._kill)
            message = f"lost the connection to the Docker daemon: {type(exc).__name__}"
            raise SandboxUnavailable(message) from exc
        finally:
            if attached is not None:
                attached.close()
        if ending is not _OUTPUT_ENDED and ending is not _FINISHED:
            await asyncio.to_thread(self._kill)
        duration_ms = (time.monotonic() - started) * 1000
        if ending is _FINISHED:
            # The dialogue's end, not the tool's: its status is that of our kill.
            return SandboxOutcome(None, None, b"", stderr.text(), duration_ms)
        state = await self._settled(attached) if attached.said is not None else None
        if state is None:
            state = await asyncio.to_thread(self._final_state)
        self._dead = "ExitCode" in state and not state.get("Running")
        reason = ending if isinstance(ending, StopReason) else None
        outcome = _outcome(
            state, reason, exchange.output(), stderr, attached.token, duration_ms, not exchange.ends_by_exit
        )
        return self._blame_limits(outcome)

    async def _start(self) -> _Attached:
        """Attach, start, complete the cgroup and put the egress proxy in place; the tool
        is still held by the gate, its release left for ``run`` to write."""
        with daemon_call("attach to the container"):
            sock = await asyncio.to_thread(self._attach_socket)
        attached = _Attached(sock, new_token())
        try:
            with daemon_call("start the container"):
                await asyncio.to_thread(self._client.start, self.container_id)
            attached.cgroup = await asyncio.to_thread(self._complete_cgroup)
            await self._attach_egress()
        except BaseException:
            attached.close()
            raise
        attached.unsent = attached.release(self._release)
        return attached

    # -- started ahead of the call (SPEC 11) --------------------------------------------

    def start_waiting(self) -> None:
        """Start the container now and release its tool from the gate, so that it waits
        on stdin for the payload ``run`` writes (blocking: the pool's thread). The cgroup
        is complete before the release, as for a cold run; the exec guard's token is this
        container's own, and the container serves one call only.

        Raises:
            SandboxUnavailable: the daemon failed, or the cgroup could not be completed.
        """
        with daemon_call("attach to the container"):
            sock = self._attach_socket()
        attached = _Attached(sock, new_token())
        try:
            with daemon_call("start the container"):
                self._client.start(self.container_id)
            attached.cgroup = self._complete_cgroup()
            with daemon_call("release the started container"):
                attached.raw.sendall(attached.release(self._release))
        except BaseException:
            attached.close()
            raise
        self._waiting = attached

    def prime(self, opening: Opening, timeout_s: float) -> None:
        """Hold ``opening`` with the tool of the container started ahead (blocking: the
        pool's thread).

        Raises:
            OpeningFailed: as ``Primes.prime`` says; the caller discards this container.
        """
        attached = self._waiting
        if attached is None or self._opened is not None:
            raise OpeningFailed("only a container started ahead, and not primed yet, can be primed")
        pipe = SocketPipe(attached.raw, attached.decoder, self._limits.max_output_bytes, timeout_s)
        self._opened = prime_with(opening, pipe)

    def interrupt(self) -> None:
        attached = self._waiting
        if attached is not None:
            with contextlib.suppress(OSError):  # the prime's recv returns b"" at once
                attached.raw.shutdown(socket.SHUT_RDWR)

    def set_timeout(self, timeout_ms: int) -> None:
        self._limits = dataclasses.replace(self._limits, timeout_ms=timeout_ms)

    def discard(self) -> None:
        self._teardown()

    def ended(self) -> str | None:
        """``Waits.ended``: its processes are gone from its cgroup (not told under gVisor)."""
        attached = self._waiting
        if attached is None or attached.cgroup is None or not self.cgroup_shows_processes:
            return None
        return "its container stopped" if attached.cgroup.empty() else None

    def used_cpu_seconds(self) -> float | None:
        attached = self._waiting
        if attached is None or attached.cgroup is None or not self.cgroup_shows_processes:
            return None
        return attached.cgroup.cpu_seconds()

    def _attach_socket(self) -> Any:
        """The container's stdin, stdout and stderr as one socket (blocking)."""
        params = {"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1}
        return self._client.attach_socket(self.container_id, params=params)

    async def _attach_egress(self) -> None:
        """Put the call's egress proxy on the container's loopback; the tool is still gated."""
        if self.egress is None:
            return
        try:
            listener = await asyncio.to_thread(listener_in, self._client, self.container_id, self.egress.port)
            await self.egress.attach(listener)
        except BaseException:
            await asyncio.to_thread(self._kill)
            raise

    def _complete_cgroup(self) -> ContainerCgroup | None:
        """Find the container's cgroup on this host and, on v1, cap its TCP buffers; the
        tool is still held by the gate. None when the daemon is not local (v2 only).

        Raises:
            SandboxUnavailable: on v1, the TCP limit cannot be set (the container is
            killed and the tool never gets its input).
        """
        cgroup = ContainerCgroup.find(self.container_id)
        if not self._cgroup_v1:
            return cgroup
        problem: Exception | None = None
        if cgroup is not None:
            try:
                cgroup.limit_tcp_memory(tcp_budget(self._limits.memory_mb))
            except OSError as exc:
                problem = exc
        if cgroup is None or problem is not None:
            self._kill()
            raise SandboxUnavailable(
                "cannot limit the container's TCP buffers (cgroup v1 counts them apart from "
                "memory_mb; the daemon must be local and the runner root)"
            ) from problem
        return cgroup

    async def _attend(
        self, attached: _Attached, exchange: Exchange, preamble: bytes, stderr: TailBuffer
    ) -> StopReason | _End:
        """Exchange with the tool until its output ends (``_OUTPUT_ENDED``), the exchange
        ends the run (``_FINISHED``), the container as a whole breaks a limit, the output
        overflows or the timeout passes (that limit's reason)."""
        cgroup = attached.cgroup
        talk = asyncio.ensure_future(self._exchange(attached, exchange, preamble, stderr))
        watcher = asyncio.ensure_future(self._watch(cgroup)) if cgroup is not None else None
        tasks = {talk} if watcher is None else {talk, watcher}
        try:
            timeout = self._limits.timeout_ms / 1000
            await asyncio.wait(tasks, timeout=timeout, return_when=asyncio.FIRST_COMPLETED)
            if talk.done():
                if isinstance(talk.exception(), OutputOverflow):
                    return StopReason.OUTPUT_LIMIT
                ending = talk.result()  # a lost connection (OSError) goes up
                if cgroup is not None and ending is _OUTPUT_ENDED:
                    # A tool that hit a limit and exited within the last poll: one more
                    # look while the cgroup is (most often) still there.
                    self._breach(cgroup)
                return ending
            if watcher is not None and watcher.done():
                return watcher.result()
            if cgroup is not None and (breach := self._breach(cgroup)) is not None:
                return breach  # broken within the last poll before the timeout
            return StopReason.TIMEOUT
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

    async def _watch(self, cgroup: ContainerCgroup) -> StopReason:
        """Poll the cgroup until a limit that ends the attempt at once is broken."""
        while (breach := self._breach(cgroup)) is None:
            await asyncio.sleep(LIMITS_POLL_S)
        return breach

    def _breach(self, cgroup: ContainerCgroup) -> StopReason | None:
        """CPU time over the budget, an OOM kill or socket buffers past their share, over all
        the container's processes; a refused fork is only noted (a tool may cope with it).
        Reads 0 once the cgroup is gone."""
        self._pids_refused = max(self._pids_refused, cgroup.pids_refused())
        if cgroup.oom_kills() > 0 or cgroup.sockets_overran() or self._sockets.over_budget(cgroup.members):
            self._oom_killed = True
            return StopReason.MEMORY_LIMIT
        if cgroup.cpu_seconds() > self._limits.cpu_seconds:
            return StopReason.CPU_LIMIT
        return None

    def _blame_limits(self, outcome: SandboxOutcome) -> SandboxOutcome:
        """A failure after a limit was hit is that limit's, not a plain exit or timeout; a
        success after the memory limit broke (an OOM kill, sockets past their share, see
        ``sandboxes._socket_memory``) within the last poll is not one."""
        if outcome.reason is None and self._oom_killed:
            return dataclasses.replace(outcome, reason=StopReason.MEMORY_LIMIT)
        if outcome.reason not in (StopReason.EXIT_CODE, StopReason.SIGNAL, StopReason.TIMEOUT):
            return outcome
        if self._oom_killed:
            return dataclasses.replace(outcome, reason=StopReason.MEMORY_LIMIT)
        if self._pids_refused:
            return dataclasses.replace(outcome, reason=StopReason.PIDS_LIMIT)
        return outcome

    async def _exchange(
        self, attached: _Attached, exchange: Exchange, preamble: bytes, stderr: TailBuffer
    ) -> _End:
        """Let ``exchange`` speak while the frames are read: ``_OUTPUT_ENDED`` at the end of
        the output (the container exited), ``_FINISHED`` when the exchange ends the run.

        Raises:
            OutputOverflow: stdout passed the cap.
            OSError: the connection to the daemon was lost.
        """
        raw = attached.raw
        raw.setblocking(False)
        speaker = asyncio.ensure_future(exchange.speak(_SocketStdin(raw), preamble))
        reader = asyncio.ensure_future(
            _read_frames(
                raw,
                attached.decoder,
                exchange.stdout,
                stderr,
                attached.gate_token,
                self.cgroup_shows_processes,
            )
        )
        watched = {speaker, reader}
        try:
            while True:
                done, _ = await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
                if speaker in done:
                    watched.discard(speaker)
                    if speaker.result():
                        return _FINISHED
                if reader in done:
                    attached.said = reader.result()
                    return _OUTPUT_ENDED
        finally:
            for task in (speaker, reader):
                task.cancel()
            # Never raises their ends (the reader's, if any, was raised above); our own
            # cancellation goes up.
            await asyncio.wait({speaker, reader})

    async def _settled(self, attached: _Attached) -> dict[str, Any] | None:
        """The state the gate's trailer said, once the container's cgroup is empty (the
        gate and its init exit right after the trailer: well within ``SETTLE_S``); None
        when that cannot be seen (a remote daemon), or the container still runs past it
        (a tool that forged the trailer): then it is killed and the daemon says how it
        ended."""
        cgroup = attached.cgroup
        if cgroup is None or not self.cgroup_shows_processes:
            return None
        loop = asyncio.get_running_loop()
        settle_by = loop.time() + SETTLE_S
        while not cgroup.empty():
            if loop.time() > settle_by:
                await asyncio.to_thread(self._kill)
                return None
            await asyncio.sleep(SETTLE_POLL_S)
        self._breach(cgroup)  # a limit broken in the last moments (the cgroup is still there)
        return {"ExitCode": attached.said, "Running": False}

    def _kill(self) -> None:
        # Best effort: a container that already exited answers 409; close() removes it anyway.
        with contextlib.suppress(*daemon_failures()):
            self._client.kill(self.container_id)

    def _final_state(self) -> dict[str, Any]:
        """The container's state; empty when the daemon cannot tell (then the outcome is
        ``sandbox_unavailable``). Any other exception is a bug and goes up."""
        state = self._inspect_state()
        if state.get("Running"):  # most often it has exited by the end of its output: one round trip
            with contextlib.suppress(*daemon_failures()):  # a wait past the grace: inspect tells
                self._client.wait(self.container_id, timeout=math.ceil(EXIT_GRACE_S))
            state = self._inspect_state()
        return state

    def _inspect_state(self) -> dict[str, Any]:
        try:
            inspected = self._client.inspect_container(self.container_id)
        except daemon_failures():
            return {}
        return dict(inspected["State"])

    def hold(self, lease: IdentityLease, workspace: GrantedWorkspace | None) -> None:
        """What this sandbox keeps until ``close``: its uid, and the workspace it was granted."""
        self._lease = lease
        self._workspace = workspace

    async def close(self) -> None:
        if not self._dead or self._waiting is not None or self._teardowns is None:
            await asyncio.to_thread(self._teardown)
            return
        # Every process of the container has ended: staged writes are applied now, on the
        # call's path; removing the dead container (~10 ms of daemon work) and giving back
        # its uid are not (``sandboxes._deferred``; the backend's ``aclose`` waits for them).
        workspace, self._workspace = self._workspace, None
        if workspace is not None:
            await asyncio.to_thread(workspace.release)
        self._teardowns.submit(self._teardown)

    def _teardown(self) -> None:
        """Remove the container, then give back what it held (blocking). Safe to call twice."""
        if self._closed:
            return
        self._closed = True
        self._sockets.close()
        waiting, self._waiting = self._waiting, None
        if waiting is not None:
            waiting.close()
        try:
            _remove(self._client, self.container_id)
        finally:
            try:
                workspace, self._workspace = self._workspace, None
                if workspace is not None:
                    workspace.release()  # applies staged writes
            finally:
                if self._lease is not None:
                    self._lease.release()  # the container, and every process of that uid, is gone
                    self._lease = None


class _End(enum.Enum):
    OUTPUT_ENDED = "output_ended"  # the container exited: its state says how
    FINISHED = "finished"  # the exchange ended the run: a dialogue's ``talk`` returned


_OUTPUT_ENDED, _FINISHED = _End.OUTPUT_ENDED, _End.FINISHED
# After a dialogue's end and the kill, the stream ends as soon as the daemon has copied
# what the pipes held; this only bounds the wait should it not.
STDERR_DRAIN_S = 0.5
# After the gate's trailer its shell and the container's init exit at once; a container
# still running this long after is killed (see ``PreparedContainer._settled``).
SETTLE_S = 0.25
SETTLE_POLL_S = 0.001


class _SocketStdin:
    """The container's stdin, written through the attach socket."""

    def __init__(self, raw: socket.socket) -> None:
        self._raw = raw

    async def write(self, data: bytes) -> None:
        try:
            await asyncio.get_running_loop().sock_sendall(self._raw, data)
        except ConnectionError:
            raise
        except OSError as exc:  # the socket is closed: the container is gone
            raise ConnectionResetError(f"the container's stdin is closed: {exc.strerror}") from exc

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self._raw.shutdown(socket.SHUT_WR)  # end of input, passed on thanks to stdin_once


async def _read_frames(
    raw: socket.socket,
    decoder: FrameDecoder,
    stdout: StdoutSink,
    stderr: TailBuffer,
    gate_token: str = "",
    stop_at_trailer: bool = True,
) -> int | None:
    """Read the attach stream through ``decoder``, each frame to its sink, to its end or,
    given the gate's token, until the gate's trailers (``_trailer``) have come on both
    streams: then the exit status they said (the rest of the stream is left unread).
    Without ``stop_at_trailer`` the trailers are only taken out, and the stream read to
    its end (under another runtime: gVisor's gate ends with an error status when its
    stream is closed under it while it still writes).

    Raises:
        OutputOverflow: stdout passed the cap (reading stops there).
        OSError: the connection to the daemon was lost.
    """
    loop = asyncio.get_running_loop()
    readers = (TrailerReader(stdout, gate_token), TrailerReader(stderr, gate_token)) if gate_token else None
    out, err = readers if readers is not None else (stdout, stderr)
    while chunk := await loop.sock_recv(raw, READ_CHUNK):
        for stream, part in decoder.feed(chunk):
            (out if stream == STDOUT else err).feed(part)
        if stop_at_trailer and readers is not None and (status := both_said(readers)) is not None:
            stdout.close()
            return status
    if readers is not None:
        for reader in readers:
            reader.flush()
    stdout.close()
    return None


class _Discarded:
    """Where stdout goes once a dialogue has ended: nowhere."""

    def feed(self, data: bytes) -> None:
        pass

    def close(self) -> None:
        pass


async def _drain(attached: _Attached, stderr: TailBuffer) -> None:
    """Read a killed container's stream to its end, for the rest of its stderr; at most
    ``STDERR_DRAIN_S``, and a lost connection only ends it sooner."""
    with contextlib.suppress(OSError, TimeoutError):
        async with asyncio.timeout(STDERR_DRAIN_S):
            await _read_frames(attached.raw, attached.decoder, _Discarded(), stderr)


class _Attached:
    """A started container's attach socket, with what its run needs besides."""

    def __init__(self, sock: Any, token: str) -> None:
        self.sock = sock
        self.raw: socket.socket = getattr(sock, "_sock", sock)  # SocketIO is read-only as returned
        self.token = token
        self.cgroup: ContainerCgroup | None = None
        self.unsent = b""  # the gate's release, when not written yet
        self.decoder = FrameDecoder()  # the primer's first, then the run's
        self.gate_token = new_token()  # the gate's trailer's (``_trailer``)
        self.said: int | None = None  # the exit status the gate's trailers said

    def release(self, secrets: bytes) -> bytes:
        """What the gate reads before it execs the tool (``GATE``)."""
        return token_line(self.gate_token) + secrets + token_line(self.token)

    def close(self) -> None:
        with contextlib.suppress(OSError):
            self.raw.close()
        with contextlib.suppress(OSError):
            self.sock.close()


def _remove(client: APIClient, container_id: str) -> None:
    # A daemon failure leaves the container to the watchdog, which removes this process's
    # containers when it exits, or to the next runner's sweep (remove_leftovers).
    with contextlib.suppress(*daemon_failures()):
        client.remove_container(container_id, force=True)


def _outcome(
    state: dict[str, Any],
    reason: StopReason | None,
    stdout: bytes,
    stderr: TailBuffer,
    token: str,
    duration_ms: float,
    zero_fails: bool = False,
) -> SandboxOutcome:
    """The outcome the container's final ``state`` tells; with ``zero_fails`` (a dialogue's
    tool, which should have run until the dialogue's end) even an exit 0 is ``exit_code``."""
    exit_code: int | None = state.get("ExitCode")
    sig: int | None = None
    stderr_tail = stderr.text()
    message = ""
    if reason is None:
        if state.get("OOMKilled"):
            reason = StopReason.MEMORY_LIMIT
        elif exit_code is None or state.get("Running"):
            reason = StopReason.SANDBOX_UNAVAILABLE
        elif exit_code != 0 or zero_fails:
            reason = StopReason.EXIT_CODE
            sig = signal_from_init_status(exit_code)  # Docker's init: 128 + N
            if sig is not None:
                exit_code = None
                reason = StopReason.CPU_LIMIT if sig == signal.SIGXCPU else StopReason.SIGNAL
            elif (failure := exec_failure(exit_code, stderr_tail, token)) is not None:
                reason, message, stderr_tail = StopReason.NOT_EXECUTABLE, failure.why, failure.stderr_tail
    if reason is StopReason.SANDBOX_UNAVAILABLE:
        message = "the container did not report an exit status"
    return SandboxOutcome(
        exit_code=exit_code,
        signal=sig,
        stdout=stdout if reason is not StopReason.OUTPUT_LIMIT else b"",
        stderr_tail=stderr_tail,
        duration_ms=duration_ms,
        reason=reason,
        message=message,
    )
