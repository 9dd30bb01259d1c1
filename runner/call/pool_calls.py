"""A call's side of a warm pool: the backend that takes a warm sandbox when one
fits the call, and the taken sandbox serving its one call."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Protocol

from runner.call.hosting import Adopts, HeldOpening
from runner.call.pool_health import CpuReadings
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
from sandboxes.events import EventSink, StreamsEvents


@dataclass(frozen=True)
class Ready:
    """An idle warm sandbox: when it was made ready, and the handshake it was primed with
    (None: not primed)."""

    warm: WarmSandbox
    made: float
    handshake: HeldOpening | None = None
    # The keeper's last readings of its CPU time, (when, seconds): how busy it is now.
    cpu: CpuReadings = field(default_factory=CpuReadings)


class Takes(Protocol):
    """Where a call takes a warm sandbox from (``WarmPools``)."""

    def take(self, tool_name: str, limits: Limits) -> tuple[Ready, Callable[[], None]] | None: ...


class PoolingSandbox:
    """A call's backend that takes a warm sandbox when one fits, else prepares cold."""

    def __init__(self, pools: Takes, tool_name: str, backend: Sandbox) -> None:
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
        self, warm: WarmSandbox, release: Callable[[], None], handshake: HeldOpening | None = None
    ) -> None:
        self._warm = warm
        self._release: Callable[[], None] | None = release
        self._handshake = handshake

    async def run(self, payload: bytes) -> SandboxOutcome:
        return replace(await self._warm.run(payload), warm=True)

    def stream_events(self, sink: EventSink) -> None:
        if isinstance(self._warm, StreamsEvents):
            self._warm.stream_events(sink)

    async def converse(self, dialogue: Dialogue) -> SandboxOutcome:
        if not isinstance(self._warm, Converses):
            raise SandboxUnavailable("this warm sandbox cannot host an MCP server")
        if self._handshake is not None:
            if not isinstance(dialogue, Adopts) or self._handshake.result is None:
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
