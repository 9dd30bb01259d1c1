"""Preparing a sandbox from a thread, the same way in every backend: for a call (from its
event loop) and ahead of one (a warm pool's, from its thread)."""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import os
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Protocol, TypeVar

from sandboxes.base import LaunchSpec, SandboxUnavailable, WorkspaceNotApplied


class _Closable(Protocol):
    async def close(self) -> None: ...


class _Startable(Protocol):
    def start_waiting(self) -> None: ...

    def discard(self) -> None: ...


C = TypeVar("C", bound=_Closable)
S = TypeVar("S", bound=_Startable)
T = TypeVar("T")


# Preparations at once per backend: as many as an event loop's default executor would
# run (a slow daemon or network set-up must not hold up every other cold call).
PREPARE_THREADS = min(32, (os.cpu_count() or 1) + 4)


class Preparers:
    """A backend's own threads for preparing sandboxes, kept from one call to the next.

    Not the event loop's default executor: a synchronous ``Runner.call`` runs each call on
    a fresh loop, whose default executor is made (a thread started) and shut down (another
    thread, to join it) around every call. Measured, that was ~0.5 ms of CPU per cold call.
    Made on first use; ``shutdown`` (the backend's ``aclose``) joins them, and a later use
    makes new ones."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._lock = threading.Lock()
        self._pool: ThreadPoolExecutor | None = None

    def pool(self) -> ThreadPoolExecutor:
        with self._lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(PREPARE_THREADS, thread_name_prefix=self._name)
            return self._pool

    def shutdown(self) -> None:
        """Join the threads (blocking), after the preparations under way."""
        with self._lock:
            pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def submit(pool: ThreadPoolExecutor, work: Callable[[], T]) -> Future[T]:
    """``work()`` handed to one of a backend's own threads.

    Raises:
        SandboxUnavailable: the threads were just shut down: the backend is closing.
    """
    try:
        return pool.submit(work)
    except RuntimeError as exc:
        raise SandboxUnavailable("the sandbox backend is closing") from exc


async def prepare_in_thread(prepare: Callable[[], C], threads: Preparers) -> C:
    """Run the blocking ``prepare()`` (files, mounts, cgroups, daemon calls) in one of
    ``threads``. A caller cancelled meanwhile does not stop the thread, so what it made is
    closed before the cancellation goes on.

    Raises:
        SandboxUnavailable: as ``prepare``, or the backend is closing.
    """
    in_context = functools.partial(contextvars.copy_context().run, prepare)  # as asyncio.to_thread
    work = asyncio.wrap_future(submit(threads.pool(), in_context))
    try:
        return await asyncio.shield(work)
    except asyncio.CancelledError:
        with contextlib.suppress(SandboxUnavailable, WorkspaceNotApplied):  # the cancellation goes on
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
