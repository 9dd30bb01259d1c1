"""Running calls: from synchronous code on a loop of their own, and known while in flight
(so that closing a runner can cancel them and wait for their sandboxes)."""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Coroutine
from concurrent.futures import Future
from dataclasses import dataclass, field
from typing import Any, TypeVar

T = TypeVar("T")


@dataclass(eq=False)
class InFlight:
    """A call being served: the task serving it, on its loop (any thread's)."""

    loop: asyncio.AbstractEventLoop
    task: asyncio.Task[Any]
    # Set when the call has ended, sandbox gone; awaitable from any thread's loop.
    ended: Future[None] = field(default_factory=Future)


def current_task() -> asyncio.Task[Any]:
    task = asyncio.current_task()
    if task is None:  # only a bare coroutine driven by hand has none
        raise RuntimeError("Runner calls must run in an asyncio task")
    return task


def run_blocking(work: Coroutine[Any, Any, T]) -> T:
    """Run ``work`` to its end from synchronous code: on a fresh event loop, or, when this
    thread already runs one (a notebook), on a private loop in a worker thread joined
    before returning (``asyncio.run`` refuses to nest)."""
    try:
        asyncio.get_running_loop()
    except RuntimeError:
        return asyncio.run(work)
    done: Future[T] = Future()

    def serve() -> None:
        try:
            done.set_result(asyncio.run(work))
        except BaseException as exc:  # handed to the caller's thread as is
            done.set_exception(exc)

    worker = threading.Thread(target=serve, name="runner-call")
    worker.start()
    worker.join()
    return done.result()
