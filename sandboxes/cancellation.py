"""Work that a cancellation must not cut short: teardown, and what prepare has made.

asyncio has no shielded scope like trio's ``CancelScope(shield=True)``; ``finish_shielded``
is the part of it a teardown needs: the work runs to its end in a task of its own, every
cancellation of the caller meanwhile is held back, and the caller is cancelled once the
work is done. A backend may use it for its own ``close`` too.
"""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, Iterable
from typing import TypeVar

T = TypeVar("T")


async def finish_shielded(work: Awaitable[T]) -> T:
    """Await ``work`` to its end even if the caller is cancelled meanwhile (any number of
    times); then re-raise that cancellation.

    A held cancellation wins over the work's own error, which becomes its ``__cause__``:
    a cancelled caller must see its cancellation, whatever the work ran into.

    Raises:
        asyncio.CancelledError: the caller was cancelled while the work ran.
        Exception: whatever the work raised, when the caller was not cancelled.
    """
    task = asyncio.ensure_future(work)
    cancelled: asyncio.CancelledError | None = None
    while not task.done():
        try:
            # ``wait`` never cancels what it waits for, and never raises the work's error.
            await asyncio.wait({task})
        except asyncio.CancelledError as exc:
            cancelled = exc
    if cancelled is None:
        return task.result()
    failure = None if task.cancelled() else task.exception()
    if failure is not None:
        raise cancelled from failure
    raise cancelled


async def finish_each(steps: Iterable[Callable[[], Awaitable[object]]]) -> None:
    """Await each of ``steps`` in turn, each whatever the ones before raised (a close loop:
    one failure must not leave the rest open); then raise what came first: a cancellation
    (with the first error as its cause), else the first error. A caller that must keep the
    steps in order under cancellation wraps this in ``finish_shielded``.

    Raises:
        asyncio.CancelledError: a step was cancelled.
        BaseException: the first error a step raised.
    """
    first: BaseException | None = None
    cancelled: asyncio.CancelledError | None = None
    for step in steps:
        try:
            await step()
        except asyncio.CancelledError as exc:  # held, as ``finish_shielded`` holds it
            cancelled = cancelled or exc
        except BaseException as exc:  # raised once every step has run
            first = first or exc
    if cancelled is not None:
        raise cancelled from first
    if first is not None:
        raise first
