"""The network namespace of one subprocess sandbox, made by the runner before the tool.

Without a network the sandbox needs nothing from here: bubblewrap's ``--unshare-net``
gives it an empty namespace. With ``network: true`` or an egress endpoint the runner
makes the namespace itself, so that what the tool's network consists of exists before
the tool does: slirp4netns attached to it (``network: true``), or the runner's egress
proxy listening on its loopback (an allow-list). The launcher joins it with ``nsenter``
before bubblewrap starts, and bubblewrap then leaves the network namespace alone.

As root the namespace belongs to the host's user namespace. Without root it belongs to
a user namespace made for it (``sandboxes._rootless_netns``) that maps only the runner's
own ids; the launcher joins that one too, without capabilities, and bubblewrap makes the
tool's user namespace inside it. Either way the tool, root of nothing that owns the
namespace, cannot change its interfaces or routes.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import shutil
import socket
from pathlib import Path

from sandboxes._netns import NamespaceError, listen_inside, new_namespace
from sandboxes._rootless_netns import RootlessNamespaceError, open_namespaces
from sandboxes._usernet import INSTALL_HINT, UserNetwork, find_slirp4netns
from sandboxes.base import Check, LaunchSpec, Limits, SandboxUnavailable

# slirp4netns makes tap0 through this device; stock udev rules leave it open to all
# (the kernel alone makes it root's only), and without root it must be.
TUN = "/dev/net/tun"
TUN_HINT = f"chmod 0666 {TUN}, as udev's default rules leave it on a stock system"
USERNS_HINT = (
    "allow unprivileged user namespaces (Debian: sysctl kernel.unprivileged_userns_clone=1; "
    "Ubuntu 24.04: kernel.apparmor_restrict_unprivileged_userns=0)"
)


def network_checks() -> list[Check]:
    """``runner doctor``: make each kind of network for real, then let it go."""
    checks = []
    probe = LaunchSpec("doctor", "doctor", ("true",), Path("/"))
    for name, limits, egress in (
        ("own network", Limits(network=True), None),
        ("egress network", Limits(), _ProbeEndpoint()),
    ):
        spec = dataclasses.replace(probe, egress=egress)
        try:
            network = SandboxNetwork.open(limits, spec)
        except SandboxUnavailable as exc:
            checks.append(Check(name, False, exc.message[:160], _fix(limits)))
            continue
        assert network is not None
        network.close()
        own = "slirp4netns, host loopback refused"
        detail = own if limits.network else "loopback only, proxy inside"
        if os.geteuid() != 0:
            detail += "; as you, in a user namespace of its own"
        checks.append(Check(name, True, detail))
    return checks


def _fix(limits: Limits) -> str:
    """What to do when the doctor could not make this kind of network."""
    if shutil.which("nsenter") is None:
        return "apt-get install util-linux"
    if limits.network and find_slirp4netns() is None:
        return INSTALL_HINT
    if os.geteuid() == 0:
        return "see the message: the kernel refused a network namespace"
    if limits.network and not _tun_usable():
        return TUN_HINT
    return USERNS_HINT


def _tun_usable() -> bool:
    return os.access(TUN, os.R_OK | os.W_OK)


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
    if shutil.which("nsenter") is None:
        return "nsenter is not installed (apt-get install util-linux)"
    if limits.network and find_slirp4netns() is None:
        return f"slirp4netns is not installed ({INSTALL_HINT})"
    if limits.network and os.geteuid() != 0 and not _tun_usable():
        return f"{TUN} is not usable by uid {os.geteuid()}: slirp4netns cannot run as it (chmod 0666 {TUN})"
    return None


class SandboxNetwork:
    """A held network namespace, with slirp4netns or the egress listener in it; without
    root, with the user namespace that owns it."""

    def __init__(self, namespace_fd: int, user_fd: int | None = None) -> None:
        self._fd: int | None = namespace_fd
        self._user_fd = user_fd
        self.user_network: UserNetwork | None = None
        self.listener: socket.socket | None = None

    @property
    def path(self) -> str:
        """The namespace as a path the runner's children may open while the runner holds it."""
        assert self._fd is not None
        return f"/proc/{os.getpid()}/fd/{self._fd}"

    @property
    def user_path(self) -> str | None:
        """Without root, the user namespace that owns it, as a path; None as root."""
        return f"/proc/{os.getpid()}/fd/{self._user_fd}" if self._user_fd is not None else None

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
        network = cls._rootless(spec) if os.geteuid() != 0 else cls._as_root()
        try:
            if limits.network:
                slirp = find_slirp4netns()
                assert slirp is not None  # network_problem said so
                network.user_network = UserNetwork.start(slirp, network.path, network.user_path)
            if spec.egress is not None and network.listener is None:
                network.listener = listen_inside(network.path, spec.egress.port)
        except NamespaceError as exc:
            network.close()
            raise SandboxUnavailable(f"cannot open the egress proxy in the sandbox: {exc.strerror}") from exc
        except BaseException:
            network.close()
            raise
        return network

    @classmethod
    def _as_root(cls) -> SandboxNetwork:
        try:
            return cls(new_namespace())
        except NamespaceError as exc:
            raise SandboxUnavailable(f"cannot make the tool's network namespace: {exc.strerror}") from exc

    @classmethod
    def _rootless(cls, spec: LaunchSpec) -> SandboxNetwork:
        """The helper opens the egress listener too: the runner cannot enter the namespace."""
        try:
            held = open_namespaces(spec.egress.port if spec.egress is not None else None)
        except RootlessNamespaceError as exc:
            raise SandboxUnavailable(exc.strerror or "cannot make the tool's network namespace") from exc
        network = cls(held.net_fd, held.user_fd)
        network.listener = held.listener
        return network

    def take_listener(self) -> socket.socket | None:
        """The egress listener, handed over once to its endpoint (which closes it)."""
        listener, self.listener = self.listener, None
        return listener

    def enter_argv(self, nsenter: str) -> list[str]:
        """The prefix that makes the launcher's next program join the namespace (and,
        without root, its user namespace, keeping the runner's ids: no capability
        survives the exec of a program run by a uid other than 0)."""
        if self.user_path is None:
            return [nsenter, f"--net={self.path}", "--"]
        return [nsenter, f"--user={self.user_path}", f"--net={self.path}", "--preserve-credentials", "--"]

    def close(self) -> None:
        """Stop slirp4netns and let the namespace go. Safe to call twice."""
        if self.user_network is not None:
            self.user_network.stop()
            self.user_network = None
        if self.listener is not None:
            self.listener.close()
            self.listener = None
        for fd in (self._fd, self._user_fd):
            if fd is not None:
                with contextlib.suppress(OSError):
                    os.close(fd)
        self._fd = self._user_fd = None
