"""Preparing a sandbox from a thread, the same way in every backend: for a call (from its
event loop) and ahead of one (SPEC 11, from the pool's thread)."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import Callable
from typing import Protocol, TypeVar

from sandboxes.base import LaunchSpec, SandboxUnavailable


class _Closable(Protocol):
    async def close(self) -> None: ...


class _Startable(Protocol):
    def start_waiting(self) -> None: ...

    def discard(self) -> None: ...


C = TypeVar("C", bound=_Closable)
S = TypeVar("S", bound=_Startable)


async def prepare_in_thread(prepare: Callable[[], C]) -> C:
    """Run the blocking ``prepare()`` (files, mounts, cgroups, daemon calls) in a thread. A
    caller cancelled meanwhile does not stop the thread, so what it made is closed before
    the cancellation goes on."""
    work = asyncio.ensure_future(asyncio.to_thread(prepare))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(SandboxUnavailable):
            await (await work).close()
        raise


def start_ahead(spec: LaunchSpec, prepare: Callable[[], S]) -> S:
    """``prepare()`` a sandbox and start its tool, left waiting on stdin (blocking); a
    sandbox that fails to start is discarded.

    Raises:
        SandboxUnavailable: as ``prepare``; also for an egress endpoint, which exists only
            for its own call.
    """
    if spec.egress is not None:
        raise SandboxUnavailable("a sandbox with an egress proxy is made for its call only")
    prepared = prepare()
    try:
        prepared.start_waiting()
    except BaseException:
        prepared.discard()
        raise
    return prepared
