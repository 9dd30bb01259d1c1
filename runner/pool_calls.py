"""A call's side of a warm pool (SPEC 11): the backend that takes a warm sandbox when one
fits the call, and the taken sandbox serving its one call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from sandboxes import (
    Converses,
    Dialogue,
    LaunchSpec,
    Limits,
    PreparedSandbox,
    Sandbox,
    SandboxOutcome,
    SandboxUnavailable,
    WarmSandbox,
)

if TYPE_CHECKING:
    import mcp_types

    from runner.hosted.session import Handshake
    from runner.pools import WarmPools


@runtime_checkable
class _Adopts(Protocol):
    """A dialogue that can start past a handshake done ahead (``runner.hosted.session``)."""

    def adopt(self, result: mcp_types.InitializeResult) -> None: ...


class PoolingSandbox:
    """A call's backend that takes a warm sandbox when one fits, else prepares cold."""

    def __init__(self, pools: WarmPools, tool_name: str, backend: Sandbox) -> None:
        self.name = backend.name
        self._pools = pools
        self._tool_name = tool_name
        self._backend = backend

    async def prepare(self, spec: LaunchSpec, limits: Limits) -> PreparedSandbox:
        if not spec.secrets and spec.egress is None:
            taken = self._pools.take(self._tool_name, limits)
            if taken is not None:
                ready, release = taken
                ready.warm.set_timeout(limits.timeout_ms)
                return _Taken(ready.warm, release, ready.handshake)
        return await self._backend.prepare(spec, limits)


class _Taken:
    """A warm sandbox serving its one call; its outcome says it was warm. A primed one
    gives its dialogue the handshake's result: its server is not initialized twice."""

    def __init__(
        self, warm: WarmSandbox, release: Callable[[], None], handshake: Handshake | None = None
    ) -> None:
        self._warm = warm
        self._release: Callable[[], None] | None = release
        self._handshake = handshake

    async def run(self, payload: bytes) -> SandboxOutcome:
        return replace(await self._warm.run(payload), warm=True)

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        if not isinstance(self._warm, Converses):
            raise SandboxUnavailable("this warm sandbox cannot host an MCP server")
        if self._handshake is not None:
            if not isinstance(dialogue, _Adopts) or self._handshake.result is None:
                raise SandboxUnavailable("this warm MCP server was initialized ahead for a call only")
            dialogue.adopt(self._handshake.result)
        return replace(await self._warm.converse(dialogue), warm=True)

    async def close(self) -> None:
        try:
            await self._warm.close()
        finally:
            release, self._release = self._release, None
            if release is not None:  # once, however often close is called
                release()
