"""User-mode networking (slirp4netns) for a sandbox's own network namespace.

``network: true`` never means the host's network namespace: the tool gets a namespace
of its own whose only way out is slirp4netns, which opens the tool's connections as
ordinary sockets of the host. ``--disable-host-loopback`` refuses its gateway's
``10.0.2.2`` -> host ``127.0.0.1`` mapping, so services that listen only on the host's
loopback (the runner's own ports, a database on 127.0.0.1) are out of reach, and abstract
unix sockets (namespaced by network namespace) are too. Addresses the host itself can
reach, its own non-loopback ones included, are reachable as from any other machine.

slirp4netns ends when the runner closes its exit descriptor, so it dies with the runner
even when the runner is killed.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import subprocess
import time

from sandboxes._kernel import ready
from sandboxes.base import SandboxUnavailable

# slirp4netns configures tap0 in a few milliseconds; this only bounds a stuck start.
READY_TIMEOUT_S = 5.0
# The nameserver slirp4netns answers on inside the namespace (it forwards to the host's).
SLIRP_DNS = "10.0.2.3"
INSTALL_HINT = "apt-get install slirp4netns"


def find_slirp4netns() -> str | None:
    return shutil.which("slirp4netns")


class UserNetwork:
    """One running slirp4netns attached to one sandbox's network namespace."""

    def __init__(self, process: subprocess.Popen[bytes], exit_fd: int) -> None:
        self._process = process
        self._exit_fd: int | None = exit_fd

    @classmethod
    def start(cls, binary: str, namespace_path: str, userns_path: str | None = None) -> UserNetwork:
        """Attach slirp4netns to the namespace at ``namespace_path`` and wait until tap0 is up.
        ``userns_path``: the user namespace that owns it, joined first (a runner not root).

        Raises:
            SandboxUnavailable: it did not start or did not configure the interface in time.
        """
        ready_read, ready_write = os.pipe()
        exit_read, exit_write = os.pipe()
        # --enable-sandbox (a mount namespace of its own) needs root in the namespace's
        # user namespace, which a rootless one does not map: there, a seccomp filter of
        # its own bounds what a compromised slirp4netns, the user's own process, could do.
        confine = ["--enable-sandbox"]
        if userns_path is not None:
            confine = ["--enable-seccomp", f"--userns-path={userns_path}"]
        argv = [
            binary, "--configure", "--mtu=65520", "--disable-host-loopback", *confine,
            "--netns-type=path", f"--ready-fd={ready_write}", f"--exit-fd={exit_read}",
            namespace_path, "tap0",
        ]  # fmt: skip
        try:
            process = subprocess.Popen(
                argv,
                stdin=subprocess.DEVNULL,
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                pass_fds=(ready_write, exit_read),
                start_new_session=True,
            )
        except OSError as exc:
            for fd in (ready_read, ready_write, exit_read, exit_write):
                os.close(fd)
            raise SandboxUnavailable(f"cannot start slirp4netns: {exc.strerror}") from exc
        os.close(ready_write)
        os.close(exit_read)
        network = cls(process, exit_write)
        try:
            ready = _wait_ready(ready_read, process)
        finally:
            os.close(ready_read)
        if not ready:
            problem = _last_line(network.stop())
            raise SandboxUnavailable(f"slirp4netns did not set up the network: {problem}")
        return network

    def stop(self) -> bytes:
        """End slirp4netns (closing its exit descriptor, then SIGKILL) and reap it; its stderr."""
        if self._exit_fd is not None:
            os.close(self._exit_fd)
            self._exit_fd = None
        with contextlib.suppress(ProcessLookupError):
            self._process.send_signal(signal.SIGKILL)
        _, stderr = self._process.communicate()
        return stderr or b""


def _wait_ready(ready_fd: int, process: subprocess.Popen[bytes]) -> bool:
    deadline = time.monotonic() + READY_TIMEOUT_S
    while (left := deadline - time.monotonic()) > 0:
        if ready([ready_fd], left):
            return os.read(ready_fd, 1) == b"1"
        if process.poll() is not None:
            return False
    return False


def _last_line(stderr: bytes) -> str:
    lines = stderr.decode(errors="replace").strip().splitlines()
    return lines[-1][:160] if lines else "no message"
