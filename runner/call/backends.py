"""Which backend serves a plan's ``sandbox`` name: the installed plugins (entry point group
``runner.sandboxes``), each configured from the policy's ``sandbox.backends.NAME`` and
built when first needed."""

from __future__ import annotations

import threading
from typing import Any

from runner.call.policy import Policy
from runner.errors import ConfigError
from runner.tools.manifest import Tool
from sandboxes import (
    BackendConfigError,
    ChecksTools,
    Closable,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxUnavailable,
    ToolRequirements,
    plugins,
)
from sandboxes.cancellation import finish_each


class UnusableSandbox:
    """Stands in for a backend that is not installed or cannot be built: fails closed."""

    def __init__(self, name: str, problem: str) -> None:
        self.name = name
        self._problem = problem

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        raise SandboxUnavailable(self._problem)


class Backends:
    """The backends of one ``Runner``, by name."""

    def __init__(self, policy: Policy) -> None:
        self._policy = policy
        self._built: dict[str, Sandbox] = {}
        self._lock = threading.Lock()

    def installed(self) -> list[str]:
        return sorted(plugins.installed())

    def _config(self, name: str) -> dict[str, Any]:
        return dict(self._policy.model.sandbox.backends.get(name, {}))

    def check_config(self) -> None:
        """Build every backend the policy configures, so a bad mapping stops the load.

        Raises:
            ConfigError: a configured backend is not installed or refuses its settings.
        """
        for name in self._policy.model.sandbox.backends:
            if name not in plugins.installed():
                installed = ", ".join(self.installed()) or "none"
                raise ConfigError(
                    self._policy.source,
                    f"sandbox.backends.{name}: no such backend is installed (installed: {installed})",
                )
            try:
                self(name)
            except BackendConfigError as exc:
                raise ConfigError(self._policy.source, str(exc)) from exc

    def __call__(self, name: str) -> Sandbox:
        """The backend ``name`` (the same object for every call of this runner).

        Raises:
            BackendConfigError: its settings are refused (``check_config`` finds this first).
        """
        with self._lock:
            backend = self._built.get(name)
            if backend is None:
                try:
                    backend = plugins.create(name, self._config(name))
                except plugins.UnknownBackend:
                    backend = UnusableSandbox(name, f"no sandbox backend named {name!r} is installed")
                self._built[name] = backend
            return backend

    def manifest_problems(self, tool: Tool) -> list[str]:
        """Why the tool's own backend cannot take it; empty when it can."""
        return self.tool_problems(tool.manifest.sandbox, tool.requirements())

    def tool_problems(self, name: str, tool: ToolRequirements) -> list[str]:
        """Why a manifest naming backend ``name`` cannot be registered; empty if it can."""
        if name not in plugins.installed():
            known = ", ".join(self.installed()) or "none"
            return [f"sandbox: no backend named {name!r} is installed (installed: {known})"]
        backend = self(name)
        return backend.tool_problems(tool) if isinstance(backend, ChecksTools) else []

    async def aclose(self) -> None:
        """Close every backend that holds something (pools, connections)."""
        with self._lock:
            built = list(self._built.values())
        await finish_each(backend.aclose for backend in built if isinstance(backend, Closable))
