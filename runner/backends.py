"""Which sandbox backend serves a plan's ``sandbox`` name, built on first use."""

from __future__ import annotations

import os
import threading

from runner.policy import Policy
from sandboxes import LaunchSpec, Limits, PreparedSandbox, Sandbox, SandboxUnavailable


class UnknownSandbox:
    """Stands in for a backend that does not exist, so the call fails closed."""

    def __init__(self, name: str) -> None:
        self.name = name

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        raise SandboxUnavailable(f"no sandbox backend named {self.name!r}")


class DefaultSandboxes:
    """The real backends, configured from the policy. ``RUNNER_BWRAP`` names the launcher."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._built: dict[str, Sandbox] = {}
        self._lock = threading.Lock()

    def __call__(self, name: str) -> Sandbox:
        with self._lock:
            sandbox = self._built.get(name)
            if sandbox is None:
                sandbox = self._build(name)
                self._built[name] = sandbox
            return sandbox

    def _build(self, name: str) -> Sandbox:
        settings = self._policy.model.sandbox
        if name == "subprocess":
            from sandboxes.subprocess import SubprocessConfig, SubprocessSandbox

            return SubprocessSandbox(
                SubprocessConfig(
                    bwrap=os.environ.get("RUNNER_BWRAP") or None,
                    allow_degraded=settings.allow_degraded,
                )
            )
        if name == "docker":
            from sandboxes.docker import DockerSandbox  # the docker SDK is slow to import

            return DockerSandbox()
        return UnknownSandbox(name)
