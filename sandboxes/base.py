"""The one interface every isolation backend implements.

The life of a sandbox is: ``prepare`` (everything that does not need the payload:
scratch space, cgroups, later a pre-spawned process), ``run`` (feed the payload, wait
under the limits, collect the outcome) and ``close`` (tear everything down). A prepared
sandbox serves exactly one run and is never reused.
"""

from __future__ import annotations

import enum
import socket
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal, Protocol, runtime_checkable

WorkspaceMode = Literal["none", "read", "write"]


class StopReason(enum.StrEnum):
    """Why a run ended other than by a clean exit 0. Values are the wire's ``reason``."""

    EXIT_CODE = "exit_code"
    SIGNAL = "signal"
    TIMEOUT = "timeout"
    MEMORY_LIMIT = "memory_limit"
    CPU_LIMIT = "cpu_limit"
    PIDS_LIMIT = "pids_limit"
    OUTPUT_LIMIT = "output_limit"
    # The tool's program could not be started inside the sandbox (not found, no execute
    # right, a format the kernel cannot run); ``message`` says which, ``exit_code`` is the
    # starter's 127 or 126. Never claimed on the word of the tool itself.
    NOT_EXECUTABLE = "not_executable"
    SANDBOX_UNAVAILABLE = "sandbox_unavailable"
    # The cluster node running the sandbox was lost in the middle of the run (dispatch: a
    # dispatched call); ``message`` says which node. Nothing of the tool's doing.
    NODE_LOST = "node_lost"
    # The tool ran, but its staged workspace writes could not all be applied once its
    # sandbox was gone (``message`` says why); some may have been. Nothing of the tool's doing.
    WORKSPACE_NOT_APPLIED = "workspace_not_applied"


@dataclass(frozen=True)
class Limits:
    """Resource limits of one attempt, already resolved against the policy's ceilings."""

    timeout_ms: int = 5000
    memory_mb: int = 256
    cpu_seconds: int = 10
    max_pids: int = 64
    max_output_bytes: int = 1024 * 1024
    disk_mb: int = 64
    network: bool = False


@runtime_checkable
class EgressEndpoint(Protocol):
    """The runner's egress proxy of one call, which a backend makes reachable inside the
    sandbox on its loopback at ``127.0.0.1:port`` (the tool then has no other network)."""

    port: int

    async def attach(self, listener: socket.socket) -> None:
        """Serve on ``listener``, a non-blocking TCP socket already listening on
        ``127.0.0.1:port`` inside the sandbox's network namespace; from now on it is the
        endpoint's to close (it does so when the call ends)."""
        ...


@dataclass(frozen=True)
class LaunchSpec:
    """What to run and what it may see. Paths are host paths; the backend maps them."""

    tool_name: str
    request_id: str
    command: tuple[str, ...]
    tool_dir: Path
    env: Mapping[str, str] = field(default_factory=dict)
    workspace: Path | None = None
    workspace_mode: WorkspaceMode = "none"
    image: str | None = None
    runtime: str | None = None
    # With an egress endpoint the tool gets loopback only, with the endpoint on it; a
    # backend that cannot do that refuses the tool (SandboxUnavailable).
    egress: EgressEndpoint | None = None
    # Environment variables too, but secret: a backend delivers them so that no one but
    # the tool sees them (not in argv, not in a container's config); never in a repr.
    secrets: Mapping[str, str] = field(default_factory=dict, repr=False)


@dataclass(frozen=True)
class SandboxOutcome:
    """What one run produced. ``reason`` is ``None`` exactly when the tool exited 0."""

    exit_code: int | None
    signal: int | None
    stdout: bytes
    stderr_tail: str
    duration_ms: float
    reason: StopReason | None = None
    message: str = ""
    degraded: bool = False
    # When degraded: each isolation layer that was missing, with what to install.
    missing: tuple[str, ...] = ()
    # The run used a sandbox started ahead of its call (a warm pool), or forked from a
    # template of its tool (fork mode: ``forked`` too).
    warm: bool = False
    forked: bool = False
    # The cluster node the run was dispatched to; None for a run on this host.
    node: str | None = None

    @property
    def ok(self) -> bool:
        return self.reason is None

    @classmethod
    def never_ran(cls, reason: StopReason, message: str) -> SandboxOutcome:
        """The outcome of an attempt whose tool never ran (no sandbox, a lost node)."""
        return cls(None, None, b"", "", 0.0, reason=reason, message=message)


