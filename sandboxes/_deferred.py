"""Teardown of what is already dead, off the call's path.

Once every process of a sandbox is gone (checked on the call's path), what is left is
bookkeeping: empty cgroup folders to remove, a uid lease to give back, a stopped container
for the daemon to delete. None of it can run anything or be seen by another call, so a
call need not wait for it (a cgroup ``rmdir`` or a container's removal costs milliseconds
of a warm call's few). A backend hands such work to its ``DeferredTeardown``: one worker
thread, started on demand and gone after a second idle, does it in order.

``wait`` (the backend's ``aclose``, from ``Runner.aclose``) returns once all of it is
done, so a closed runner leaves nothing. A runner killed meanwhile leaves what the
queue held to the sweeps that already clean up after a killed runner: its watchdog
(cgroups, containers labelled with its pid, scratch folders), the next runner's startup
sweep, and the kernel (a lease is an ``flock``).
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable

# A worker with nothing to do for this long ends; the next teardown starts another.
IDLE_EXIT_S = 1.0


class DeferredTeardown:
    """An ordered queue of blocking teardown steps, run by one worker thread. Thread-safe."""

    def __init__(self, name: str) -> None:
        self._name = name
        self._cond = threading.Condition()
        self._queue: deque[Callable[[], None]] = deque()
        self._busy = 0  # queued or running
        self._worker: threading.Thread | None = None
        self._failure: BaseException | None = None

    def submit(self, step: Callable[[], None]) -> None:
        """Run ``step`` soon, in the worker thread (it must not need the caller's loop)."""
        with self._cond:
            self._queue.append(step)
            self._busy += 1
            if self._worker is None:
                self._worker = threading.Thread(target=self._work, name=self._name, daemon=True)
                self._worker.start()
            self._cond.notify_all()

    def pending(self) -> int:
        """Steps queued or running now (for tests)."""
        with self._cond:
            return self._busy

    def wait(self) -> None:
        """Block until every step submitted so far has run and the worker has ended (a
        closed runner leaves no thread).

        Raises:
            Exception: the first exception a step raised since the last ``wait`` (a bug:
                the steps are best-effort and handle their own failures).
        """
        with self._cond:
            while self._busy:
                self._cond.wait()
            failure, self._failure = self._failure, None
            worker, self._worker = self._worker, None  # a submit from now on starts another
            self._cond.notify_all()
        if worker is not None:
            worker.join()
        if failure is not None:
            raise failure

    def _work(self) -> None:
        while True:
            with self._cond:
                if not self._queue and self._worker is threading.current_thread():
                    self._cond.wait(IDLE_EXIT_S)
                if not self._queue or self._worker is not threading.current_thread():
                    if self._worker is threading.current_thread():
                        self._worker = None  # under the lock: a submit now starts a new worker
                    return
                step = self._queue.popleft()
            try:
                step()
            except Exception as exc:  # one failed step must not keep the others from running
                with self._cond:
                    self._failure = self._failure or exc
            finally:
                with self._cond:
                    self._busy -= 1
                    self._cond.notify_all()
