"""``serve.max_concurrent``'s slots, handed out fairly between clients.

With one queue in order of arrival, a client that keeps many calls waiting holds every
other client's call behind all of them, until its deadline runs out. Here a freed slot
goes to the waiting call whose client has the fewest calls running (the one waiting
longest among those), so another client waits for one call to end, not for a queue. A
single client still gets every slot.
"""

from __future__ import annotations

import asyncio
import itertools
from collections import Counter
from dataclasses import dataclass, field


@dataclass(order=True)
class _Waiting:
    running: int  # the client's calls running when it was last looked at (for the order)
    arrived: int
    client: str | None = field(compare=False)
    granted: asyncio.Future[None] = field(compare=False)


class FairSlots:
    """``size`` slots; ``acquire(client)`` waits for one, ``release(client)`` gives it back."""

    def __init__(self, size: int) -> None:
        self._free = size
        self._running: Counter[str | None] = Counter()
        self._waiting: list[_Waiting] = []
        self._arrivals = itertools.count()

    async def acquire(self, client: str | None) -> None:
        """Wait for a slot (cancelled: none is held)."""
        if self._free > 0:  # nobody waits while a slot is free
            self._take(client)
            return
        waiting = _Waiting(0, next(self._arrivals), client, asyncio.get_running_loop().create_future())
        self._waiting.append(waiting)
        try:
            await waiting.granted
        except BaseException:
            if waiting.granted.done() and not waiting.granted.cancelled():
                self.release(client)  # granted as it was cancelled: handed on
            elif waiting in self._waiting:
                self._waiting.remove(waiting)
            raise

    def release(self, client: str | None) -> None:
        self._running[client] -= 1
        if self._running[client] <= 0:
            del self._running[client]
        self._free += 1
        # A waiter cancelled in this turn of the loop is not handed a slot it cannot take.
        self._waiting = [waiting for waiting in self._waiting if not waiting.granted.done()]
        while self._free > 0 and self._waiting:
            for waiting in self._waiting:
                waiting.running = self._running[waiting.client]
            chosen = min(self._waiting)
            self._waiting.remove(chosen)
            self._take(chosen.client)
            chosen.granted.set_result(None)

    def _take(self, client: str | None) -> None:
        self._free -= 1
        self._running[client] += 1