class SandboxUnavailable(Exception):
    """The backend cannot give the isolation asked for; the tool was not started."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class WorkspaceNotApplied(Exception):
    """Raised by ``close``: the call's staged workspace writes could not all be applied."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class PreparedSandbox(Protocol):
    """A sandbox made ready for one call."""

    async def run(self, payload: bytes) -> SandboxOutcome:
        """Feed ``payload`` on stdin and wait for the outcome under the limits.

        Raises:
            SandboxUnavailable: the tool could not be started in the required isolation.
        """
        ...

    async def close(self) -> None:
        """Kill whatever is left and release every resource. Safe to call twice.

        Raises:
            WorkspaceNotApplied: everything was released, but the writes were not all applied.
        """
        ...


class Pipe(Protocol):
    """A running tool's stdin and stdout, as a ``Dialogue`` sees them."""

    async def send(self, data: bytes) -> None:
        """Write ``data`` to the tool's stdin (waiting while the tool does not read).

        The sandbox's own init process shares the tool's stdin in both backends
        (bubblewrap's, Docker's ``docker-init``), so a tool that closes its stdin but runs
        on is not told from one that does not read: its sends wait, until the run ends.

        Raises:
            ConnectionError: the tool's stdin is closed for good (the tool is gone).
        """
        ...

    async def receive(self) -> bytes:
        """The next bytes the tool wrote on stdout; ``b""`` once it closed stdout. What
        passes the run's ``max_output_bytes`` in total is never returned: the run ends
        then as ``output_limit``, and this call waits until it is cancelled."""
        ...


class Dialogue(Protocol):
    """A conversation with a tool that answers more than once (an MCP server).

    The backend starts the tool as for ``run`` and lets ``talk`` speak with it; the run
    ends when ``talk`` returns (the tool is then killed: a conversation's end is not the
    tool's to choose), and otherwise as any run ends: the tool exits (even with status
    0: ``exit_code``), the timeout passes (counted from the start of ``talk``), a limit
    breaks. The outcome's ``stdout`` is empty: what was said is the dialogue's to keep.
    ``talk`` must not raise; at the tool's end of stdout it waits (the tool's exit, or
    the timeout, tells how the run ended).
    """

    async def talk(self, pipe: Pipe) -> None: ...


@runtime_checkable
class Converses(Protocol):
    """A prepared sandbox that can hold a ``Dialogue`` instead of one payload."""

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        """Start the tool (or take the one started ahead) and hold ``dialogue`` with it
        under the limits. ``reason`` is None exactly when ``talk`` returned.

        Raises:
            SandboxUnavailable: the tool could not be started in the required isolation.
        """
        ...


class WarmSandbox(PreparedSandbox, Protocol):
    """A sandbox started ahead of its call: its program runs and waits for its payload.

    Made and discarded from a plain thread, off every event loop: it outlives the loop
    of any one call (a synchronous ``Runner.call`` runs each call on a fresh loop).
    """

    def set_timeout(self, timeout_ms: int) -> None:
        """The run's timeout, counted from the moment ``run`` writes the payload; the
        call's own, known only when the call takes the sandbox."""
        ...

    def discard(self) -> None:
        """``close`` from a thread (blocking): for a sandbox that no call took."""
        ...


