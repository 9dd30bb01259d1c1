"""The network namespace of one subprocess sandbox, made by the runner before the tool.

Without a network the sandbox needs nothing from here: bubblewrap's ``--unshare-net``
gives it an empty namespace. With ``network: true`` or an egress endpoint the runner
(root) makes the namespace itself, so that what the tool's network consists of exists
before the tool does: slirp4netns attached to it (``network: true``), or the runner's
egress proxy listening on its loopback (an allow-list). The launcher joins it with
``nsenter`` (as root, before dropping to the sandbox user), and bubblewrap then leaves
the network namespace alone. The namespace belongs to the host's user namespace, so the
tool, root of nothing there, cannot change its interfaces or routes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
from pathlib import Path

from sandboxes._netns import NamespaceError, listen_inside, new_namespace
from sandboxes._usernet import INSTALL_HINT, UserNetwork, find_slirp4netns
from sandboxes.base import Check, LaunchSpec, Limits, SandboxUnavailable

NEEDS_ROOT = "a network of the tool's own (network: true or an allow-list) needs the runner to run as root"
ROOT_HINT = "run the runner as root (rootless, tools get no network: network: false works)"


def network_checks() -> list[Check]:
    """``runner doctor``: make each kind of network for real, then let it go."""
    checks = []
    probe = LaunchSpec("doctor", "doctor", ("true",), Path("/"))
    for name, limits, egress, hint in (
        ("own network", Limits(network=True), None, INSTALL_HINT if os.geteuid() == 0 else ROOT_HINT),
        ("egress network", Limits(), _ProbeEndpoint(), ROOT_HINT),
    ):
        spec = dataclasses.replace(probe, egress=egress)
        try:
            network = SandboxNetwork.open(limits, spec)
        except SandboxUnavailable as exc:
            checks.append(Check(name, False, exc.message[:160], hint))
            continue
        assert network is not None
        network.close()
        own = "slirp4netns, host loopback refused"
        checks.append(Check(name, True, own if limits.network else "loopback only, proxy inside"))
    return checks


@dataclasses.dataclass
class _ProbeEndpoint:
    """An egress endpoint for the doctor's probe: nothing is ever served on it."""

    port: int = 3128

    async def attach(self, listener: socket.socket) -> None:
        listener.close()


def network_problem(limits: Limits, spec: LaunchSpec) -> str | None:
    """Why this machine cannot give the network the call asks for; None when it can."""
    if not limits.network and spec.egress is None:
        return None
    if os.geteuid() != 0:
        return NEEDS_ROOT
    if shutil.which("nsenter") is None:
        return "nsenter is not installed (apt-get install util-linux)"
    if limits.network and find_slirp4netns() is None:
        return f"slirp4netns is not installed ({INSTALL_HINT})"
    return None


class SandboxNetwork:
    """A held network namespace, with slirp4netns or the egress listener in it."""

    def __init__(self, namespace_fd: int) -> None:
        self._fd: int | None = namespace_fd
        self.user_network: UserNetwork | None = None
        self.listener: socket.socket | None = None

    @property
    def path(self) -> str:
        """The namespace as a path any root process may open while the runner holds it."""
        assert self._fd is not None
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    @classmethod
    def open(cls, limits: Limits, spec: LaunchSpec) -> SandboxNetwork | None:
        """The namespace this call needs, or None when bubblewrap's own empty one will do.

        Raises:
            SandboxUnavailable: the machine cannot give it; the tool must not run.
        """
        if not limits.network and spec.egress is None:
            return None
        problem = network_problem(limits, spec)
        if problem is not None:
            raise SandboxUnavailable(problem)
        try:
            network = cls(new_namespace())
        except NamespaceError as exc:
            raise SandboxUnavailable(f"cannot make the tool's network namespace: {exc.strerror}") from exc
        try:
            if limits.network:
                slirp = find_slirp4netns()
                assert slirp is not None  # network_problem said so
                network.user_network = UserNetwork.start(slirp, network.path)
            if spec.egress is not None:
                network.listener = listen_inside(network.path, spec.egress.port)
        except NamespaceError as exc:
            network.close()
            raise SandboxUnavailable(f"cannot open the egress proxy in the sandbox: {exc.strerror}") from exc
        except BaseException:
            network.close()
            raise
        return network

    def take_listener(self) -> socket.socket | None:
        """The egress listener, handed over once to its endpoint (which closes it)."""
        listener, self.listener = self.listener, None
        return listener

    def enter_argv(self, nsenter: str) -> list[str]:
        """The prefix that makes the launcher's next program join the namespace."""
        return [nsenter, f"--net={self.path}", "--"]

    def close(self) -> None:
        """Stop slirp4netns and let the namespace go. Safe to call twice."""
        if self.user_network is not None:
            self.user_network.stop()
            self.user_network = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        if self._fd is not None:
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None
