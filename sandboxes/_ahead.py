"""Starting a sandbox ahead of its call (SPEC 11), the same way in every backend."""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol, TypeVar

from sandboxes.base import LaunchSpec, SandboxUnavailable


class _Startable(Protocol):
    def start_waiting(self) -> None: ...

    def discard(self) -> None: ...


S = TypeVar("S", bound=_Startable)


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