class OpeningFailed(Exception):
    """A warm sandbox's tool did not go through its ``Opening``: it answered wrongly or
    not in time, closed its output, or wrote past ``max_output_bytes``."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.message = message


class OpeningPipe(Protocol):
    """A started tool's stdin and stdout as an ``Opening`` sees them: blocking, from the
    pool's thread, every wait bounded by the prime's own deadline."""

    def send(self, data: bytes) -> None:
        """Write all of ``data`` to the tool's stdin.

        Raises:
            ConnectionError: the tool's stdin is closed (the tool is gone).
            TimeoutError: the tool did not read it before the prime's deadline.
        """
        ...

    def receive(self, timeout_s: float) -> bytes:
        """The next bytes the tool wrote on stdout; ``b""`` once it closed stdout.

        Raises:
            TimeoutError: nothing came within ``timeout_s`` (or the prime's deadline).
            OpeningFailed: the tool wrote past the run's ``max_output_bytes``.
        """
        ...


class Opening(Protocol):
    """What is said to a tool started ahead before its call is known (the MCP
    ``initialize`` of a hosted server), so that its call starts past it."""

    def open(self, pipe: OpeningPipe, timeout_s: float) -> bytes:
        """Speak with the tool through ``pipe`` within ``timeout_s``; return what was
        received but not consumed (the call's dialogue receives those bytes first).

        Raises:
            OpeningFailed: the tool did not answer as the opening requires.
            TimeoutError, ConnectionError: from ``pipe``.
        """
        ...


@runtime_checkable
class Primes(Protocol):
    """A warm sandbox whose tool can be spoken to before its call (a hosted MCP server)."""

    def prime(self, opening: Opening, timeout_s: float) -> None:
        """Hold ``opening`` with the started tool (blocking: the pool's thread, right after
        ``prestart``). What the tool writes on stderr meanwhile goes to the run's tail;
        what it writes on stdout counts against the run's ``max_output_bytes``. The sandbox
        then serves one ``converse``, whose dialogue starts where the opening stopped.

        Raises:
            OpeningFailed: the opening failed or timed out, the tool closed its pipes or
                wrote too much. The caller discards the sandbox.
        """
        ...

    def interrupt(self) -> None:
        """Cut short a ``prime`` in progress, from another thread (a runner closing): the
        tool is cut off, ``prime`` raises ``OpeningFailed`` at once. Never raises."""
        ...


@runtime_checkable
class PreStarts(Protocol):
    """A backend that can start sandboxes ahead of their calls (warm pools)."""

    def prestart(self, spec: LaunchSpec, limits: Limits) -> WarmSandbox:
        """Prepare a sandbox and start its program, blocked on its stdin (blocking).

        Raises:
            SandboxUnavailable: this machine cannot give the isolation required, or
                ``spec`` needs what only a call can give (an egress endpoint).
        """
        ...


@dataclass(frozen=True)
class ToolRequirements:
    """What a manifest asks of its backend, for the backend's own rules at load time."""

    name: str
    command: tuple[str, ...]
    image: str | None = None
    network: bool = False
    workspace_mode: WorkspaceMode = "none"


@dataclass(frozen=True)
class Check:
    """One line of ``runner doctor``: an isolation layer, whether it works here, and the fix."""

    name: str
    ok: bool
    detail: str
    hint: str = ""


class BackendConfigError(ValueError):
    """The policy's ``sandbox.backends.NAME`` mapping is not valid for that backend."""


class Sandbox(Protocol):
    """An isolation backend. Made by its entry point's factory, which does no I/O.

    Beyond ``prepare``, a backend may have (each optional, found with ``isinstance``):
    ``ChecksTools.tool_problems``, ``ChecksMachine.checks``, ``Closable.aclose``,
    ``PreStarts.prestart``, ``StartsEarly.start_early`` and ``ProbesImages.image_probe``.
    """

    name: str

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        """Make a sandbox ready for one run.

        Raises:
            SandboxUnavailable: this machine cannot give the isolation required.
        """
        ...


@runtime_checkable
class ChecksTools(Protocol):
    """A backend with rules of its own for manifests (e.g. docker needs an ``image``)."""

    def tool_problems(self, tool: ToolRequirements) -> list[str]:
        """What is wrong with this tool for this backend; empty when nothing is."""
        ...


@runtime_checkable
class ChecksMachine(Protocol):
    """A backend that can say which of its layers work on this machine (``runner doctor``)."""

    def checks(self) -> list[Check]:
        """Each layer checked for real (this may take a moment and spawn processes)."""
        ...


@runtime_checkable
class Closable(Protocol):
    """A backend holding something beyond single sandboxes (a connection, a pool)."""

    async def aclose(self) -> None:
        """Release it; no sandbox of this backend may be alive afterwards."""
        ...


@runtime_checkable
class StartsEarly(Protocol):
    """A backend with something to start before its first sandbox (our backends: the
    runner's watchdog process, which sweeps up after a runner that dies), which a host
    may begin early so that it boots while the host goes on loading."""

    def start_early(self) -> None:
        """Begin it now, without waiting for it; the first ``prepare`` waits until it is
        ready. Never raises: a failure is met again, and raised, by ``prepare``."""
        ...


@runtime_checkable
class ImageProbe(Protocol):
    """Questions about a backend's images, answered without running a tool.
    ``close`` releases what the answers needed (containers made to look inside)."""

    def image_problem(self, image: str) -> str | None:
        """Why ``image`` cannot be used (it does not exist, with how to build it), or None.

        Raises:
            SandboxUnavailable: the image store could not say.
        """
        ...

    def command_problem(self, image: str, command: Sequence[str], env: Mapping[str, str]) -> str | None:
        """Why ``command[0]`` is not in ``image`` (a bare name looked up on the ``PATH`` of
        ``env``, else the sandbox's default), or None; a command in the tool's folder is
        not this probe's to check.

        Raises:
            SandboxUnavailable: the image store could not say.
        """
        ...

    def close(self) -> None:
        """Release what the probe made; never raises."""
        ...


@runtime_checkable
class ProbesImages(Protocol):
    """A backend whose tools run from images it can look into (``runner validate``)."""

    def image_probe(self) -> ImageProbe:
        """A probe on this backend's image store; the caller closes it.

        Raises:
            SandboxUnavailable: the image store cannot be reached.
        """
        ...
